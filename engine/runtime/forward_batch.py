"""What one forward step needs to know about the sequences in it.

Tokens of all sequences are packed along one axis [T]; per-sequence tensors are indexed by
sequence [B]. The same record serves prefill chunks (several tokens a sequence) and decode
(one token a sequence).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch


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
    """

    rope_positions: torch.Tensor
    slot_mapping: torch.Tensor
    query_start: torch.Tensor
    context_lens: torch.Tensor
    block_tables: torch.Tensor
    query_start_host: list[int]
    context_lens_host: list[int]

    @property
    def num_seqs(self) -> int:
        return len(self.context_lens_host)

    @property
    def is_decode(self) -> bool:
        return self.query_start_host[-1] == self.num_seqs

    @classmethod
    def build(cls, seqs: list[tuple[list[int], int, int]], rope_positions: torch.Tensor, block_size: int,
              device: torch.device | str) -> "ForwardBatch":
        """seqs: (block_table, tokens already cached, new tokens) per sequence."""
        slots, starts, lens = [], [0], []
        for table, cached, new in seqs:
            for p in range(cached, cached + new):
                slots.append(table[p // block_size] * block_size + p % block_size)
            starts.append(starts[-1] + new)
            lens.append(cached + new)
        width = max(len(t) for t, _, _ in seqs)
        tables = [t + [0] * (width - len(t)) for t, _, _ in seqs]
        # int32 is what the attention kernels read; slots stay int64 for index_copy_.
        as_int32 = lambda x: torch.tensor(x, dtype=torch.int32, device=device)  # noqa: E731
        return cls(rope_positions.to(device), torch.tensor(slots, dtype=torch.int64, device=device),
                   as_int32(starts), as_int32(lens), as_int32(tables), starts, lens)
