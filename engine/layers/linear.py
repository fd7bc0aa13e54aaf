"""Format-aware linear: y = x @ W^T + b for W in any checkpoint format.

On CPU the weight is dequantized exactly (the reference path); on CUDA dense weights go to
cuBLAS (or, for one token and a wide output, to the row-streaming GEMV, which reads the weight
once in a single launch where cuBLAS splits K over two) and FP8 weights to the FP8 kernel,
which reads the 1-byte weights directly.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from ...kernels import row_gemv
from ...kernels.fp8_linear import fp8_linear
from ..weights.formats import DenseWeight, Fp8Weight, LinearWeight


def linear(x: torch.Tensor, w: LinearWeight, bias: torch.Tensor | None = None) -> torch.Tensor:
    """x [..., K] -> [..., N] for w of shape [N, K]; computed in x.dtype."""
    if x.is_cuda and isinstance(w, Fp8Weight):
        return fp8_linear(x, w, bias)
    if isinstance(w, DenseWeight):
        weight = w.weight if w.weight.dtype == x.dtype else w.weight.to(x.dtype)
        rows = x.numel() // max(x.shape[-1], 1)
        if (x.is_cuda and 0 < rows <= row_gemv.DENSE_GEMV_MAX_M and weight.shape[0] >= row_gemv.DENSE_GEMV_MIN_N
                and weight.stride(-1) == 1):
            out = row_gemv.dense_gemv(x.reshape(rows, x.shape[-1]), weight, bias)
            return out.reshape(*x.shape[:-1], weight.shape[0])
    else:
        weight = w.dequantize(x.dtype)
    return F.linear(x, weight, None if bias is None else bias.to(x.dtype))


def concat_rows(weights: list[LinearWeight], biases: list[torch.Tensor | None]
                ) -> tuple[LinearWeight, torch.Tensor | None] | None:
    """Several linears over the same input as one [sum N, K] weight (and bias), so one kernel
    reads them all; None when their formats cannot share one record (mixed formats, FP8 block
    rows not on the block grid, MXFP4)."""
    first = weights[0]
    if any(type(w) is not type(first) for w in weights) or (biases[0] is None) != all(b is None for b in biases):
        return None
    bias = None if biases[0] is None else torch.cat([b.to(biases[0].dtype) for b in biases])
    if isinstance(first, DenseWeight):
        if len({w.weight.dtype for w in weights}) > 1:
            return None
        return DenseWeight(torch.cat([w.weight for w in weights])), bias
    if not isinstance(first, Fp8Weight) or any(w.block != first.block for w in weights):
        return None
    if first.block is None:  # channel or tensor scales both become one scale per row
        scales = [w.scale.to(torch.float32).reshape(-1, 1).expand(w.shape[0], 1) for w in weights]
        return Fp8Weight(torch.cat([w.weight for w in weights]), torch.cat(scales).contiguous()), bias
    bn = first.block[0]
    if any(w.shape[0] % bn for w in weights[:-1]):
        return None
    return Fp8Weight(torch.cat([w.weight for w in weights]), torch.cat([w.scale for w in weights]), first.block), bias
