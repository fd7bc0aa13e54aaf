"""From generated token ids to answer and reasoning text and tool calls: incremental
detokenization, the family's output parser, stop strings, and removal of leftover special-token
text."""
from __future__ import annotations

from .detokenize import IncrementalDetokenizer
from .reasoning import reasoning_parser


class PlainAnswer:
    """An output parser for an answer without markup: all of it is answer text."""

    def __init__(self):
        self.calls: list = []

    def feed(self, text: str) -> tuple[str, str]:
        return text, ""

    def finish(self) -> tuple[str, str]:
        return "", ""


class TextAssembler:
    def __init__(self, tokenizer, family: str, thinking: bool, stop: tuple[str, ...] = (),
                 tools: tuple[dict, ...] = (), prefix: str = "", plain: bool = False):
        """prefix: answer text the prompt already ends with (a forced call's start,
        ChatFormatter.answer_prefix); the parser reads it first, and it is never shown. plain: the
        answer is exactly the generated text, read by no output parser (nor is `prefix`) and with no
        special-token text removed (JSON mode, whose tokens write one JSON object and never markup:
        a tag spelled out inside one of its strings is the model's text, not a channel or a call)."""
        self.detok = IncrementalDetokenizer(tokenizer)
        self.parser = PlainAnswer() if plain else reasoning_parser(family, thinking, tools)
        if not plain:
            # A forced call's start leaves the parser inside the call, where nothing is released yet.
            self.parser.feed(prefix)
        self.called = 0  # tool calls handed out so far
        self.stop = tuple(s for s in stop if s)
        self.hold = max((len(s) for s in self.stop), default=1) - 1
        self.pending = ""  # answer text held back while it could be the start of a stop string
        self.answer = ""
        self.reasoning = ""
        self.stopped = False
        # Special tokens that may leak into text (end-of-turn markers) are never shown.
        self.hidden = tuple(t for t in tokenizer.all_special_tokens if t not in ("<think>", "</think>"))
        self.hidden = tuple(t for t in self.hidden if not t.startswith("<|begin_of_box") and not t.startswith("<|end_of_box"))
        if plain:
            self.hidden = ()

    def _clean(self, text: str) -> str:
        for t in self.hidden:
            if t in text:
                text = text.replace(t, "")
        return text

    def _emit(self, answer: str, reasoning: str) -> tuple[str, str]:
        reasoning = self._clean(reasoning)
        self.pending += self._clean(answer)
        out = ""
        if self.stop:
            hits = [(self.pending.find(s), s) for s in self.stop if s in self.pending]
            if hits:
                pos, _ = min(hits)
                out, self.pending, self.stopped = self.pending[:pos], "", True
            else:
                cut = max(len(self.pending) - self.hold, 0)
                out, self.pending = self.pending[:cut], self.pending[cut:]
        else:
            out, self.pending = self.pending, ""
        self.answer += out
        self.reasoning += reasoning
        return out, reasoning

    def push(self, token_id: int) -> tuple[str, str]:
        """Returns the (answer, reasoning) text this token released."""
        if self.stopped:
            return "", ""
        return self._emit(*self.parser.feed(self.detok.push(token_id)))

    def finish(self) -> tuple[str, str]:
        if self.stopped:
            return "", ""
        a1, r1 = self.parser.feed(self.detok.flush())
        a2, r2 = self.parser.finish()
        answer, reasoning = self._emit(a1 + a2, r1 + r2)
        tail, self.pending = ("" if self.stopped else self.pending), ""
        self.answer += tail
        return answer + tail, reasoning

    def take_tool_calls(self) -> tuple:
        """The tool calls completed since the last call (ToolCall records)."""
        calls = self.parser.calls
        if len(calls) == self.called:  # every token asks; almost none finishes a call
            return ()
        fresh, self.called = tuple(calls[self.called:]), len(calls)
        return fresh
