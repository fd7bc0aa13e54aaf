"""A deterministic test double for `ChatEngine`: scripted deltas with a small delay.

It answers "Seen <n> image(s). You said: <last user text>" followed by numbered filler words, so
tests can check what reached the engine. With `reasoning="thinking"` and `request.thinking` on it
first streams reasoning deltas the way a GLM <think> splitter would. Every `close()` is recorded
in `engine.closed` so tests can assert that Stop / a client disconnect reached the engine. Given
`calls` and a request with tools, it answers with those tool calls (finish_reason "tool_calls").
A request that asks for logprobs gets one made-up entry per delta (its text as the token).
"""
from __future__ import annotations

import dataclasses
import threading
from typing import Iterator

from localchat.engine.runtime.request import (
    ChatRequest, Delta, Final, ImagePart, ModelInfo, StreamItem, TextPart, Timings, TokenLogprob, ToolCall,
)
from localchat.engine.spec import SamplingDefaults


class FakeStream:
    def __init__(self, engine: "FakeEngine", request: ChatRequest):
        self.engine, self.request = engine, request
        self._closed = threading.Event()
        self.close_calls = 0
        self.finish_reason: str | None = None

    def _script(self) -> tuple[list[Delta], int]:
        req = self.request
        last_user = next(m for m in reversed(req.messages) if m.role == "user")
        n_images = sum(isinstance(p, ImagePart) for m in req.messages for p in m.content)
        said = " ".join(p.text for p in last_user.content if isinstance(p, TextPart))
        deltas: list[Delta] = []
        if self.engine.reasoning == "thinking" and req.thinking:
            deltas += [Delta(reasoning=w + " ", token_ids=(1,)) for w in self.engine.thinking_words]
        if req.tools and self.engine.calls:
            deltas += [Delta(tool_calls=(c,), token_ids=(5,)) for c in self.engine.calls]
            return deltas[: req.sampling.max_tokens], 10
        head = f"Seen {n_images} image(s). You said: {said}"
        deltas.append(Delta(text=head, token_ids=(2,)))
        deltas += [Delta(text=f" w{i}", token_ids=(3,)) for i in range(self.engine.filler_words)]
        if self.engine.extra_markdown:
            deltas.append(Delta(text=self.engine.extra_markdown, token_ids=(4,)))
        prompt_tokens = sum(len(p.text.split()) if isinstance(p, TextPart) else 64
                            for m in req.messages for p in m.content)
        return [_with_logprobs(d, req.sampling.logprobs) for d in deltas[: req.sampling.max_tokens]], prompt_tokens

    def __iter__(self) -> Iterator[StreamItem]:
        deltas, prompt_tokens = self._script()
        sent = 0
        for d in deltas:
            if self._closed.wait(self.engine.delay):
                break
            sent += 1
            yield d
        limit_hit = len(deltas) == self.request.sampling.max_tokens
        if self.finish_reason is None:
            self.finish_reason = "length" if limit_hit else "tool_calls" if any(d.tool_calls for d in deltas) else "stop"
        yield Final(self.finish_reason, prompt_tokens, sent,
                    Timings(image_encode=0.01, prefill=0.02, first_token=0.003, decode=0.1,
                            decode_tokens_per_s=100.0))

    def close(self) -> None:
        self.close_calls += 1
        if self.finish_reason is None:  # closed before the answer was complete: an abort
            self.finish_reason = "abort"
        self._closed.set()
        self.engine.closed.append(self)


def _with_logprobs(delta: Delta, wanted: int | None) -> Delta:
    """The delta with a made-up entry for its one token when logprobs are asked for: the token is
    its text, its log-probability -0.25 x its id, and `wanted` alternatives follow it."""
    if wanted is None:
        return delta
    text = delta.text or delta.reasoning

    def entry(token_id: int, token: str) -> TokenLogprob:
        return TokenLogprob(token_id, token, -0.25 * token_id, tuple(token.encode()))

    top = tuple(entry(delta.token_ids[0] + k, f"alt{k}") for k in range(wanted))
    return dataclasses.replace(delta, logprobs=(dataclasses.replace(entry(delta.token_ids[0], text), top=top),))


class FakeEngine:
    def __init__(self, *, reasoning: str = "thinking", delay: float = 0.01, filler_words: int = 5,
                 thinking_words: tuple[str, ...] = ("Let", "me", "look."), name: str = "fake-glm",
                 context_length: int = 8192, extra_markdown: str = "",
                 sampling: SamplingDefaults = SamplingDefaults(), calls: tuple[ToolCall, ...] = ()):
        self.reasoning, self.delay, self.filler_words = reasoning, delay, filler_words
        self.thinking_words, self.name, self.context_length = thinking_words, name, context_length
        self.extra_markdown, self.sampling, self.calls = extra_markdown, sampling, calls
        self.requests: list[ChatRequest] = []
        self.streams: list[FakeStream] = []
        self.closed: list[FakeStream] = []

    def info(self) -> ModelInfo:
        return ModelInfo(name=self.name, family="glm4v_moe" if self.reasoning == "thinking" else "gpt_oss",
                         context_length=self.context_length, supports_images=True,
                         reasoning=self.reasoning, placement="cpu (fake)", weights_bytes=123_000_000,
                         sampling=self.sampling)

    def submit(self, request: ChatRequest) -> FakeStream:
        self.requests.append(request)
        stream = FakeStream(self, request)
        self.streams.append(stream)
        return stream
