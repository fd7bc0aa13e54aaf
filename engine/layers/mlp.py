"""Dense gated MLP: down(silu(gate(x)) * up(x)) (GLM layer 0, shared experts, vision blocks)."""
from __future__ import annotations

import torch
import torch.nn.functional as F

from ...kernels.glu import silu_mul, silu_mul_ref
from .linear import concat_rows, linear


class GatedMLP:
    def __init__(self, weights: dict, prefix: str):
        gate, up = weights[f"{prefix}.gate_proj.weight"], weights[f"{prefix}.up_proj.weight"]
        self.down = weights[f"{prefix}.down_proj.weight"]
        # gate and up read the same input: one fused weight, one kernel launch (only the fused
        # copy is kept, so the separate ones are freed with the loaded store).
        fused = concat_rows([gate, up], [None, None])
        self.parts = [fused[0]] if fused is not None else [gate, up]

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        """x [T, H] -> [T, H]."""
        outs = [linear(x, w) for w in self.parts]
        if len(outs) == 1:  # [T, 2I], gate columns first: the product in one pass
            act = (silu_mul if x.is_cuda else silu_mul_ref)(outs[0])
        else:
            act = F.silu(outs[0]) * outs[1]
        return linear(act, self.down)
