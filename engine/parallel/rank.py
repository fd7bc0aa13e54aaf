"""What every rank does the same way: read its slices of the checkpoint, build its model."""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch

from ..models import build_model
from ..spec import ModelSpec
from ..weights.loader import ProgressFn, load_weights_slice, weight_bytes
from .context import ParallelContext
from .slicing import shard_plan


@dataclass(frozen=True)
class LoadReport:
    """rank; bytes_read: checkpoint bytes this rank read; bytes_held: what its weights occupy
    (zeroed biases of other ranks included); free_bytes, total_bytes: its device memory after
    loading (0, 0 on CPU)."""

    rank: int
    bytes_read: int
    bytes_held: int
    free_bytes: int = 0
    total_bytes: int = 0


def load_rank(path: str | Path, spec: ModelSpec, ctx: ParallelContext, device: torch.device, dtype: torch.dtype,
              on_progress: ProgressFn | None = None, quantize: str | None = None):
    """Reads only this rank's ranges of the checkpoint (shard_plan) and builds its model.
    quantize: as load_weights'. Returns (model, LoadReport)."""
    plan = shard_plan(spec, ctx.world_size, ctx.rank, ctx.expert_parallel)
    read = [0]

    def progress(done: int, total: int, file) -> None:
        read[0] = done
        if on_progress is not None:
            on_progress(done, total, file)

    weights = load_weights_slice(path, spec, plan, device=device, dtype=dtype, on_progress=progress,
                                 quantize=quantize)
    model = build_model(spec, weights, device, ctx)
    free = total = 0
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        free, total = torch.cuda.mem_get_info(device)
    return model, LoadReport(ctx.rank, read[0], weight_bytes(weights), free, total)
