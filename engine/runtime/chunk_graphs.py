"""Steps of a few hundred tokens or fewer that are not plain decode steps (a short turn after a
cached conversation, a prompt's last chunk beside other chats' decode tokens) replayed from
captured CUDA graphs, one graph per token-count bucket.

Below ~512 tokens an eager step takes as long as the host takes to issue its launches, not its
kernels (GLM-4.5V-FP8 at 16 tokens: ~0.8 ms of host time a layer against ~0.4 ms of kernels;
BENCHMARKS.md, "Is an eager prefill bound by its launches?"). A graph issues them as one.

A bucket of T tokens has S = min(T, max_seqs) sequence slots and one more, the padding sequence.
A step of b sequences and t <= T tokens fills rows [0, t) and slots [0, b); slots [b, S) get no
tokens (their attention programs return at once); the padding sequence takes rows [t, T). Its
tokens write their keys and values into the scratch block that no sequence owns (token i into
slot i % block_size, so every key it reads was written in the same step) and attend only to
each other: every row holds finite values, and the real rows never see a padding one. Each
row of the dense layers and each (token, expert) pair of the MoE is computed on its own, so the
padding rows change nothing of the real ones; only the kernels' choices follow T instead of t.

The static batch is marked captured (ForwardBatch.captured_query_len): the prefill attention is
sized by T, and the paths planned on the host from a step's lengths (cuDNN's prefill) are not
taken; they are for chunks of 2048 queries or more in any case. Steps with image features or with
no sequence to sample from run eagerly.

On CPU the same static-buffer path runs without capture, so tests can check the padding against
the eager step.
"""
from __future__ import annotations

import bisect

import torch

from .forward_batch import ForwardBatch
from .graph_capture import StepGraphs
from .kv_cache import slot_of

# Token counts captured: a short turn fits the first ones, a mixed step of a few dozen decoding
# chats and a prompt's tail the larger ones. From 64 tokens gpt-oss's MXFP4 experts are bound by
# their kernels, not the host, and the padding costs kernel time: with buckets doubling, a mixed
# step of 72 tokens (in 128) took 34 ms against 32 ms eagerly (H100, BENCHMARKS.md), so the steps
# there are a sixth to a quarter of a bucket apart.
BUCKETS = (16, 32, 48, 64, 80, 96, 112, 128, 160, 192, 224, 256)


def bucket_sizes(max_tokens: int) -> list[int]:
    """The captured token counts: BUCKETS up to max_tokens."""
    return [t for t in BUCKETS if t <= max_tokens]


class ChunkGraphs(StepGraphs):
    """model: has embed(ids), forward(h, batch, cache) and logits(h) -> [T, V] float32.
    cache: the PagedKVCache or SplitKVCache; scratch_block: a block id of its full group outside
    the block pool (the sliding group's padding goes to its placeholder block).
    max_tokens: the largest bucket at most; max_seqs: sequences a step may hold (the engine's
    max_running); max_blocks: block-table width (the longest context in blocks); mrope:
    positions are [3, T]."""

    def __init__(self, model, cache, dtype: torch.dtype, device: torch.device, *, max_tokens: int, max_seqs: int,
                 max_blocks: int, scratch_block: int, mrope: bool, capture: bool | None = None):
        super().__init__(device, capture)
        self.model, self.cache, self.dtype = model, cache, dtype
        bs = cache.block_size
        self.sizes = [t for t in bucket_sizes(max_tokens) if -(-t // bs) <= max_blocks]
        self.max_seqs, self.max_blocks, self.scratch_block = max_seqs, max_blocks, scratch_block
        tokens = self.sizes[-1] if self.sizes else 0
        slots = min(tokens, max_seqs) + 1
        self.token_ids = torch.zeros(tokens, dtype=torch.long, device=device)
        self.positions = torch.zeros((3, tokens) if mrope else (tokens,), dtype=torch.long, device=device)
        self.slots = torch.zeros(tokens, dtype=torch.int64, device=device)
        self.query_start = torch.zeros(slots + 1, dtype=torch.int32, device=device)
        self.lens = torch.ones(slots, dtype=torch.int32, device=device)
        self.tables = torch.full((slots, max_blocks), scratch_block, dtype=torch.int32, device=device)
        self.last_rows = torch.zeros(max(slots - 1, 1), dtype=torch.long, device=device)
        self.sliding_slots = self.sliding_tables = None
        self.sliding_scratch = None
        if cache.sliding is not None:
            self.sliding_scratch = cache.placeholder
            self.sliding_slots = torch.zeros(tokens, dtype=torch.int64, device=device)
            self.sliding_tables = torch.full((slots, max_blocks), cache.placeholder, dtype=torch.int32, device=device)
        # What another process needs to build the same graphs over its own model and cache.
        self.shape = dict(max_tokens=max_tokens, max_seqs=max_seqs, max_blocks=max_blocks,
                          scratch_block=scratch_block, mrope=mrope)

    def bucket(self, inputs) -> int | None:
        """The bucket that takes these StepInputs, or None when they run eagerly: image features,
        no row to sample, one token a sequence (a decode step: the eager step's decode attention
        splits long contexts, the prefill kernel here would not), more tokens, sequences or blocks
        than the graphs hold, or a sliding group's tables given to a one-group cache (or missing
        from a split one)."""
        t = len(inputs.token_ids)
        if inputs.features is not None or not inputs.last_rows or not self.sizes or t > self.sizes[-1]:
            return None
        if t == len(inputs.entries):
            return None
        if len(inputs.entries) > self.max_seqs or max(len(e[0]) for e in inputs.entries) > self.max_blocks:
            return None
        if (inputs.sliding_tables is None) != (self.sliding_tables is None):
            return None
        return self.sizes[bisect.bisect_left(self.sizes, t)]

    def _seqs(self, size: int) -> int:
        return min(size, self.max_seqs)

    def _batch(self, size: int) -> ForwardBatch:
        """The ForwardBatch of a bucket: views of the static buffers. Its host lists are
        placeholders (captured_query_len says so)."""
        n = self._seqs(size) + 1
        sliding_slots = sliding = None
        if self.sliding_tables is not None:
            sliding_slots, sliding = self.sliding_slots[:size], self.sliding_tables[:n]
        return ForwardBatch(self.positions[..., :size], self.slots[:size], self.query_start[:n + 1], self.lens[:n],
                            self.tables[:n], [0] * n + [size], [1] * n, sliding_slots, sliding,
                            captured_query_len=size)

    def _step(self, size: int) -> torch.Tensor:
        h = self.model.embed(self.token_ids[:size]).to(self.dtype)
        h = self.model.forward(h, self._batch(size), self.cache)
        return self.model.logits(h.index_select(0, self.last_rows[:self._seqs(size)]))

    def _load(self, size: int, token_ids: list[int], entries: list[tuple[list[int], int, int]],
              positions: torch.Tensor | None, last_rows: list[int], sliding_tables: list[list[int]] | None) -> None:
        """Copies one step into the static buffers of bucket `size`, the padding sequence after it."""
        host, bs = self._host, self.cache.block_size
        t, b, seqs = len(token_ids), len(entries), self._seqs(size)
        pad = size - t
        self.token_ids[t:size].zero_()
        self.positions[..., t:size].zero_()
        if t:
            self.token_ids[:t].copy_(host(token_ids, torch.long), non_blocking=True)
            self.positions[..., :t].copy_(host(positions, torch.long), non_blocking=True)
        starts = [0]
        for _, _, new in entries:
            starts.append(starts[-1] + new)
        self.query_start[:seqs + 2].copy_(host(starts + [t] * (seqs - b) + [size], torch.int32), non_blocking=True)
        lens = [cached + new for _, cached, new in entries] + [1] * (seqs - b) + [max(pad, 1)]
        self.lens[:seqs + 1].copy_(host(lens, torch.int32), non_blocking=True)
        self.last_rows[:seqs].copy_(host(last_rows + [0] * (seqs - len(last_rows)), torch.long), non_blocking=True)
        groups = [(self.slots, self.tables, self.scratch_block, [e[0] for e in entries])]
        if sliding_tables is not None:
            groups.append((self.sliding_slots, self.sliding_tables, self.sliding_scratch, sliding_tables))
        pad_blocks = -(-size // bs)
        for slot_buf, table_buf, scratch, tables in groups:
            slots = [slot_of(table, p, bs) for table, (_, cached, new) in zip(tables, entries)
                     for p in range(cached, cached + new)]
            slots += [scratch * bs + i % bs for i in range(pad)]
            slot_buf[:size].copy_(host(slots, torch.int64), non_blocking=True)
            if b:
                width = max(len(table) for table in tables)
                padded = [table + [table[-1]] * (width - len(table)) for table in tables]
                table_buf[:b, :width].copy_(host(padded, torch.int32), non_blocking=True)
            # the empty slots and the padding sequence read the scratch block only
            table_buf[b:seqs + 1, :pad_blocks].fill_(scratch)

    def capture_all(self) -> None:
        """Captures every bucket, largest first so the smaller graphs reuse its memory pool; the
        captures run a step of padding only."""
        if not self.capture:
            return
        with torch.inference_mode():
            for size in sorted(self.sizes, reverse=True):
                if size not in self.graphs:
                    self._load(size, [], [], None, [], [] if self.sliding_tables is not None else None)
                    self._capture(size)

    def run(self, inputs, size: int) -> torch.Tensor:
        """One step (StepInputs that bucket() gave `size`) -> float32 logits [len(last_rows), V]
        of its last_rows (a view that the next run overwrites)."""
        self._load(size, inputs.token_ids, inputs.entries, inputs.positions, inputs.last_rows, inputs.sliding_tables)
        return self._run_loaded(size, len(inputs.last_rows))
