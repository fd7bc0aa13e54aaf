"""Split a model's streamed output into reasoning, answer text and function calls.

GLM-4.5V thinks inside `<think>...</think>` before answering; grounding boxes arrive as
`<|begin_of_box|>...<|end_of_box|>` inside the answer and stay there (see `parse_boxes`).
gpt-oss writes harmony messages: `<|channel|>analysis<|message|>...<|end|>` (reasoning), then
`<|start|>assistant<|channel|>final<|message|>...<|return|>` (the answer). When the request
offers tools, each family's calls (tool_calls.py) are taken out of the text and collected in
`calls` instead.

Both parsers take text pieces as the detokenizer releases them (special tokens included) and
hold back any tail that might be the start of a tag, so a tag split across tokens is still seen.
"""
from __future__ import annotations

import json
import re
from dataclasses import dataclass

from .request import ToolCall
from .tool_calls import glm_tool_call, harmony_recipient, harmony_tool_call, tool_schemas


class _TagScanner:
    """Finds the earliest of `tags` in a stream of text pieces."""

    def __init__(self, tags: tuple[str, ...]):
        # Every tag opens with a character that appears nowhere else in it, so a partial tag at
        # the end of the buffer starts at the buffer's last such character: text without one is
        # released whole, without scanning for each tag (the common case, once per token).
        self.openers = "".join(sorted({t[0] for t in tags}))
        if any(c in t[1:] for t in tags for c in self.openers):
            raise ValueError(f"tags {tags}: an opening character must not appear inside a tag")
        self.tags = tags
        self.buffer = ""

    def feed(self, text: str):
        """Yields ("text", s) and ("tag", tag) events; keeps a possible partial tag buffered."""
        self.buffer += text
        if not any(c in self.buffer for c in self.openers):
            if self.buffer:
                yield "text", self.buffer
            self.buffer = ""
            return
        while True:
            hits = [(self.buffer.find(t), t) for t in self.tags if t in self.buffer]
            if not hits:
                break
            pos, tag = min(hits)
            if pos:
                yield "text", self.buffer[:pos]
            yield "tag", tag
            self.buffer = self.buffer[pos + len(tag):]
        start = max(self.buffer.rfind(c) for c in self.openers)
        tail = self.buffer[start:] if start >= 0 else ""
        keep = len(tail) if tail and any(t.startswith(tail) and len(t) > len(tail) for t in self.tags) else 0
        if len(self.buffer) > keep:
            yield "text", self.buffer[: len(self.buffer) - keep]
            self.buffer = self.buffer[len(self.buffer) - keep:]

    def flush(self):
        if self.buffer:
            yield "text", self.buffer
        self.buffer = ""


class GlmReasoningParser:
    """`thinking=False` means the prompt already closed an empty think block. With `tools`, the
    answer's `<tool_call>...</tool_call>` spans become ToolCalls in `calls`."""

    def __init__(self, thinking: bool = True, tools: tuple[dict, ...] = ()):
        self.schemas = tool_schemas(tools) if tools else None
        tags = ("<think>", "</think>") + (("<tool_call>", "</tool_call>") if tools else ())
        self.scanner = _TagScanner(tags)
        self.in_think = False
        self.thinking = thinking
        self.call: list[str] | None = None  # the text of a call being written
        self.calls: list[ToolCall] = []

    def _route(self, events) -> tuple[str, str]:
        answer, reasoning = [], []
        for kind, value in events:
            if kind == "tag" and value in ("<think>", "</think>") and self.call is None:
                self.in_think = value == "<think>"
            elif self.in_think:
                reasoning.append(value)
            elif kind == "tag" and value == "<tool_call>":
                self.call = []
            elif kind == "tag" and value == "</tool_call>" and self.call is not None:
                inner, self.call = "".join(self.call), None
                call = glm_tool_call(inner, self.schemas)
                if call is None:
                    answer.append(f"<tool_call>{inner}</tool_call>")
                else:
                    self.calls.append(call)
            elif self.call is not None:
                self.call.append(value)
            else:
                answer.append(value)
        return "".join(answer), "".join(reasoning)

    def feed(self, text: str) -> tuple[str, str]:
        """Returns (answer, reasoning) text released by this piece."""
        return self._route(self.scanner.feed(text))

    def finish(self) -> tuple[str, str]:
        answer, reasoning = self._route(self.scanner.flush())
        if self.call is not None:  # a call cut off (max tokens): shown as the text it is
            answer, self.call = answer + "<tool_call>" + "".join(self.call), None
        return answer, reasoning

    def call_state(self) -> tuple[bool, str | None, str]:
        """(a call is being written, the function it names once its arguments begin (None before),
        the text after the name so far): a `<tool_call>` opened, its name ended by a line break."""
        if self.call is None:
            return False, None, ""
        name, newline, rest = "".join(self.call).partition("\n")
        return True, (name.strip() or None) if newline else None, rest


class HarmonyParser:
    """gpt-oss harmony channels. Text in the `final` channel is the answer; `analysis` and
    `commentary` are reasoning. Headers (role, channel, recipient) are never shown. With `tools`,
    a message addressed to `functions.NAME` is a call: its text (the JSON arguments) becomes a
    ToolCall in `calls` when the message ends (`<|call|>`, which also ends the turn)."""

    TAGS = ("<|start|>", "<|channel|>", "<|message|>", "<|end|>", "<|return|>", "<|call|>", "<|constrain|>")

    def __init__(self, tools: tuple[dict, ...] = ()):
        self.scanner = _TagScanner(self.TAGS)
        self.in_header = True  # the generation prompt ends in "<|start|>assistant"
        self.header = ""
        self.channel = None
        self.tools = bool(tools)
        self.function: str | None = None  # the function the current message calls
        self.arguments: list[str] = []
        self.calls: list[ToolCall] = []

    def _end_call(self) -> None:
        if self.function is not None:
            self.calls.append(harmony_tool_call(self.function, "".join(self.arguments)))
            self.function, self.arguments = None, []

    def _route(self, events) -> tuple[str, str]:
        answer, reasoning = [], []
        for kind, value in events:
            if kind == "tag":
                if value == "<|message|>":
                    self.in_header = False
                    match = re.search(r"<\|channel\|>\s*(\w+)", self.header)
                    self.channel = match.group(1) if match else "final"
                    self.function = harmony_recipient(self.header) if self.tools else None
                    self.header = ""
                elif value in ("<|start|>", "<|end|>", "<|return|>", "<|call|>"):
                    self._end_call()
                    self.in_header, self.header = True, ""
                elif self.in_header:
                    self.header += value
            elif self.in_header:
                self.header += value
            elif self.function is not None:
                self.arguments.append(value)
            elif self.channel == "final":
                answer.append(value)
            else:
                reasoning.append(value)
        return "".join(answer), "".join(reasoning)

    def feed(self, text: str) -> tuple[str, str]:
        return self._route(self.scanner.feed(text))

    def finish(self) -> tuple[str, str]:
        # <|call|> ends the turn as an end-of-sequence id, which is never detokenized: the call
        # being written is complete when the turn ends, unless its arguments were cut off (max
        # tokens), when they stay the commentary text they are
        answer, reasoning = self._route(self.scanner.flush())
        if self.function is not None and not _is_json("".join(self.arguments)):
            reasoning, self.function, self.arguments = reasoning + "".join(self.arguments), None, []
        self._end_call()
        return answer, reasoning

    def call_state(self) -> tuple[bool, str | None, str]:
        """(a call is being written: a header addressed to a function, or its message; the function
        once its message (the arguments) began, else None; the arguments so far)."""
        if self.function is not None:
            return True, self.function, "".join(self.arguments)
        return self.tools and self.in_header and "to=functions." in self.header, None, ""


def _is_json(text: str) -> bool:
    try:
        json.loads(text or "{}")
    except ValueError:
        return False
    return True


def reasoning_parser(family: str, thinking: bool = True, tools: tuple[dict, ...] = ()):
    return GlmReasoningParser(thinking, tools) if family == "glm4v_moe" else HarmonyParser(tools)


@dataclass(frozen=True)
class Box:
    """A grounding box in GLM's 0..1000 normalised image coordinates; start/end: its span in the answer."""

    x1: float
    y1: float
    x2: float
    y2: float
    start: int
    end: int


_BOX = re.compile(r"<\|begin_of_box\|>(.*?)<\|end_of_box\|>", re.S)
_NUM = re.compile(r"-?\d+(?:\.\d+)?")


def parse_boxes(answer: str) -> list[Box]:
    """Boxes in an answer: every group of four numbers inside a box span, with the span's
    character range, e.g. `<|begin_of_box|>[[120,40,560,700]]<|end_of_box|>`."""
    boxes = []
    for m in _BOX.finditer(answer):
        nums = [float(n) for n in _NUM.findall(m.group(1))]
        for i in range(0, len(nums) - len(nums) % 4, 4):
            boxes.append(Box(*nums[i:i + 4], start=m.start(), end=m.end()))
    return boxes
