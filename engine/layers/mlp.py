"""Dense gated MLP: down(silu(gate(x)) * up(x)) (GLM layer 0, shared experts, vision blocks)."""
from __future__ import annotations

import torch
import torch.nn.functional as F

from ...kernels.glu import silu_mul, silu_mul_ref
from .linear import concat_rows, linear, linear_takes_e4m3


class GatedMLP:
    def __init__(self, weights: dict, prefix: str):
        gate, up = weights[f"{prefix}.gate_proj.weight"], weights[f"{prefix}.up_proj.weight"]
        self.down = weights[f"{prefix}.down_proj.weight"]
        # gate and up read the same input: one fused weight, one kernel launch (only the fused
        # copy is kept, so the separate ones are freed with the loaded store).
        fused = concat_rows([gate, up], [None, None])
        self.parts = [fused[0]] if fused is not None else [gate, up]

    def takes_e4m3_input(self, num_tokens: int, dtype: torch.dtype, device: torch.device) -> bool:
        """Whether gate/up quantise these tokens' rows to e4m3, so the norm in front can write them
        (its e4m3 output, passed as x_e4m3)."""
        return linear_takes_e4m3(num_tokens, dtype, device, self.parts[0])

    def __call__(self, x: torch.Tensor, x_e4m3: tuple[torch.Tensor, torch.Tensor] | None = None) -> torch.Tensor:
        """x [T, H] -> [T, H]; x_e4m3: x's rows as e4m3 (takes_e4m3_input)."""
        outs = [linear(x, w, x_e4m3=x_e4m3) for w in self.parts]
        if len(outs) == 1:  # [T, 2I], gate columns first: the product in one pass
            act = (silu_mul if x.is_cuda else silu_mul_ref)(outs[0])
        else:
            act = F.silu(outs[0]) * outs[1]
        return linear(act, self.down)
