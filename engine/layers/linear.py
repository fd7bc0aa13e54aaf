"""Format-aware linear: y = x @ W^T + b for W in any checkpoint format.

On CPU the weight is dequantized exactly (the reference path); on CUDA dense weights go to
cuBLAS and FP8 weights to the FP8 kernel, which reads the 1-byte weights directly.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from ...kernels.fp8_linear import fp8_linear
from ..weights.formats import DenseWeight, Fp8Weight, LinearWeight


def linear(x: torch.Tensor, w: LinearWeight, bias: torch.Tensor | None = None) -> torch.Tensor:
    """x [..., K] -> [..., N] for w of shape [N, K]; computed in x.dtype."""
    if x.is_cuda and isinstance(w, Fp8Weight):
        return fp8_linear(x, w, bias)
    if isinstance(w, DenseWeight):
        weight = w.weight if w.weight.dtype == x.dtype else w.weight.to(x.dtype)
    else:
        weight = w.dequantize(x.dtype)
    return F.linear(x, weight, None if bias is None else bias.to(x.dtype))
