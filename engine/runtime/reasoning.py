"""Split a model's streamed output into reasoning and answer text.

GLM-4.5V thinks inside `<think>...</think>` before answering; grounding boxes arrive as
`<|begin_of_box|>...<|end_of_box|>` inside the answer and stay there (see `parse_boxes`).
gpt-oss writes harmony messages: `<|channel|>analysis<|message|>...<|end|>` (reasoning), then
`<|start|>assistant<|channel|>final<|message|>...<|return|>` (the answer).

Both parsers take text pieces as the detokenizer releases them (special tokens included) and
hold back any tail that might be the start of a tag, so a tag split across tokens is still seen.
"""
from __future__ import annotations

import re
from dataclasses import dataclass


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
    """`thinking=False` means the prompt already closed an empty think block."""

    def __init__(self, thinking: bool = True):
        self.scanner = _TagScanner(("<think>", "</think>"))
        self.in_think = False
        self.thinking = thinking

    def _route(self, events) -> tuple[str, str]:
        answer, reasoning = [], []
        for kind, value in events:
            if kind == "tag":
                self.in_think = value == "<think>"
            elif self.in_think:
                reasoning.append(value)
            else:
                answer.append(value)
        return "".join(answer), "".join(reasoning)

    def feed(self, text: str) -> tuple[str, str]:
        """Returns (answer, reasoning) text released by this piece."""
        return self._route(self.scanner.feed(text))

    def finish(self) -> tuple[str, str]:
        return self._route(self.scanner.flush())


class HarmonyParser:
    """gpt-oss harmony channels. Text in the `final` channel is the answer; `analysis` and
    `commentary` are reasoning. Headers (role, channel, recipient) are never shown."""

    TAGS = ("<|start|>", "<|channel|>", "<|message|>", "<|end|>", "<|return|>", "<|call|>", "<|constrain|>")

    def __init__(self):
        self.scanner = _TagScanner(self.TAGS)
        self.in_header = True  # the generation prompt ends in "<|start|>assistant"
        self.header = ""
        self.channel = None

    def _route(self, events) -> tuple[str, str]:
        answer, reasoning = [], []
        for kind, value in events:
            if kind == "tag":
                if value == "<|message|>":
                    self.in_header = False
                    match = re.search(r"<\|channel\|>\s*(\w+)", self.header)
                    self.channel = match.group(1) if match else "final"
                    self.header = ""
                elif value in ("<|start|>", "<|end|>", "<|return|>", "<|call|>"):
                    self.in_header, self.header = True, ""
                elif self.in_header:
                    self.header += value
            elif self.in_header:
                self.header += value
            elif self.channel == "final":
                answer.append(value)
            else:
                reasoning.append(value)
        return "".join(answer), "".join(reasoning)

    def feed(self, text: str) -> tuple[str, str]:
        return self._route(self.scanner.feed(text))

    def finish(self) -> tuple[str, str]:
        return self._route(self.scanner.flush())


def reasoning_parser(family: str, thinking: bool = True):
    return GlmReasoningParser(thinking) if family == "glm4v_moe" else HarmonyParser()


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
