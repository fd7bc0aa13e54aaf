"""Row-streaming GEMV for one or two tokens: y [M, N] = x [M, K] @ W[N, K]^T (+ b).

At M <= 2 a tensor-core tile is almost all padding and cuBLAS splits K over a second reduction
kernel; streaming the weight rows once in wide slabs and reducing them with FMAs reads W at
close to copy bandwidth in one launch. Weights: dense (any float dtype), or FP8 e4m3 with
channel or block scales (kernels/fp8_linear.py launches those).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from .gpu_facts import MEASURED_SMS, compiled_on_gpu, sm_count
from .moe_gemm import FMT_DENSE

GEMV_MAX_M = 2  # H200, FP8: 1 token 2.4x faster than the tile kernel; at 4 the two are even, at 8 the tile wins
# Dense weights: dense_gemv replaces cuBLAS for up to DENSE_GEMV_MAX_M rows and at least
# DENSE_GEMV_MIN_N outputs. H200, bf16, 1 token: 8.5 vs 9.1 us (gpt-oss o_proj), 8.1 vs 8.5
# (q/k/v), 263 vs 279 (lm_head); at 2 tokens cuBLAS is faster, and for a router (128 outputs:
# 32 programs, each a long serial stream) it is faster too (5.9 vs 6.1 us bf16).
DENSE_GEMV_MAX_M = 1
DENSE_GEMV_MIN_N = 1024
# Software-pipeline depth over K for dense weights. H200, bf16, 1 token, weights out of L2
# (bench/bench_row_gemv.py): 4 stages against none, gpt-oss q/k/v 12.7 -> 10.3 us, o_proj 13.1 ->
# 9.9 us, GLM o_proj 37.4 -> 28.4 us, GLM q/k/v 31.7 -> 32.7 us.
DENSE_GEMV_STAGES = 4


@triton.jit
def weight_slab(w_rows, s_base, n, n_mask, k0, K, stride_sn, stride_sk, FORMAT: tl.constexpr, SBN: tl.constexpr,
                SBK: tl.constexpr, BLOCK_K: tl.constexpr):
    """One K step of the dense or FP8 rows n starting at w_rows [BLOCK_N] -> (column indices kk,
    their mask, weights float32, the step's scales s from the scale matrix at s_base); slab_dot
    reduces it against one activation row loaded at kk. FP8 block scales with BLOCK_K > SBK (SBK
    a power of two dividing BLOCK_K): kk [NSB, SBK], w [BLOCK_N, NSB, SBK], s [BLOCK_N, NSB],
    NSB = BLOCK_K / SBK. Otherwise kk [BLOCK_K], w [BLOCK_N, BLOCK_K], and s [BLOCK_N] the one
    scale block the step lies in (BLOCK_K divides SBK; ones unless FORMAT is 2)."""
    if FORMAT == 2 and BLOCK_K > SBK:
        NSB: tl.constexpr = BLOCK_K // SBK
        sb = k0 // SBK + tl.arange(0, NSB)
        kk = sb[:, None] * SBK + tl.arange(0, SBK)[None, :]
        k_mask = kk < K
        w = tl.load(w_rows[:, None, None] + kk[None, :, :], mask=n_mask[:, None, None] & k_mask[None, :, :],
                    other=0.0).to(tl.float32)
        s = tl.load(s_base + (n // SBN)[:, None] * stride_sn + sb[None, :] * stride_sk,
                    mask=n_mask[:, None] & (sb * SBK < K)[None, :], other=0.0)
    else:
        kk = k0 + tl.arange(0, BLOCK_K)
        k_mask = kk < K
        w = tl.load(w_rows[:, None] + kk[None, :], mask=n_mask[:, None] & k_mask[None, :], other=0.0)
        w = w.to(tl.float32)
        if FORMAT == 2:
            s = tl.load(s_base + (n // SBN) * stride_sn + (k0 // SBK) * stride_sk, mask=n_mask, other=0.0)
        else:
            s = tl.full(n.shape, 1.0, tl.float32)
    return kk, k_mask, w, s


@triton.jit
def slab_dot(w, s, x, FORMAT: tl.constexpr, SBK: tl.constexpr, BLOCK_K: tl.constexpr):
    """[BLOCK_N]: a weight_slab (w, s) against the activations x loaded at its kk; block-scaled
    steps sum each scale block, scale it once, then add the blocks."""
    if FORMAT == 2 and BLOCK_K > SBK:
        return tl.sum(tl.sum(w * x.to(tl.float32)[None, :, :], axis=2) * s, axis=1)
    else:
        part = tl.sum(w * x.to(tl.float32)[None, :], axis=1)
        if FORMAT == 2:
            part = part * s
        return part


@triton.jit
def row_gemv_kernel(x_ptr, stride_xm, w_ptr, stride_wn, s_ptr, stride_sn, stride_sk, b_ptr, out_ptr, stride_om,
                    M, N, K, FORMAT: tl.constexpr, SBN: tl.constexpr, SBK: tl.constexpr, HAS_BIAS: tl.constexpr,
                    M_PAD: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, STAGES: tl.constexpr):
    """Each program reads BLOCK_N weight rows once, in contiguous BLOCK_K slabs, and reduces them
    against every token's activations. FORMAT: 0 dense, 1 FP8 channel scales (applied once at
    the end), 2 FP8 block scales (applied per scale block: BLOCK_K divides SBK, or SBK is a power
    of two dividing BLOCK_K and each step sums BLOCK_K / SBK blocks separately). STAGES: depth of
    the software pipeline over K (asynchronous copies of the weight slabs)."""
    n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    n_mask = n < N
    cols = tl.arange(0, M_PAD)
    acc = tl.zeros((BLOCK_N, M_PAD), dtype=tl.float32)
    w_rows = w_ptr + n.to(tl.int64) * stride_wn
    for k0 in tl.range(0, K, BLOCK_K, num_stages=STAGES):
        kk, k_mask, w, s = weight_slab(w_rows, s_ptr, n, n_mask, k0, K, stride_sn, stride_sk, FORMAT, SBN, SBK,
                                       BLOCK_K)
        for m in tl.static_range(M_PAD):
            # broadcast to a tensor: Triton 3.9's interpreter rejects a tensor & scalar mask
            x = tl.load(x_ptr + m * stride_xm + kk, mask=k_mask & ((kk * 0 + m) < M), other=0.0)
            acc = tl.where(cols[None, :] == m, acc + slab_dot(w, s, x, FORMAT, SBK, BLOCK_K)[:, None], acc)
    if FORMAT == 1:
        acc = acc * tl.load(s_ptr + n * stride_sn, mask=n_mask, other=0.0)[:, None]
    if HAS_BIAS:
        acc += tl.load(b_ptr + n, mask=n_mask, other=0.0).to(tl.float32)[:, None]
    tl.store(out_ptr + cols[None, :] * stride_om + n[:, None], acc.to(out_ptr.dtype.element_ty),
             mask=(cols < M)[None, :] & n_mask[:, None])


def gemv_block_n(n: int, num_sms: int = MEASURED_SMS) -> int:
    """Rows per program: as many as still leave about four programs per SM."""
    for block_n in (16, 8):
        if triton.cdiv(n, block_n) >= 4 * num_sms:
            return block_n
    return 4


def dense_gemv(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
               block_n: int | None = None, block_k: int | None = None, num_warps: int = 4,
               stages: int | None = None) -> torch.Tensor:
    """x [M, K] (M <= 4), weight [N, K] contiguous along K, bias [N] or None -> [M, N] in x.dtype,
    accumulated in float32. block_n / block_k / num_warps / stages: tile override for benchmarks."""
    m, k = x.shape
    n = weight.shape[0]
    if weight.shape[1] != k or weight.stride(1) != 1 or m > 4:
        raise ValueError(f"dense_gemv takes x [M <= 4, K] and a K-contiguous weight [N, K]; got x {tuple(x.shape)}, "
                         f"weight {tuple(weight.shape)} with strides {weight.stride()}")
    x = x if x.stride(-1) == 1 else x.contiguous()
    on_gpu = compiled_on_gpu(x.device)
    block_n = block_n or (gemv_block_n(n, sm_count(x.device)) if on_gpu else 4)
    block_k = block_k or (256 if on_gpu else 32)
    out = torch.empty((m, n), dtype=x.dtype, device=x.device)
    row_gemv_kernel[(triton.cdiv(n, block_n),)](
        x, x.stride(0), weight, weight.stride(0), x, 0, 0, bias if bias is not None else x, out, out.stride(0),
        m, n, k, FORMAT=FMT_DENSE, SBN=1, SBK=1, HAS_BIAS=bias is not None, M_PAD=triton.next_power_of_2(m),
        BLOCK_N=block_n, BLOCK_K=block_k, STAGES=(stages or DENSE_GEMV_STAGES) if on_gpu else 1, num_warps=num_warps)
    return out


def dense_gemv_ref(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
                   block_n: int | None = None, block_k: int | None = None, num_warps: int = 4,
                   stages: int | None = None) -> torch.Tensor:
    y = x.to(torch.float32) @ weight.to(torch.float32).T
    if bias is not None:
        y = y + bias.to(torch.float32)
    return y.to(x.dtype)
