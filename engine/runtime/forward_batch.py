"""What one forward step needs to know about the sequences in it.

Tokens of all sequences are packed along one axis [T]; per-sequence tensors are indexed by
sequence [B]. The same record serves prefill chunks (several tokens a sequence) and decode
(one token a sequence).

With a split KV cache (kv_cache.py) the sliding-window layers have their own block tables and
slots, of the same shapes; position arithmetic is the same in both groups.
"""
from __future__ import annotations

from dataclasses import dataclass, field, replace

import torch

from .kv_cache import slot_of


@dataclass
class ForwardBatch:
    """
    rope_positions: [T] (1-D rotary) or [3, T] (M-RoPE) angle positions of the new tokens.
    slot_mapping:   [T] int64 cache slot receiving each new token's K/V.
    query_start:    [B + 1] int32 offsets of each sequence's new tokens in the packed axis.
    context_lens:   [B] int32 tokens each sequence has in the cache after this step (new ones included).
    block_tables:   [B, max_blocks] int32 block ids of each sequence, padded with 0.
    query_start_host, context_lens_host: the same as Python lists, for the torch reference path
        and for host-side planning (never read inside captured graphs).
    sliding_slot_mapping [T], sliding_block_tables [B, max_blocks]: the sliding group's slots and
        tables (None with a one-group cache).
    captured_query_len: set on the static batch of a captured prefill graph (chunk_graphs.py):
        the most new tokens any of its sequences may have. The host lists then describe no
        particular step, so nothing may be planned from them: kernels are sized by this bound.
    """

    rope_positions: torch.Tensor
    slot_mapping: torch.Tensor
    query_start: torch.Tensor
    context_lens: torch.Tensor
    block_tables: torch.Tensor
    query_start_host: list[int]
    context_lens_host: list[int]
    sliding_slot_mapping: torch.Tensor | None = None
    sliding_block_tables: torch.Tensor | None = None
    captured_query_len: int | None = None
    _tails: dict = field(default_factory=dict, repr=False, compare=False)

    @property
    def num_seqs(self) -> int:
        return len(self.context_lens_host)

    @property
    def is_decode(self) -> bool:
        return self.captured_query_len is None and self.query_start_host[-1] == self.num_seqs

    def sequences_from(self, first: int) -> "ForwardBatch":
        """The batch of sequences first.. alone, their tokens' offsets counted from their first
        token (its attention reads query_start, context_lens, the tables and the host lists).
        Built once a step and shared by every layer that cuts the step there."""
        if first not in self._tails:
            rows = self.query_start_host[first]
            sliding = self.sliding_block_tables
            self._tails[first] = replace(
                self, query_start=self.query_start[first:] - rows, context_lens=self.context_lens[first:],
                block_tables=self.block_tables[first:],
                sliding_block_tables=None if sliding is None else sliding[first:],
                query_start_host=[s - rows for s in self.query_start_host[first:]],
                context_lens_host=self.context_lens_host[first:], _tails={})
        return self._tails[first]

    @classmethod
    def build(cls, seqs: list[tuple[list[int], int, int]], rope_positions: torch.Tensor, block_size: int,
              device: torch.device | str, sliding_tables: list[list[int]] | None = None) -> "ForwardBatch":
        """seqs: (block_table, tokens already cached, new tokens) per sequence; sliding_tables:
        each sequence's sliding-group table (same length as its block table), or None."""
        starts, lens = [0], []
        for _, cached, new in seqs:
            starts.append(starts[-1] + new)
            lens.append(cached + new)
        spans = [(cached, new) for _, cached, new in seqs]
        # int32 is what the attention kernels read; slots stay int64 for index_copy_.
        as_int32 = lambda x: torch.tensor(x, dtype=torch.int32, device=device)  # noqa: E731
        slots, tables = _slots_and_tables([t for t, _, _ in seqs], spans, block_size, device)
        sliding_slots = sliding = None
        if sliding_tables is not None:
            sliding_slots, sliding = _slots_and_tables(sliding_tables, spans, block_size, device)
        return cls(rope_positions.to(device), slots, as_int32(starts), as_int32(lens), tables, starts, lens,
                   sliding_slots, sliding)


def _slots_and_tables(tables: list[list[int]], spans: list[tuple[int, int]], block_size: int,
                      device) -> tuple[torch.Tensor, torch.Tensor]:
    """Slots [T] int64 of tokens [cached, cached + new) of each sequence, and the tables padded
    with 0 (entries past a context are never read) as [B, max_blocks] int32."""
    slots = [slot_of(table, p, block_size) for table, (cached, new) in zip(tables, spans)
             for p in range(cached, cached + new)]
    width = max(len(t) for t in tables)
    padded = [t + [0] * (width - len(t)) for t in tables]
    return (torch.tensor(slots, dtype=torch.int64, device=device),
            torch.tensor(padded, dtype=torch.int32, device=device))
