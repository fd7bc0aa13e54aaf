"""Dense gated MLP: down(silu(gate(x)) * up(x)) (GLM layer 0, shared experts, vision blocks)."""
from __future__ import annotations

import torch
import torch.nn.functional as F

from .linear import concat_rows, linear


class GatedMLP:
    def __init__(self, weights: dict, prefix: str):
        self.gate = weights[f"{prefix}.gate_proj.weight"]
        self.up = weights[f"{prefix}.up_proj.weight"]
        self.down = weights[f"{prefix}.down_proj.weight"]
        # gate and up read the same input: one fused weight, one kernel launch.
        fused = concat_rows([self.gate, self.up], [None, None])
        self.gate_up = None if fused is None else fused[0]

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if self.gate_up is None:
            return linear(F.silu(linear(x, self.gate)) * linear(x, self.up), self.down)
        gate, up = linear(x, self.gate_up).split(self.gate.shape[0], dim=-1)
        return linear(F.silu(gate) * up, self.down)
