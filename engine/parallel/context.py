"""Where one process sits in a tensor-parallel group, and the two collectives the model uses.

A model is built with a ParallelContext and passes it down to the layers that need per-rank
sizes (attention heads, vocabulary rows, expert range). With world_size 1 (the default, SINGLE)
every method here returns its input untouched and no torch.distributed call is ever made, so a
single-GPU or CPU run needs no process group.

The collectives are called on the current stream with no host synchronisation (NCCL enqueues
them asynchronously), so a forward pass stays free of host syncs when it runs on several GPUs.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from ..spec import ModelSpec
from .slicing import RankLayout, rank_layout


@dataclass(frozen=True)
class ParallelContext:
    """rank of world_size; expert_parallel: routed experts split whole across the ranks instead
    of sliced on their intermediate dim; group: the torch.distributed process group (None with
    one rank)."""

    rank: int = 0
    world_size: int = 1
    expert_parallel: bool = False
    group: object = field(default=None, compare=False, repr=False)

    def __post_init__(self):
        if not 0 <= self.rank < self.world_size:
            raise ValueError(f"rank {self.rank} is outside a group of {self.world_size}")
        if self.world_size > 1 and self.group is None:
            raise ValueError("a tensor-parallel context needs a process group")

    @property
    def is_parallel(self) -> bool:
        return self.world_size > 1

    def layout(self, spec: ModelSpec) -> RankLayout:
        """This rank's head, vocabulary and expert ranges for `spec`."""
        return rank_layout(spec, self.world_size, self.rank, self.expert_parallel)

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """The sum of `x` over the ranks (in place when x is contiguous); x itself with one rank."""
        if self.world_size == 1:
            return x
        x = x.contiguous()
        import torch.distributed as dist

        dist.all_reduce(x, group=self.group)
        return x

    def gather_columns(self, x: torch.Tensor, per_rank: int, total: int) -> torch.Tensor:
        """x [n, c] this rank's columns (c <= per_rank; the last rank may hold fewer) ->
        [n, total], every rank's columns in rank order. x itself with one rank."""
        if self.world_size == 1:
            return x
        import torch.distributed as dist

        if x.shape[-1] < per_rank:
            x = F.pad(x, (0, per_rank - x.shape[-1]))
        x = x.contiguous()
        # One gather into one tensor, ranks stacked along rows ([world * n, c], the layout every
        # backend takes), which CUDA graphs capture as a single collective.
        n, c = x.shape
        out = torch.empty((self.world_size * n, c), dtype=x.dtype, device=x.device)
        dist.all_gather_into_tensor(out, x, group=self.group)
        return out.view(self.world_size, n, c).permute(1, 0, 2).reshape(n, self.world_size * c)[:, :total]


SINGLE = ParallelContext()
