"""Paged KV cache: fixed-size blocks of token slots shared by all sequences.

A token's K and V live at slot `block * block_size + offset` of every layer of a group; a
sequence owns an ordered list of blocks per group (its block tables). Which blocks are free is
the block pools' business.

Layer groups. A model without sliding-window layers has one group (PagedKVCache over all its
layers). gpt-oss alternates full and sliding-window layers; a sliding layer only ever reads the
last `sliding_window` keys, so its K/V live in a second group (SplitKVCache) with its own blocks
and pool, and the scheduler frees a sequence's sliding blocks once the window has passed them.
A sequence's sliding table keeps the length of its full table (entry i covers tokens
[i * block_size, (i + 1) * block_size) in both), so the attention kernels' position arithmetic
is the same for both groups; a freed entry holds `placeholder`, one block of the sliding group
outside its pool. The kernels never use those keys (a query at p sees only p - window < j),
but the prefill kernel rounds its first key down to its tile and the torch references gather
the whole table before masking, so the entry must be a real block with finite content: it is
zeroed at start and otherwise only written by the padded rows of decode graphs (it doubles as
the sliding group's scratch block), whose keys are finite too.
"""
from __future__ import annotations

import torch

from ..spec import ModelSpec


class PagedKVCache:
    """One layer group. k[layer], v[layer]: [num_blocks, block_size, kv_heads, head_dim]."""

    sliding = None  # a single group: every layer reads the full-group block tables

    def __init__(self, num_layers: int, num_blocks: int, block_size: int, kv_heads: int, head_dim: int,
                 dtype: torch.dtype, device: torch.device | str):
        shape = (num_layers, num_blocks, block_size, kv_heads, head_dim)
        self.k = torch.zeros(shape, dtype=dtype, device=device)
        self.v = torch.zeros(shape, dtype=dtype, device=device)
        self.num_blocks, self.block_size = num_blocks, block_size

    @staticmethod
    def bytes_per_block(num_layers: int, block_size: int, kv_heads: int, head_dim: int, dtype: torch.dtype) -> int:
        return 2 * num_layers * block_size * kv_heads * head_dim * torch.empty((), dtype=dtype).element_size()

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (self.k, self.v))

    @property
    def num_sliding_blocks(self) -> int:
        return 0

    def layer(self, layer: int) -> tuple[torch.Tensor, torch.Tensor, bool]:
        """(k, v, reads the sliding group's tables) of model layer `layer`."""
        return self.k[layer], self.v[layer], False

    def write(self, layer: int, slot_mapping: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        """k, v [T, kv_heads, head_dim] go to slots [T]."""
        kf = self.k[layer].view(-1, *self.k.shape[-2:])
        vf = self.v[layer].view(-1, *self.v.shape[-2:])
        kf.index_copy_(0, slot_mapping, k.to(kf.dtype))
        vf.index_copy_(0, slot_mapping, v.to(vf.dtype))


def slot_of(table: list[int], position: int, block_size: int) -> int:
    """The cache slot of token `position` of a sequence whose blocks are `table`."""
    return table[position // block_size] * block_size + position % block_size


def first_window_block(position: int, window: int, block_size: int) -> int:
    """The first block a query at `position` can see through a window: keys j with
    position - window < j, so blocks wholly before it are never read again by any later query."""
    return max(position - window + 1, 0) // block_size


def sliding_layers(spec: ModelSpec) -> list[int]:
    """The layers that only see the last spec.sliding_window keys (none without a window)."""
    if not spec.sliding_window:
        return []
    return [i for i, t in enumerate(spec.layer_types) if t == "sliding"]


class SplitKVCache:
    """Two layer groups: `full` [num_full_layers, num_blocks, ...] and `sliding`
    [num_sliding_layers, num_sliding_blocks + 1, ...], whose last block is `placeholder`."""

    def __init__(self, spec: ModelSpec, num_blocks: int, num_sliding_blocks: int, block_size: int, kv_heads: int,
                 dtype: torch.dtype, device: torch.device | str):
        windowed = set(sliding_layers(spec))
        if not windowed or num_sliding_blocks < 1:
            raise ValueError("a split KV cache needs sliding-window layers and at least one sliding block")
        full = [i for i in range(spec.num_layers) if i not in windowed]
        self.full = PagedKVCache(len(full), num_blocks, block_size, kv_heads, spec.head_dim, dtype, device)
        self.sliding = PagedKVCache(len(windowed), num_sliding_blocks + 1, block_size, kv_heads, spec.head_dim,
                                    dtype, device)
        self.placeholder = num_sliding_blocks
        self.num_blocks, self.block_size = num_blocks, block_size
        self._where = {layer: (self.full, j) for j, layer in enumerate(full)}
        self._where.update({layer: (self.sliding, j) for j, layer in enumerate(sorted(windowed))})

    @property
    def nbytes(self) -> int:
        return self.full.nbytes + self.sliding.nbytes

    @property
    def num_sliding_blocks(self) -> int:
        """The sliding group's pool size (its placeholder block not counted)."""
        return self.placeholder

    def layer(self, layer: int) -> tuple[torch.Tensor, torch.Tensor, bool]:
        group, j = self._where[layer]
        return group.k[j], group.v[j], group is self.sliding


def build_kv_cache(spec: ModelSpec, num_blocks: int, block_size: int, kv_heads: int, dtype: torch.dtype,
                   device: torch.device | str, num_sliding_blocks: int = 0) -> PagedKVCache | SplitKVCache:
    """One group over every layer when num_sliding_blocks is 0 (models without windows), else the
    full and sliding groups. num_blocks counts the full group's blocks (a decode-graph scratch
    block included); the sliding group gets its placeholder block on top of num_sliding_blocks."""
    if num_sliding_blocks:
        return SplitKVCache(spec, num_blocks, num_sliding_blocks, block_size, kv_heads, dtype, device)
    return PagedKVCache(spec.num_layers, num_blocks, block_size, kv_heads, spec.head_dim, dtype, device)
