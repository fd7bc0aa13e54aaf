"""`localchat run MODEL --interactive` (app/cli_chat.py): turns kept as a conversation, commands,
an answer stopped with Ctrl+C, a refused turn; in-process over the fake engine."""
import io

import pytest

from fake_engine import FakeEngine
from live_server import png_bytes
from localchat.app.cli_chat import TerminalChat
from localchat.engine.runtime.request import ChatRequest, Final, ImagePart, Message, SamplingParams, Timings

TEMPLATE = ChatRequest((Message.text("system", "Be brief."),), SamplingParams(max_tokens=50, temperature=0.2))
IMAGE = ImagePart.from_bytes(png_bytes())


def lines(*typed):
    """read_line over `typed`, then end of input (Ctrl+D)."""
    it = iter(typed)

    def read(prompt):
        try:
            value = next(it)
        except StopIteration:
            raise EOFError
        if isinstance(value, BaseException):
            raise value
        return value

    return read


def load_image(path):
    if path != "cat.png":
        raise ValueError(f"no such image file: {path}")
    return IMAGE


def chat_over(engine):
    out, err = io.StringIO(), io.StringIO()
    return TerminalChat(engine, TEMPLATE, load_image, out=out, err=err), out, err


def roles(request):
    return [m.role for m in request.messages]


def test_turns_make_one_conversation_and_clear_starts_over():
    engine = FakeEngine(delay=0, filler_words=1)
    chat, out, err = chat_over(engine)
    chat.run(lines("second \\", "line", "/clear", "third", KeyboardInterrupt(), "/exit", "never"), first="first")
    first, second, third = engine.requests
    assert roles(first) == ["system", "user"] and roles(third) == ["system", "user"]
    assert roles(second) == ["system", "user", "assistant", "user"]
    assert second.messages[2].content[0].text == "Seen 0 image(s). You said: first w0"
    assert second.messages[2].reasoning == "Let me look. "  # kept, so the template may show it back
    assert second.messages[3].content[0].text == "second \nline"  # a backslash goes on to the next line
    assert (second.sampling, second.overflow) == (TEMPLATE.sampling, "drop_oldest")
    assert out.getvalue() == ("Seen 0 image(s). You said: first w0\n" "Seen 0 image(s). You said: second \nline w0\n"
                              "Seen 0 image(s). You said: third w0\n")
    assert "(a new conversation)" in err.getvalue() and "(Ctrl+D or /exit leaves)" in err.getvalue()
    assert len(engine.requests) == 3  # nothing after /exit


def test_images_go_with_the_next_message_only():
    engine = FakeEngine(delay=0, filler_words=0)
    chat, out, err = chat_over(engine)
    chat.run(lines("/image dog.png", "/image cat.png", "/image", "what is it?", "and now?", "/what"))
    asked, again = engine.requests
    assert [type(p).__name__ for p in asked.messages[-1].content] == ["ImagePart", "TextPart"]
    assert [type(p).__name__ for p in again.messages[-1].content] == ["TextPart"]
    assert out.getvalue().splitlines()[0] == "Seen 1 image(s). You said: what is it?"
    messages = err.getvalue()
    for said in ("(no such image file: dog.png)", "(1 image for the next message)", "(/image needs a file",
                 "(unknown command /what; /help lists them)"):
        assert said in messages


class StoppedStream:
    """Two words, then the Ctrl+C of a user who has read enough."""

    def __init__(self):
        self.closed = False

    def __iter__(self):
        from localchat.engine.runtime.request import Delta
        yield Delta(text="Once upon")
        yield Delta(text=" a time")
        raise KeyboardInterrupt

    def close(self):
        self.closed = True


class Refusing:
    def __init__(self):
        self.requests = []

    def submit(self, request):
        self.requests.append(request)
        if len(self.requests) == 1:
            self.stream = StoppedStream()
            return self.stream
        return Refused()


class Refused:
    def __iter__(self):
        yield Final("error", 0, 0, Timings(), error="the prompt has 9000 tokens and leaves no room")

    def close(self):
        pass


def test_a_stopped_answer_stays_and_a_refused_turn_does_not():
    engine = Refusing()
    chat, out, err = chat_over(engine)
    chat.run(lines("tell a story", "x" * 50, "go on"))
    story, refused, go_on = engine.requests
    assert engine.stream.closed and "(stopped)" in err.getvalue()
    assert go_on.messages[2].content[0].text == "Once upon a time"  # what was written stays
    assert roles(go_on) == ["system", "user", "assistant", "user"]  # the refused turn left no trace
    assert "localchat: the prompt has 9000 tokens" in err.getvalue()


@pytest.mark.parametrize("finish,note", [("length", "(cut at --max-tokens)")])
def test_notes_on_how_an_answer_ended(finish, note):
    engine = FakeEngine(delay=0, filler_words=40)
    chat, out, err = chat_over(engine)
    chat.template = ChatRequest((), SamplingParams(max_tokens=5))
    chat.run(lines("hi"))
    assert note in err.getvalue() and roles(engine.requests[0]) == ["user"]
