"""SiLU-gated product of a fused gate/up projection: out = silu(gate) * up, one pass.

The dense gated MLPs (GLM's shared expert, its first layer, the vision tower's blocks) read gate
and up as one [M, 2I] output of one linear (gate columns first). Two torch ops would read and
write the intermediate twice and cost two launches; here each element is read once, computed in
float32 and rounded once (torch rounds silu(gate) to the activation dtype before the product, so
the two differ by at most that one rounding).
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

BLOCK = 1024  # columns a program


@triton.jit
def _silu_mul_kernel(gu_ptr, out_ptr, stride_gu, stride_out, I, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < I
    g = tl.load(gu_ptr + row * stride_gu + cols, mask=mask, other=0.0).to(tl.float32)
    u = tl.load(gu_ptr + row * stride_gu + I + cols, mask=mask, other=0.0).to(tl.float32)
    tl.store(out_ptr + row * stride_out + cols, (g * tl.sigmoid(g) * u).to(out_ptr.dtype.element_ty), mask=mask)


def silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """gate_up [M, 2I] (gate columns, then up; contiguous along columns) -> silu(gate) * up [M, I]
    in gate_up's dtype."""
    m, two_i = gate_up.shape
    if two_i % 2 or gate_up.stride(-1) != 1:
        raise ValueError(f"silu_mul takes [M, 2I] contiguous along its columns, got {tuple(gate_up.shape)} "
                         f"with strides {gate_up.stride()}")
    i = two_i // 2
    out = torch.empty((m, i), dtype=gate_up.dtype, device=gate_up.device)
    if m:
        _silu_mul_kernel[(m, triton.cdiv(i, BLOCK))](gate_up, out, gate_up.stride(0), out.stride(0), i, BLOCK=BLOCK)
    return out


def silu_mul_ref(gate_up: torch.Tensor) -> torch.Tensor:
    gate, up = gate_up.chunk(2, dim=-1)
    return F.silu(gate) * up
