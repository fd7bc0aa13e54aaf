"""Log-probabilities of the generated tokens, for requests that ask (SamplingParams.logprobs).

The values are the model's own distribution at each position: log_softmax, in float32, of the
raw logits the step produced, before the penalties, temperature and top-k / top-p / min-p filters
that shape what is sampled (the choice vLLM makes by default). A greedy token is therefore its
position's most likely token; a sampled one may be any token the filters kept.

They are computed on the device right behind the token choice, for the rows that asked only and
in one batch, and copied to the host with the chosen ids; a step in which no row asked runs
nothing here. The host then names the ids (TokenNames) for the stream's TokenLogprob entries.
"""
from __future__ import annotations

import dataclasses
from typing import NamedTuple

import torch

from .request import TokenLogprob
from .sampling import Sampler, to_device


class RowLogprobs(NamedTuple):
    """One row's values on the host: the chosen token's log-probability and (id, log-probability)
    of the most likely tokens, most likely first (as many as its request asked)."""

    logprob: float
    top: tuple[tuple[int, float], ...]


@dataclasses.dataclass(frozen=True)
class StepLogprobs:
    """What one step computed for the rows whose request asked. rows: those rows of the batch,
    ascending; wanted[i]: how many alternatives row rows[i] asked for. chosen [R] float32: each
    row's chosen token's log-probability; top_values [R, K] float32 and top_ids [R, K] int64: the
    K most likely tokens, K the largest of `wanted`, most likely first (None when K is 0)."""

    rows: list[int]
    wanted: list[int]
    chosen: torch.Tensor
    top_values: torch.Tensor | None
    top_ids: torch.Tensor | None

    def to_host(self) -> "StepLogprobs":
        """The same values, their copies to pinned host memory queued behind the step: nothing
        waits here, and they may be read once the step's work has finished."""
        def copy(t: torch.Tensor | None) -> torch.Tensor | None:
            return None if t is None else t.to("cpu", non_blocking=True)

        return dataclasses.replace(self, chosen=copy(self.chosen), top_values=copy(self.top_values),
                                   top_ids=copy(self.top_ids))

    def per_row(self, batch: int) -> list[RowLogprobs | None]:
        """Host values for each of the step's `batch` rows, None for the rows that did not ask
        (values still on a device are waited for)."""
        chosen = self.chosen.tolist()
        values = self.top_values.tolist() if self.top_values is not None else None
        ids = self.top_ids.tolist() if self.top_ids is not None else None
        out: list[RowLogprobs | None] = [None] * batch
        for i, (row, n) in enumerate(zip(self.rows, self.wanted)):
            top = tuple(zip(ids[i][:n], values[i][:n])) if n else ()
            out[row] = RowLogprobs(chosen[i], top)
        return out


def rows_asking(samplers: list[Sampler]) -> list[int]:
    """The rows whose request asked for log-probabilities."""
    return [b for b, s in enumerate(samplers) if s.params.logprobs is not None]


def token_logprobs(logits: torch.Tensor, ids: torch.Tensor | list[int],
                   samplers: list[Sampler]) -> StepLogprobs | None:
    """logits [B, V]: the step's raw logits (any float dtype); ids [B]: the tokens chosen from them,
    int64 on the logits' device or host ints; samplers[b]: row b's. Queues, for the rows that
    asked only, one log_softmax over the vocabulary in float32, the chosen ids' values and the
    top-K (K the most any of them asked for). None, having queued nothing, when no row asked."""
    rows = rows_asking(samplers)
    if not rows:
        return None
    dev = logits.device
    ids = ids if isinstance(ids, torch.Tensor) else to_device(dev, ids, torch.long)
    if len(rows) < len(samplers):
        picked = to_device(dev, rows)
        logits, ids = logits.index_select(0, picked), ids.index_select(0, picked)
    logp = torch.log_softmax(logits.to(torch.float32), dim=-1)  # [R, V]
    chosen = logp.gather(1, ids[:, None])[:, 0]
    wanted = [samplers[b].params.logprobs for b in rows]
    k = min(max(wanted), logp.shape[-1])
    top = torch.topk(logp, k, dim=-1) if k else None  # sorted, most likely first
    return StepLogprobs(rows, wanted, chosen, top.values if top else None, top.indices if top else None)


def host_logprobs(logits: torch.Tensor, tokens: list, samplers: list[Sampler]) -> list[RowLogprobs | None]:
    """token_logprobs for tokens already chosen on the host (ints, or an Exception for a row whose
    sampling failed, which gets nothing), as host values per row."""
    if not rows_asking(samplers):
        return [None] * len(tokens)
    ids = [t if isinstance(t, int) else 0 for t in tokens]
    found = token_logprobs(logits, ids, samplers)
    return [None if isinstance(t, Exception) else row for t, row in zip(tokens, found.per_row(len(tokens)))]


def byte_of_symbol() -> dict[str, int]:
    """Byte-level BPE (GPT-2's scheme, which GLM's and gpt-oss's tokenizers use) writes each byte
    as one printable character: the printable Latin-1 bytes as themselves, the other 68 (controls,
    space, DEL, NBSP, soft hyphen) as U+0100 onwards, in byte order. Returns symbol -> byte."""
    printable = [*range(0x21, 0x7F), *range(0xA1, 0xAD), *range(0xAE, 0x100)]
    others = sorted(set(range(256)) - set(printable))
    table = {chr(b): b for b in printable}
    table.update({chr(0x100 + i): b for i, b in enumerate(others)})
    return table


class TokenNames:
    """Token id -> (text, UTF-8 bytes) for the logprob entries, remembered per id (a row that asks
    for 20 alternatives names 21 tokens a step).

    text is the tokenizer's decode of the id alone. bytes: where the token's vocabulary symbols
    are byte-level BPE symbols that decode to that text, the bytes they stand for, exact even for
    a piece of a multi-byte character (whose text is U+FFFD); otherwise (added tokens with other
    characters, tokenizers that are not byte-level) the UTF-8 encoding of the text, a best effort
    that gives U+FFFD's bytes for such a piece."""

    def __init__(self, tokenizer):
        self.tokenizer = tokenizer
        # The fast tokenizer's Rust backend decodes without the Python wrapper's clean-up.
        self.backend = getattr(tokenizer, "backend_tokenizer", None)
        self.byte_of = byte_of_symbol()
        self.known: dict[int, tuple[str, tuple[int, ...]]] = {}

    def name(self, token_id: int) -> tuple[str, tuple[int, ...]]:
        found = self.known.get(token_id)
        if found is None:
            text = self._decode(token_id)
            found = self.known[token_id] = (text, self._bytes(token_id, text))
        return found

    def entry(self, token_id: int, values: RowLogprobs) -> TokenLogprob:
        """The stream's entry for a generated token and its alternatives."""
        top = tuple(self._plain(i, lp) for i, lp in values.top)
        text, raw = self.name(token_id)
        return TokenLogprob(token_id, text, values.logprob, raw, top)

    def _plain(self, token_id: int, logprob: float) -> TokenLogprob:
        text, raw = self.name(token_id)
        return TokenLogprob(token_id, text, logprob, raw)

    def _decode(self, token_id: int) -> str:
        if self.backend is not None:
            return self.backend.decode([token_id], skip_special_tokens=False)
        return self.tokenizer.decode([token_id], skip_special_tokens=False, clean_up_tokenization_spaces=False)

    def _bytes(self, token_id: int, text: str) -> tuple[int, ...]:
        return tuple(token_bytes(self.tokenizer.convert_ids_to_tokens(token_id), text, self.byte_of))


def token_bytes(symbol, text: str, byte_of: dict[str, int]) -> bytes:
    """A token's exact bytes from its vocabulary symbol when that is a byte-level BPE symbol
    decoding to `text` (the token's decode alone), else the UTF-8 encoding of `text`; byte_of:
    byte_of_symbol()."""
    if isinstance(symbol, str) and symbol and all(c in byte_of for c in symbol):
        raw = bytes(byte_of[c] for c in symbol)
        # The check keeps out symbols that only look byte-level (e.g. SentencePiece pieces).
        if raw.decode("utf-8", errors="replace") == text:
            return raw
    return text.encode("utf-8")
