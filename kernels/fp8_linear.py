"""FP8 (e4m3) dense linear y = x @ W^T (+ b) with channel, tensor or block weight scales.

Decode sizes (M <= 2): a row-streaming Triton kernel reads W once in wide slabs and reduces
each token against it with FMAs, split over N so 1 token fills the GPU. Medium M: the weight-only
tile kernel of the MoE GEMMs with one "expert". Large M with channel/tensor scales on CUDA: torch._scaled_mm on FP8 tensor cores, with the
activations quantised per token on the fly (dynamic scales, as compressed-tensors FP8_DYNAMIC
checkpoints expect, models.md B). Block scales at large M stay on the Triton kernel.
"""
from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from ..engine.weights.formats import Fp8Weight
from .gpu_facts import compiled_on_gpu, sm_count
from .moe_gemm import FMT_FP8_BLK, FMT_FP8_ROW, _row_scale, _weight_dot
from .row_gemv import GEMV_MAX_M, gemv_block_n, row_gemv_kernel

FP8_MAX = 448.0
SCALED_MM_MIN_M = 64
# Software-pipeline depth of the row GEMV over K. H200, 128x128 block scales, 1 token, weights out
# of L2 (bench/bench_row_gemv.py): 4 stages against none, GLM-4.5V q/k/v 28.1 -> 24.7 us, o_proj
# 56.5 -> 49.1 us, shared expert gate/up 19.5 -> 15.6 us.
FP8_GEMV_STAGES = 4


@triton.jit
def _fp8_linear_kernel(x_ptr, stride_xm, w_ptr, stride_wn, s_ptr, stride_sn, stride_sk, b_ptr, out_ptr, stride_om,
                       M, N, K, FORMAT: tl.constexpr, SBN: tl.constexpr, SBK: tl.constexpr, HAS_BIAS: tl.constexpr,
                       BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    m = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    m_valid = m < M
    rows = tl.where(m_valid, m, 0).to(tl.int64)
    n_mask = n < N
    zero = tl.program_id(0) * 0  # the "expert" index of the shared tile code
    acc = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        acc = _weight_dot(acc, w_ptr, s_ptr, zero, n, n_mask, k0, K, x_ptr, rows, m_valid, stride_xm,
                          0, stride_wn, 0, stride_sn, stride_sk, FORMAT, False, SBN, SBK, BLOCK_K, "bf16")
    acc = _row_scale(acc, s_ptr, zero, n, n_mask, 0, stride_sn, FORMAT)
    if HAS_BIAS:
        acc += tl.load(b_ptr + n, mask=n_mask, other=0.0).to(tl.float32)[:, None]
    tl.store(out_ptr + rows[None, :] * stride_om + n[:, None], acc.to(out_ptr.dtype.element_ty),
             mask=m_valid[None, :] & n_mask[:, None])


def _gemv_block_k(fmt: int, sbk: int) -> int:
    """K step of the row GEMV: 512 columns, as whole scale blocks when those are a power of two
    that divides 512 (each block scaled after its partial sum), else the largest divisor of the
    scale block up to 512. H200, 128x128 blocks, 1 token: 512 against one 128 block a step,
    GLM-4.5V o_proj 49.0 -> 24.8 us, q/k/v 26.6 -> 22.5 us (bench/bench_row_gemv.py)."""
    if fmt == FMT_FP8_ROW or (sbk & (sbk - 1) == 0 and 512 % sbk == 0):
        return 512
    return math.gcd(sbk, 512)


def _triton_fp8_linear(x: torch.Tensor, w: Fp8Weight, bias: torch.Tensor | None, on_gpu: bool,
                       block_n: int | None = None, block_k: int | None = None,
                       stages: int | None = None) -> torch.Tensor:
    m, k = x.shape
    n = w.weight.shape[0]
    if w.block is None:
        fmt, sbn, sbk = FMT_FP8_ROW, 1, 1
        s = w.scale.to(torch.float32).expand(n, 1)[:, 0]
        s_strides = (s.stride(0), 0)
    else:
        fmt, (sbn, sbk) = FMT_FP8_BLK, w.block
        s = w.scale.to(torch.float32)
        s_strides = (s.stride(0), s.stride(1))
    out = torch.empty((m, n), dtype=x.dtype, device=x.device)
    if m <= GEMV_MAX_M:
        block_k = block_k or _gemv_block_k(fmt, sbk)
        if not on_gpu:
            block_n = block_n or 4
        elif fmt == FMT_FP8_BLK:
            # H200, 128x128 blocks, 1 token: 16 rows a program from 4096 outputs (o_proj 24.8 -> 19.3
            # us against the bf16 choice of 4), 8 below (2816 outputs: 7.7 us, 16 rows 8.2)
            block_n = block_n or (16 if n >= 4096 else 8)
        else:
            block_n = block_n or gemv_block_n(n, sm_count(x.device))
        row_gemv_kernel[(triton.cdiv(n, block_n),)](
            x, x.stride(0), w.weight, w.weight.stride(0), s, *s_strides, bias if bias is not None else x, out,
            out.stride(0), m, n, k, FORMAT=fmt, SBN=sbn, SBK=sbk, HAS_BIAS=bias is not None,
            M_PAD=triton.next_power_of_2(m), BLOCK_N=block_n, BLOCK_K=block_k if on_gpu else min(block_k, 32),
            STAGES=(stages or FP8_GEMV_STAGES) if on_gpu else 1, num_warps=4)
        return out
    if on_gpu:
        block_m = 16 if m <= 16 else (32 if m <= 32 else 64)
        block_n, block_k, warps, stages = (32, 128, 4, 4) if m <= 32 else (64, 128, 4, 3)
    else:
        block_m, block_n, block_k, warps, stages = 16, 32, 32, 1, 1
    if fmt == FMT_FP8_BLK and sbk % block_k:
        block_k = sbk
    _fp8_linear_kernel[(triton.cdiv(m, block_m), triton.cdiv(n, block_n))](
        x, x.stride(0), w.weight, w.weight.stride(0), s, *s_strides, bias if bias is not None else x, out,
        out.stride(0), m, n, k, FORMAT=fmt, SBN=sbn, SBK=sbk, HAS_BIAS=bias is not None,
        BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k, num_warps=warps, num_stages=stages)
    return out


def _scaled_mm_linear(x: torch.Tensor, w: Fp8Weight, bias: torch.Tensor | None) -> torch.Tensor:
    x_scale = x.abs().amax(-1, keepdim=True).to(torch.float32).clamp_min(1e-12) / FP8_MAX
    x_fp8 = (x.to(torch.float32) / x_scale).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)
    w_scale = w.scale.to(torch.float32).expand(w.weight.shape[0], 1).reshape(1, -1).contiguous()
    out = torch._scaled_mm(x_fp8, w.weight.t(), scale_a=x_scale, scale_b=w_scale, out_dtype=x.dtype)
    return out if bias is None else out + bias.to(x.dtype)


def fp8_linear(x: torch.Tensor, w: Fp8Weight, bias: torch.Tensor | None = None, *, block_n: int | None = None,
               block_k: int | None = None, stages: int | None = None) -> torch.Tensor:
    """x [..., K] (bf16/fp16/fp32), w [N, K] e4m3 with scales -> [..., N] in x.dtype.
    block_n / block_k / stages: row-GEMV tile override (one or two tokens) for benchmarks."""
    if w.weight.dim() != 2 or x.shape[-1] != w.weight.shape[1]:
        raise ValueError(f"x [..., {x.shape[-1]}] does not match the FP8 weight {tuple(w.weight.shape)}")
    lead = x.shape[:-1]
    x2 = x.reshape(-1, x.shape[-1])
    x2 = x2 if x2.stride(-1) == 1 else x2.contiguous()
    on_gpu = compiled_on_gpu(x.device)
    k, n = w.weight.shape[1], w.weight.shape[0]
    if on_gpu and w.block is None and x2.shape[0] >= SCALED_MM_MIN_M and k % 16 == 0 and n % 16 == 0 \
            and x.dtype != torch.float32:
        out = _scaled_mm_linear(x2, w, bias)
    else:
        out = _triton_fp8_linear(x2, w, bias, on_gpu, block_n, block_k, stages)
    return out.reshape(*lead, n)


def fp8_linear_ref(x: torch.Tensor, w: Fp8Weight, bias: torch.Tensor | None = None, *, block_n: int | None = None,
                   block_k: int | None = None, stages: int | None = None) -> torch.Tensor:
    y = x.to(torch.float32) @ w.dequantize(torch.float32).T
    if bias is not None:
        y = y + bias.to(torch.float32)
    return y.to(x.dtype)
