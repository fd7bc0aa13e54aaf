"""Format-aware linear: y = x @ W^T + b for W in any checkpoint format.

On CPU the weight is dequantized exactly (the reference path); on CUDA dense weights go to
cuBLAS (or, for one token and a wide output, to the row-streaming GEMV, which reads the weight
once in a single launch where cuBLAS splits K over two) and FP8 weights to the FP8 kernel,
which reads the 1-byte weights directly.
"""
from __future__ import annotations

import functools

import torch
import torch.nn.functional as F

from ...kernels import row_gemv
from ...kernels.fp8_linear import fp8_linear, takes_e4m3_rows
from ...kernels.gpu_facts import cuda_index
from ..weights.formats import DenseWeight, Fp8Weight, LinearWeight


def linear(x: torch.Tensor, w: LinearWeight, bias: torch.Tensor | None = None,
           x_e4m3: tuple[torch.Tensor, torch.Tensor] | None = None) -> torch.Tensor:
    """x [..., K] -> [..., N] for w of shape [N, K]; computed in x.dtype. x_e4m3: x's rows as e4m3
    with a scale each (quant_rows' form), which FP8 weights use where linear_takes_e4m3 says so."""
    if x.is_cuda and isinstance(w, Fp8Weight):
        return fp8_linear(x, w, bias, x_e4m3=x_e4m3)
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


def linear_takes_e4m3(rows: int, dtype: torch.dtype, device: torch.device, w: LinearWeight) -> bool:
    """Whether linear quantises `rows` rows of x to e4m3 a row at a time for w (FP8 channel scales
    on cuBLAS), so that the norm in front can hand them over already in that form."""
    return isinstance(w, Fp8Weight) and takes_e4m3_rows(rows, dtype, device, w)


@functools.lru_cache(maxsize=None)
def mm_float32_out_works(device_index: int) -> bool:
    """Whether torch.mm takes 16-bit operands to a float32 product on this GPU (out_dtype; cuBLAS
    summing in float32), tried once per device on a small product against float64."""
    dev = torch.device("cuda", device_index)
    gen = torch.Generator(device=dev).manual_seed(0)
    a = torch.randn(40, 320, device=dev, generator=gen).to(torch.bfloat16)
    b = torch.randn(320, 24, device=dev, generator=gen).to(torch.bfloat16)
    try:
        out = torch.mm(a, b, out_dtype=torch.float32)
    except (RuntimeError, NotImplementedError, TypeError):
        return False
    ref = a.double() @ b.double()
    return out.dtype == torch.float32 and bool(((out.double() - ref).abs().max() / ref.abs().max()) < 1e-5)


def linear_float32(x: torch.Tensor, w: DenseWeight) -> torch.Tensor:
    """x [T, K] @ W^T [K, N] -> [T, N] float32, as the float32 linear of both operands computes it
    (GLM's router). Products of two bf16 or fp16 values are exact in float32, so on CUDA a 16-bit
    GEMM that sums in float32 and writes float32 is that linear, up to the order of its sums,
    without float32 copies of the activations and the weight or float32's SIMT GEMM (at 2048
    tokens of GLM-4.5V: ~83 us a MoE layer that way)."""
    weight = w.weight
    if (x.is_cuda and x.dim() == 2 and x.dtype in (torch.bfloat16, torch.float16) and weight.dtype == x.dtype
            and mm_float32_out_works(cuda_index(x.device))):
        return torch.mm(x, weight.t(), out_dtype=torch.float32)
    return F.linear(x.to(torch.float32), weight.to(torch.float32))


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
