"""How a stored answer's end shows in the chat: cut at the token limit, with or without an answer."""
from localchat.app.ui_render import CUT_WHILE_THINKING, render, status_line

STATS = {"finish_reason": "length", "prompt_tokens": 9, "completion_tokens": 16, "context_length": 8192,
         "image_encode_s": 0.0, "prefill_s": 0.01, "first_token_s": 0.01, "decode_s": 0.2, "tokens_per_s": 80.0}


def _answer(history, text, reasoning, finish_reason):
    cid = history.create()
    history.add_message(cid, "user", "hi")
    history.add_message(cid, "assistant", text, reasoning=reasoning, stats=dict(STATS, finish_reason=finish_reason))
    return history.get(cid).messages


def test_an_answer_cut_while_thinking_says_what_to_do(history):
    chat, _ = render(_answer(history, "", "Let me think about", "length"), history)
    assert [m["content"] for m in chat if m["content"] == CUT_WHILE_THINKING] == [CUT_WHILE_THINKING]
    assert status_line(_answer(history, "", "Let me think about", "length")[-1])[0].startswith("cut at max tokens · ")
    # an answer that began keeps its text; one that ended on its own gets neither the note nor the mark
    cut, _ = render(_answer(history, "The sky is", "hmm", "length"), history)
    assert "The sky is" in [m["content"] for m in cut] and CUT_WHILE_THINKING not in [m["content"] for m in cut]
    done = _answer(history, "", "Nothing to say.", "stop")
    assert CUT_WHILE_THINKING not in [m["content"] for m in render(done, history)[0]]
    assert not status_line(done[-1])[0].startswith("cut")
