"""One request inside the engine: its tokens, its KV blocks, what has been computed, and the
stream its text goes to.

`tokens` is the prompt followed by the generated ids. `num_computed` of them have K/V in the
cache; the next step feeds tokens[num_computed:] (a prefill chunk, or the one newest token when
decoding), and once the last token is fed its logits give the next token. Preemption drops the
blocks and sets num_computed to 0; the same rule then recomputes prompt and generated tokens.

With a split KV cache (kv_cache.py) `sliding_blocks` is the sliding group's table, as long as
`blocks`; its first `sliding_start` entries have left the window and hold the placeholder block.
"""
from __future__ import annotations

import queue
import threading
import time
from dataclasses import dataclass, field
from enum import Enum
from typing import Callable

import torch

from .constrained import JsonAnswer
from .logprobs import RowLogprobs, TokenNames
from .prefix_cache import BlockKeys, ImageSpan
from .prompt import Prompt
from .request import ChatRequest, Delta, Final, StreamItem, Timings
from .sampling import Sampler
from .textstream import TextAssembler


class EngineStream:
    """What `Engine.submit` returns: iterate for Deltas and one Final; `close()` aborts."""

    def __init__(self, request: ChatRequest):
        self.request = request
        self.items: queue.Queue[StreamItem] = queue.Queue()
        self.aborted = threading.Event()
        self.done = False

    def __iter__(self):
        while not self.done:
            item = self.items.get()
            if isinstance(item, Final):
                self.done = True
            yield item

    def close(self) -> None:
        self.aborted.set()


class Status(Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


@dataclass
class SeqClock:
    """perf_counter() stamps; image_encode accumulates seconds spent in the vision tower."""

    submitted: float = field(default_factory=time.perf_counter)
    admitted: float | None = None
    image_encode: float = 0.0
    prefill_done: float | None = None
    first_token: float | None = None
    last_token: float | None = None

    def timings(self, generated: int) -> Timings:
        if self.admitted is None:
            return Timings()
        t = Timings(queued=self.admitted - self.submitted)
        if self.prefill_done is None or self.first_token is None:
            return t
        decode = (self.last_token or self.first_token) - self.first_token
        return Timings(
            image_encode=self.image_encode,
            prefill=max(self.prefill_done - self.admitted - self.image_encode, 0.0),
            first_token=self.first_token - self.prefill_done,
            decode=decode,
            decode_tokens_per_s=(generated - 1) / decode if decode > 0 else 0.0,
            queued=t.queued)


class Sequence:
    def __init__(self, seq_id: int, stream: EngineStream, prompt: Prompt, sampler: Sampler | None,
                 text: TextAssembler, *, limit: int, eos_ids: tuple[int, ...], block_size: int,
                 spans: list[ImageSpan], mrope: tuple[torch.Tensor, int] | None, dropped_messages: int = 0,
                 token_names: TokenNames | None = None, json_answer: JsonAnswer | None = None,
                 strict_calls: Callable[[str], JsonAnswer | None] | None = None):
        """limit: the most tokens (prompt + generated) this sequence may reach.
        mrope: GLM's ([3, prompt_len] positions, delta), None for 1-D positions = slot.
        dropped_messages: the request's messages left out of the prompt to fit the context.
        token_names: names the tokens of logprob entries (needed when the request asks for them).
        json_answer: the answer's JSON state in JSON mode (its tokens are chosen by it), else None.
        strict_calls: for a model that may call strict functions, the JsonAnswer for the arguments
        of a call to one, by name (constrained.strict_calls); from the moment a call begins its
        tokens are chosen on the host, and once its function is named its arguments by that."""
        self.seq_id = seq_id
        self.dropped_messages = dropped_messages
        self.token_names = token_names
        self.stream = stream
        self.prompt = prompt
        self.tokens = list(prompt.input_ids)
        self.prompt_len = len(self.tokens)
        self.sampler = sampler
        self.text = text
        self.json_answer = json_answer
        self.strict_calls = strict_calls
        self.calling = False  # a call has begun: tokens chosen on the host from now on
        self.max_tokens = min(stream.request.sampling.max_tokens, limit - self.prompt_len)
        self.eos_ids = eos_ids
        self.spans = spans
        self.mrope = mrope
        self.keys = BlockKeys(block_size, spans)
        self.status = Status.WAITING
        self.blocks: list[int] = []
        self.sliding_blocks: list[int] = []
        self.sliding_start = 0  # leading sliding entries released (the placeholder block)
        self.num_computed = 0
        self.num_registered = 0  # leading blocks already offered to the prefix cache
        self.features: torch.Tensor | None = None  # vision features of the images still to prefill
        self.feature_base: dict[int, int] = {}  # image index -> its first row in `features`
        self.vision_planned = False
        self.reused_tokens = 0  # prompt tokens found in the prefix cache at first admission
        self.clock = SeqClock()
        self._penalty_ctx = sampler is not None and sampler.penalised  # None: a sequence only scheduled, never sampled

    def __hash__(self) -> int:
        return self.seq_id

    @property
    def num_pending(self) -> int:
        return len(self.tokens) - self.num_computed

    @property
    def generated(self) -> list[int]:
        return self.tokens[self.prompt_len:]

    def reset_computed(self) -> None:
        """After preemption: nothing is cached any more, images must be planned again."""
        self.blocks, self.num_computed, self.num_registered = [], 0, 0
        self.sliding_blocks, self.sliding_start = [], 0
        self.features, self.feature_base, self.vision_planned = None, {}, False

    # ---- model inputs ---------------------------------------------------------------------

    def rope_positions(self, lo: int, hi: int) -> torch.Tensor:
        """Positions of tokens [lo, hi): [hi - lo] (slot = position) or [3, hi - lo] (M-RoPE: the
        prompt's own positions, then slot + delta on every axis for generated tokens)."""
        if self.mrope is None:
            return torch.arange(lo, hi)
        positions, delta = self.mrope
        head = positions[:, lo:min(hi, self.prompt_len)]
        start = max(lo, self.prompt_len)
        if start >= hi:
            return head
        tail = (torch.arange(start, hi) + delta).expand(3, -1)
        return torch.cat((head, tail), dim=1)

    def position_at(self, p: int) -> int | list[int]:
        """The rotary position of token p without building tensors (the decode hot path): an int,
        or the three M-RoPE axes."""
        if self.mrope is None:
            return p
        positions, delta = self.mrope
        if p >= self.prompt_len:
            return [p + delta] * 3
        return positions[:, p].tolist()

    def images_to_encode(self) -> list[ImageSpan]:
        """Images with tokens not yet in the cache (those wholly inside reused blocks are skipped)."""
        return [s for s in self.spans if s.end > self.num_computed]

    def image_features(self, lo: int, hi: int) -> torch.Tensor | None:
        """Feature rows for the image tokens among [lo, hi), in token order."""
        parts = []
        for s in self.spans:
            a, b = max(lo, s.start), min(hi, s.end)
            if a < b:
                base = self.feature_base[s.index] - s.start
                parts.append(self.features[base + a:base + b])
        return torch.cat(parts) if parts else None

    @property
    def chooses_on_host(self) -> bool:
        """Whether choosing its next token needs the host after each step: a penalty reads the ids
        so far, JSON mode and a strict call the grammar's state."""
        return self._penalty_ctx or self.json_answer is not None or self.calling

    def penalty_context(self, device) -> torch.Tensor | None:
        """The ids the penalties look at (prompt, then generated), or None when the request has none."""
        if not self._penalty_ctx:
            return None
        return torch.tensor(self.tokens, dtype=torch.long, device=device)

    # ---- output ---------------------------------------------------------------------------

    def append_token(self, token: int, logprobs: RowLogprobs | None = None) -> str | None:
        """Records a sampled token and streams its text, and its logprob entry when the request
        asked (`logprobs`: its values); returns a finish reason or None."""
        now = time.perf_counter()
        if self.clock.first_token is None:
            self.clock.first_token = now
        self.clock.last_token = now
        self.tokens.append(token)
        entry = () if logprobs is None else (self.token_names.entry(token, logprobs),)
        if token in self.eos_ids:
            if entry:  # the end-of-sequence token has no text, but it counts among the completion tokens
                self.stream.items.put(Delta(logprobs=entry))
            return "stop"
        if self.json_answer is not None:
            self.json_answer.append(token)
        answer, reasoning = self.text.push(token)
        if self.strict_calls is not None and self.json_answer is None:
            self._follow_call()
        self.stream.items.put(Delta(answer, reasoning, (token,), self.text.take_tool_calls(), entry))
        if self.text.stopped or (self.json_answer is not None and self.json_answer.complete):
            return "stop"
        if len(self.generated) >= self.max_tokens:
            return "length"
        return None

    def _follow_call(self) -> None:
        """After a token of free text: once a call begins, the next tokens are chosen on the host
        (the step already launched ahead, if any, is still part of the call's header); once a
        strict function is named, its arguments are held to its schema from their first token."""
        begun, name, written = self.text.parser.call_state()
        self.calling = begun
        if name is None:
            return
        answer = self.strict_calls(name)
        # One call a turn is held (it ends the turn when complete); a call to a function that is
        # not strict goes on as free text.
        self.strict_calls, self.calling = None, False
        if answer is not None and answer.take(written):
            self.json_answer = answer

    def finish(self, reason: str, error: str | None = None) -> None:
        """Flushes held-back text and ends the stream. Blocks must already be returned."""
        self.status = Status.FINISHED
        if reason != "error":
            answer, reasoning = self.text.finish()
            calls = self.text.take_tool_calls()
            if answer or reasoning or calls:
                self.stream.items.put(Delta(answer, reasoning, tool_calls=calls))
            if reason == "stop" and self.text.called:
                reason = "tool_calls"  # the turn ended waiting for the calls' results
        self.stream.items.put(Final(reason, self.prompt_len, len(self.generated),
                                    self.clock.timings(len(self.generated)),
                                    prompt_token_ids=tuple(self.prompt.input_ids), error=error,
                                    dropped_messages=self.dropped_messages, cached_tokens=self.reused_tokens))
