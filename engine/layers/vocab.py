"""Token embedding and output head over a vocabulary split in row ranges across ranks.

Each rank holds rows [start, end) of the embedding and of lm_head (engine/parallel/slicing.py).
The embedding returns this rank's partial rows (zeros for ids another rank holds): the model's
all-reduce sums them into the full lookup. The head computes this rank's logit columns and
gathers all ranks' columns. With one rank both are the plain operations.
"""
from __future__ import annotations

import torch

from ..parallel.context import ParallelContext
from ..spec import ModelSpec
from ..weights.formats import LinearWeight
from .linear import linear


class VocabEmbedding:
    def __init__(self, weight: torch.Tensor, spec: ModelSpec, ctx: ParallelContext):
        """weight [rows of this rank, hidden]."""
        self.weight, self.ctx = weight, ctx
        self.start, end = ctx.layout(spec).vocab
        if weight.shape[0] != end - self.start:
            raise ValueError(f"embedding has {weight.shape[0]} rows but rank {ctx.rank} of {ctx.world_size} "
                             f"should hold vocabulary rows [{self.start}, {end})")

    def __call__(self, input_ids: torch.Tensor) -> torch.Tensor:
        """input_ids [T] -> [T, hidden]: the embeddings (one rank), or this rank's share of them."""
        if not self.ctx.is_parallel:
            return self.weight[input_ids]
        local = input_ids - self.start
        held = (local >= 0) & (local < self.weight.shape[0])
        rows = self.weight[local.clamp(0, self.weight.shape[0] - 1)]
        return torch.where(held[:, None], rows, torch.zeros((), dtype=rows.dtype, device=rows.device))


class VocabHead:
    def __init__(self, weight: LinearWeight, spec: ModelSpec, ctx: ParallelContext):
        """weight [rows of this rank, hidden] (any linear format)."""
        self.weight, self.ctx, self.vocab_size = weight, ctx, spec.vocab_size
        layout = ctx.layout(spec)
        self.per_rank = layout.vocab_per_rank
        start, end = layout.vocab
        if weight.shape[0] != end - start:
            raise ValueError(f"lm_head has {weight.shape[0]} rows but rank {ctx.rank} of {ctx.world_size} "
                             f"should hold vocabulary rows [{start}, {end})")

    def __call__(self, h: torch.Tensor) -> torch.Tensor:
        """h [T, hidden] -> float32 logits [T, vocab] over the whole vocabulary (on every rank)."""
        local = linear(h, self.weight).to(torch.float32)
        return self.ctx.gather_columns(local, self.per_rank, self.vocab_size)
