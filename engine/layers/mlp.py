"""Dense gated MLP: down(silu(gate(x)) * up(x)) (GLM layer 0, shared experts, vision blocks)."""
from __future__ import annotations

import torch
import torch.nn.functional as F

from .linear import concat_rows, linear


class GatedMLP:
    def __init__(self, weights: dict, prefix: str):
        gate, up = weights[f"{prefix}.gate_proj.weight"], weights[f"{prefix}.up_proj.weight"]
        self.down = weights[f"{prefix}.down_proj.weight"]
        # gate and up read the same input: one fused weight, one kernel launch (only the fused
        # copy is kept, so the separate ones are freed with the loaded store).
        fused = concat_rows([gate, up], [None, None])
        self.parts = [fused[0]] if fused is not None else [gate, up]
        self.intermediate = gate.shape[0]

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        outs = [linear(x, w) for w in self.parts]
        gate, up = outs[0].split(self.intermediate, dim=-1) if len(outs) == 1 else outs
        return linear(F.silu(gate) * up, self.down)
