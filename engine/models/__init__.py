"""Model architectures, one file each; `build_model` picks by the spec's family."""
from __future__ import annotations

import torch

from ..parallel.context import SINGLE, ParallelContext
from ..spec import ModelSpec


def build_model(spec: ModelSpec, weights: dict, device: torch.device | str = "cpu", ctx: ParallelContext = SINGLE):
    """weights: the whole store, or this rank's slices of it (shard_plan) when ctx has several ranks."""
    if spec.family == "glm4v_moe":
        from .glm4v_moe import Glm4vMoeModel

        return Glm4vMoeModel(spec, weights, device, ctx)
    if spec.family == "gpt_oss":
        from .gpt_oss import GptOssModel

        return GptOssModel(spec, weights, device, ctx)
    raise ValueError(f"no model for family {spec.family!r}")
