"""Decode steps replayed from captured CUDA graphs, one graph per batch-size bucket.

A decode step (one new token for each of B sequences) launches a few hundred kernels; replaying
them as one graph removes the per-launch host cost, which at batch 1 is most of the step. Each
bucket's graph reads its inputs from static buffers: a step copies the real batch into the first
B rows and pads the rest of the bucket with rows that write their K/V into a scratch block no
sequence owns and attend to that one slot only, so padding never touches real cache entries.

The block table has a fixed width (the longest context in blocks) because the graph bakes in its
stride; only the columns in use are copied each step. Entries past a sequence's context length
are never read, so stale ones may stay.

With a split KV cache (kv_cache.py) the sliding group has its own static slots and table; its
padded rows write to the group's placeholder block, which is outside its pool too.

On CPU the same static-buffer path runs without capture, so tests can check that padding and
bucketing give the same tokens as the plain path.
"""
from __future__ import annotations

import bisect
from typing import NamedTuple

import torch

from .forward_batch import ForwardBatch
from .graph_capture import StepGraphs

BUCKETS = (1, 2, 4, 8, 12, 16, 24, 32, 40, 48, 56, 64, 80, 96, 112, 128)


class DecodeInputs(NamedTuple):
    """One decode step of B sequences (host values): token_ids [B]; positions [B] or [3, B];
    slots [B] cache slots of the new tokens; lens [B] context lengths including them; tables:
    each sequence's block ids; sliding_slots, sliding_tables: the same in the sliding group of a
    split cache (else None)."""

    token_ids: list[int]
    positions: torch.Tensor
    slots: list[int]
    lens: list[int]
    tables: list[list[int]]
    sliding_slots: list[int] | None = None
    sliding_tables: list[list[int]] | None = None


def bucket_sizes(max_batch: int) -> list[int]:
    """The captured batch sizes: BUCKETS up to max_batch, and max_batch itself."""
    sizes = [b for b in BUCKETS if b < max_batch]
    return sizes + [max_batch]


class DecodeGraphs(StepGraphs):
    """model: has embed(ids) and forward(h, batch, cache) and logits(h) -> [T, V] float32.
    cache: the PagedKVCache or SplitKVCache; scratch_block: a block id of its (full) group outside
    the block pool.
    max_blocks: block-table width (the longest context in blocks). mrope: positions are [3, B]."""

    def __init__(self, model, cache, dtype: torch.dtype, device: torch.device, *, max_batch: int,
                 max_blocks: int, scratch_block: int, mrope: bool, capture: bool | None = None):
        super().__init__(device, capture)
        self.model, self.cache, self.dtype = model, cache, dtype
        self.sizes = bucket_sizes(max_batch)
        self.max_batch, self.max_blocks = self.sizes[-1], max_blocks
        self.scratch_block = scratch_block
        n = self.max_batch
        self.token_ids = torch.zeros(n, dtype=torch.long, device=device)
        self.positions = torch.zeros((3, n) if mrope else (n,), dtype=torch.long, device=device)
        self.slots = torch.full((n,), scratch_block * cache.block_size, dtype=torch.int64, device=device)
        self.lens = torch.ones(n, dtype=torch.int32, device=device)
        self.tables = torch.full((n, max_blocks), scratch_block, dtype=torch.int32, device=device)
        self.sliding_slots = self.sliding_tables = None
        if cache.sliding is not None:
            self.sliding_scratch = cache.placeholder
            self.sliding_slots = torch.full((n,), cache.placeholder * cache.block_size, dtype=torch.int64,
                                            device=device)
            self.sliding_tables = torch.full((n, max_blocks), cache.placeholder, dtype=torch.int32, device=device)
        self.query_start = torch.arange(n + 1, dtype=torch.int32, device=device)
        # What another process needs to build the same graphs over its own model and cache.
        self.shape = dict(max_batch=max_batch, max_blocks=max_blocks, scratch_block=scratch_block, mrope=mrope)

    def bucket(self, batch: int) -> int | None:
        """The smallest captured size holding `batch` rows, or None when it is too large."""
        i = bisect.bisect_left(self.sizes, batch)
        return self.sizes[i] if i < len(self.sizes) else None

    def _batch(self, size: int) -> ForwardBatch:
        """The ForwardBatch of a bucket: views of the static buffers."""
        sliding_slots = sliding = None
        if self.sliding_tables is not None:
            sliding_slots, sliding = self.sliding_slots[:size], self.sliding_tables[:size]
        return ForwardBatch(self.positions[..., :size], self.slots[:size], self.query_start[:size + 1],
                            self.lens[:size], self.tables[:size], list(range(size + 1)), [1] * size,
                            sliding_slots, sliding)

    def _step(self, size: int) -> torch.Tensor:
        h = self.model.embed(self.token_ids[:size]).to(self.dtype)
        h = self.model.forward(h, self._batch(size), self.cache)
        return self.model.logits(h)

    def capture_all(self, on_progress=None) -> None:
        """Captures every bucket, largest first so the smaller graphs reuse its memory pool."""
        if not self.capture:
            return
        with torch.inference_mode():
            for i, size in enumerate(sorted(self.sizes, reverse=True)):
                if size not in self.graphs:
                    self._capture(size)
                if on_progress is not None:
                    on_progress(i + 1, len(self.sizes))

    def run(self, token_ids: list[int] | torch.Tensor, positions: torch.Tensor, slots: list[int], lens: list[int],
            tables: list[list[int]], sliding_slots: list[int] | None = None,
            sliding_tables: list[list[int]] | None = None) -> torch.Tensor:
        """One decode step for B <= max_batch sequences: token_ids [B] (host ids, or a tensor on
        the device: the ids a step still in flight is choosing), positions [B] or [3, B]
        (host), slots [B] cache slots of the new tokens, lens [B] context lengths including
        them, tables: each sequence's block ids; sliding_slots, sliding_tables: the same in the
        sliding group (a split cache only). Returns float32 logits [B, V] (a view that the next
        run overwrites).

        Once the bucket's graph is captured nothing here waits for the GPU: the inputs go through
        pinned host memory with asynchronous copies queued behind the work already on the
        stream, so the next step can be launched while the previous one runs."""
        if (sliding_tables is None) != (self.sliding_tables is None):
            raise ValueError("the sliding group's tables and slots come with a split KV cache, and only with one")
        b = len(token_ids)
        size = self.bucket(b)
        width = max(len(t) for t in tables)
        if size is None or width > self.max_blocks:
            raise ValueError(f"a decode batch of {b} sequences / {width} blocks does not fit the captured "
                             f"graphs ({self.max_batch} / {self.max_blocks})")
        host = self._host
        ids = token_ids if isinstance(token_ids, torch.Tensor) else host(token_ids, torch.long)
        self.token_ids[:b].copy_(ids, non_blocking=True)
        self.positions[..., :b].copy_(host(positions, torch.long), non_blocking=True)
        self.lens[:b].copy_(host(lens, torch.int32), non_blocking=True)
        if b < size:  # rows of the bucket that an earlier, larger step left behind
            self.lens[b:size].fill_(1)
        bs = self.cache.block_size
        _load_group(host, self.slots, self.tables, self.scratch_block, bs, slots, tables, size, width)
        if sliding_tables is not None:
            _load_group(host, self.sliding_slots, self.sliding_tables, self.sliding_scratch, bs, sliding_slots,
                        sliding_tables, size, width)
        return self._run_loaded(size, b)


def _load_group(host, slot_buf: torch.Tensor, table_buf: torch.Tensor, scratch_block: int, block_size: int,
                slots: list[int], tables: list[list[int]], size: int, width: int) -> None:
    """One KV group's inputs into its static buffers: the B sequences' slots and the first
    `width` table columns (short tables padded with their last block) into rows [0, B); rows
    [B, size) of the bucket write to and read only the group's scratch block. host(values,
    dtype): the values as a host tensor to copy from."""
    b = len(slots)
    slot_buf[:b].copy_(host(slots, torch.int64), non_blocking=True)
    padded = host([t + [t[-1]] * (width - len(t)) for t in tables], torch.int32)
    table_buf[:b, :width].copy_(padded, non_blocking=True)
    if b < size:
        slot_buf[b:size].fill_(scratch_block * block_size)
        table_buf[b:size, 0].fill_(scratch_block)
