"""Dense gated MLP: down(silu(gate(x)) * up(x)) (GLM layer 0, shared experts, vision blocks)."""
from __future__ import annotations

import torch
import torch.nn.functional as F

from .linear import linear


class GatedMLP:
    def __init__(self, weights: dict, prefix: str):
        self.gate = weights[f"{prefix}.gate_proj.weight"]
        self.up = weights[f"{prefix}.up_proj.weight"]
        self.down = weights[f"{prefix}.down_proj.weight"]

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return linear(F.silu(linear(x, self.gate)) * linear(x, self.up), self.down)
