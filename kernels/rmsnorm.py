"""Fused residual add + RMSNorm, one program per row.

h = x + residual (rounded to x.dtype, as the model's own residual stream is), then
RMSNorm(h) with statistics in float32. The two checkpoint families round differently:
  weight_first=False (GLM, models.md A.3):   weight.to(dtype) * (h * rstd).to(dtype)
  weight_first=True  (gpt-oss, models.md C.4): (weight.float() * h * rstd).to(dtype)
Optionally the normed rows are also written in the MXFP4 packed-f16 MoE kernels' input form
(kernels/moe_gemv_half2.py), or as e4m3 with a scale a row (fp8_linear.quant_rows' form, for the
FP8 GEMMs at prefill sizes), the one place they are whole in registers already.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from .fp8_linear import quant_rows_ref, store_e4m3_row
from .moe_gemv_half2 import half2_input_ref, store_half2_row


@triton.jit
def _add_rms_norm_kernel(x_ptr, res_ptr, w_ptr, out_ptr, res_out_ptr, stride_x, stride_r, stride_o, stride_ro,
                         D, eps, xq_ptr, inv_scale_ptr, HAS_RESIDUAL: tl.constexpr, WEIGHT_FIRST: tl.constexpr,
                         BLOCK_D: tl.constexpr, HALF2: tl.constexpr = False, E4M3: tl.constexpr = False):
    """Program per row. HALF2: xq_ptr / inv_scale_ptr take the packed-f16 form; E4M3: they take
    the e4m3 row [D] and its float32 scale."""
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
    if E4M3:  # and as e4m3, the same values quant_rows would make of the stored row
        store_e4m3_row(out.to(tl.float32), d, mask, xq_ptr + row * D, inv_scale_ptr + row)


def add_rms_norm(x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor, eps: float,
                 weight_first: bool = False, half2: bool = False, e4m3: bool = False):
    """x, residual [T, D] (residual may be None) -> (normed [T, D], new residual x + residual [T, D]);
    half2: also the normed rows as the packed-f16 MoE kernels take them (half2_input_ref: xq
    [T, D] f16, inv_scale [T] float32) as a third element, which saves those kernels a launch;
    e4m3: instead the normed rows as quant_rows makes them (e4m3 [T, D], float32 scales [T, 1]),
    which saves the FP8 GEMM after the norm its quantisation launch."""
    if x.dim() != 2 or x.stride(-1) != 1:
        raise ValueError(f"x must be [T, D] contiguous along D, got {tuple(x.shape)} strides {x.stride()}")
    if half2 and e4m3:
        raise ValueError("add_rms_norm writes one extra form of its rows: half2 or e4m3, not both")
    t, d = x.shape
    out = torch.empty_like(x)
    res_out = torch.empty_like(x) if residual is not None else x
    q_dtype = torch.float16 if half2 else torch.float8_e4m3fn
    xq = torch.empty((t, d), dtype=q_dtype, device=x.device) if half2 or e4m3 else out
    inv_scale = torch.empty((t, 1), dtype=torch.float32, device=x.device) if half2 or e4m3 else out
    if t:
        res = residual if residual is not None else x
        _add_rms_norm_kernel[(t,)](x, res, weight, out, res_out, x.stride(0), res.stride(0), out.stride(0),
                                   res_out.stride(0), d, float(eps), xq, inv_scale, HAS_RESIDUAL=residual is not None,
                                   WEIGHT_FIRST=weight_first, BLOCK_D=triton.next_power_of_2(d), HALF2=half2,
                                   E4M3=e4m3, num_warps=4 if d <= 2048 else 8)
    if half2:
        return out, res_out, (xq, inv_scale[:, 0])
    return (out, res_out, (xq, inv_scale)) if e4m3 else (out, res_out)


def add_rms_norm_ref(x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor, eps: float,
                     weight_first: bool = False, half2: bool = False, e4m3: bool = False):
    if half2 and e4m3:
        raise ValueError("add_rms_norm writes one extra form of its rows: half2 or e4m3, not both")
    h = x if residual is None else (x.float() + residual.float()).to(x.dtype)
    hf = h.float()
    normed = hf * torch.rsqrt(hf.pow(2).mean(-1, keepdim=True) + eps)
    if weight_first:
        out = (weight.float() * normed).to(x.dtype)
    else:
        out = (weight.to(x.dtype).float() * normed.to(x.dtype).float()).to(x.dtype)
    if half2:
        return out, h, half2_input_ref(out)
    return (out, h, quant_rows_ref(out)) if e4m3 else (out, h)
