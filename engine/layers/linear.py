"""Format-aware linear: y = x @ W^T + b for W in any checkpoint format.

On CPU the weight is dequantized exactly (the reference path); on CUDA dense weights go to
cuBLAS and quantized ones to the kernels in localchat.kernels once those are wired.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from ..weights.formats import DenseWeight, LinearWeight


def linear(x: torch.Tensor, w: LinearWeight, bias: torch.Tensor | None = None) -> torch.Tensor:
    """x [..., K] -> [..., N] for w of shape [N, K]; computed in x.dtype."""
    if isinstance(w, DenseWeight):
        weight = w.weight if w.weight.dtype == x.dtype else w.weight.to(x.dtype)
    else:
        weight = w.dequantize(x.dtype)
    return F.linear(x, weight, None if bias is None else bias.to(x.dtype))
