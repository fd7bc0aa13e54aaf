"""RMSNorm in the two flavours the supported checkpoints were trained with (alone, and fused with
the residual add: a Triton kernel on CUDA, its torch reference elsewhere), and LayerNorm."""
from __future__ import annotations

import torch
import torch.nn.functional as F

from ...kernels.rmsnorm import add_rms_norm as add_rms_norm_kernel
from ...kernels.rmsnorm import add_rms_norm_ref


def add_rms_norm(x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor, eps: float,
                 weight_first: bool = False, half2: bool = False, e4m3: bool = False):
    """x, residual [T, D] -> (rms_norm(x + residual), x + residual); residual None: (rms_norm(x), x).
    One pass over the residual stream instead of an add and a norm. half2: a third element, the
    normed rows in the MXFP4 packed-f16 MoE kernels' input form; e4m3: instead the normed rows as
    e4m3 with a scale each, for the FP8 GEMM after the norm (kernels/rmsnorm.py)."""
    fn = add_rms_norm_kernel if x.is_cuda else add_rms_norm_ref
    return fn(x, residual, weight, eps, weight_first, half2, e4m3)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, weight_first: bool = False) -> torch.Tensor:
    """x [..., D]. Statistics in float32. weight_first=True multiplies by the weight in float32
    before casting back (gpt-oss); False casts first, then multiplies (GLM)."""
    h = x.to(torch.float32)
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    if weight_first:
        return (weight.to(torch.float32) * h).to(x.dtype)
    return weight.to(x.dtype) * h.to(x.dtype)


def layer_norm(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor, eps: float = 1e-5) -> torch.Tensor:
    return F.layer_norm(x, (x.shape[-1],), weight.to(x.dtype), bias.to(x.dtype), eps)
