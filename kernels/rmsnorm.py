"""Fused residual add + RMSNorm, one program per row.

h = x + residual (rounded to x.dtype, as the model's own residual stream is), then
RMSNorm(h) with statistics in float32. The two checkpoint families round differently:
  weight_first=False (GLM, models.md A.3):   weight.to(dtype) * (h * rstd).to(dtype)
  weight_first=True  (gpt-oss, models.md C.4): (weight.float() * h * rstd).to(dtype)
Optionally the normed rows are also written in the MXFP4 packed-f16 MoE kernels' input form
(kernels/moe_gemv_half2.py), the one place they are whole in registers already.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from .moe_gemv_half2 import half2_input_ref, store_half2_row


@triton.jit
def _add_rms_norm_kernel(x_ptr, res_ptr, w_ptr, out_ptr, res_out_ptr, stride_x, stride_r, stride_o, stride_ro,
                         D, eps, xq_ptr, inv_scale_ptr, HAS_RESIDUAL: tl.constexpr, WEIGHT_FIRST: tl.constexpr,
                         BLOCK_D: tl.constexpr, HALF2: tl.constexpr = False):
    row = tl.program_id(0).to(tl.int64)
    d = tl.arange(0, BLOCK_D)
    mask = d < D
    dtype = out_ptr.dtype.element_ty
    h = tl.load(x_ptr + row * stride_x + d, mask=mask, other=0.0).to(tl.float32)
    if HAS_RESIDUAL:
        h += tl.load(res_ptr + row * stride_r + d, mask=mask, other=0.0).to(tl.float32)
        h_rounded = h.to(dtype)
        tl.store(res_out_ptr + row * stride_ro + d, h_rounded, mask=mask)
        h = h_rounded.to(tl.float32)
    rstd = tl.rsqrt(tl.sum(h * h, axis=0) / D + eps)
    w = tl.load(w_ptr + d, mask=mask, other=0.0).to(tl.float32)
    if WEIGHT_FIRST:
        out = w * (h * rstd)
    else:
        out = w.to(dtype).to(tl.float32) * (h * rstd).to(dtype).to(tl.float32)
    out = out.to(dtype)
    tl.store(out_ptr + row * stride_o + d, out, mask=mask)
    if HALF2:  # the normed row again in the MXFP4 packed-f16 MoE kernels' input form
        store_half2_row(out.to(tl.float32), d, mask, xq_ptr + row * D, inv_scale_ptr + row)


def add_rms_norm(x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor, eps: float,
                 weight_first: bool = False, half2: bool = False):
    """x, residual [T, D] (residual may be None) -> (normed [T, D], new residual x + residual [T, D]);
    half2: also the normed rows as the packed-f16 MoE kernels take them (half2_input_ref: xq
    [T, D] f16, inv_scale [T] float32) as a third element, which saves those kernels a launch."""
    if x.dim() != 2 or x.stride(-1) != 1:
        raise ValueError(f"x must be [T, D] contiguous along D, got {tuple(x.shape)} strides {x.stride()}")
    t, d = x.shape
    out = torch.empty_like(x)
    res_out = torch.empty_like(x) if residual is not None else x
    xq = torch.empty((t, d), dtype=torch.float16, device=x.device) if half2 else out
    inv_scale = torch.empty((t,), dtype=torch.float32, device=x.device) if half2 else out
    if t:
        res = residual if residual is not None else x
        _add_rms_norm_kernel[(t,)](x, res, weight, out, res_out, x.stride(0), res.stride(0), out.stride(0),
                                   res_out.stride(0), d, float(eps), xq, inv_scale, HAS_RESIDUAL=residual is not None,
                                   WEIGHT_FIRST=weight_first, BLOCK_D=triton.next_power_of_2(d), HALF2=half2,
                                   num_warps=4 if d <= 2048 else 8)
    return (out, res_out, (xq, inv_scale)) if half2 else (out, res_out)


def add_rms_norm_ref(x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor, eps: float,
                     weight_first: bool = False, half2: bool = False):
    h = x if residual is None else (x.float() + residual.float()).to(x.dtype)
    hf = h.float()
    normed = hf * torch.rsqrt(hf.pow(2).mean(-1, keepdim=True) + eps)
    if weight_first:
        out = (weight.float() * normed).to(x.dtype)
    else:
        out = (weight.to(x.dtype).float() * normed.to(x.dtype).float()).to(x.dtype)
    return (out, h, half2_input_ref(out)) if half2 else (out, h)
