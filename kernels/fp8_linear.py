"""FP8 (e4m3) dense linear y = x @ W^T (+ b) with channel, tensor or block weight scales.

Decode sizes (M <= 2): a row-streaming Triton kernel reads W once in wide slabs and reduces
each token against it with FMAs, split over N so 1 token fills the GPU. Medium M: the weight-only
tile kernel of the MoE GEMMs with one "expert", its K split over up to 4 programs when the outputs
alone give too few (tile_k_splits; the float32 partials added by one more launch). From 33
tokens on CUDA: torch._scaled_mm on FP8 tensor cores. Channel/tensor scales: the activations
quantised per token on the fly (dynamic scales, as compressed-tensors FP8_DYNAMIC checkpoints
expect, models.md B). 128x128 block scales: cuBLAS's
blockwise recipe (CUDA 12.9+, Hopper; reached through torch._scaled_mm since pytorch/pytorch
PR 158037), the activations quantised per token and 128-column group by _quant_groups_kernel
(the 1x128 activation / 128x128 weight scaling of DeepSeek-style FP8 checkpoints; GLM-4.5V-FP8
itself has channel scales): on an H200 at 2048 tokens, N=12288, K=4096, 171.5 us (1202 TFLOP/s)
against 633.9 us for the tile (BENCHMARKS.md). Where that recipe is missing or the shape does
not fit it (K / 128 not a multiple of 4: cuBLAS then computed wrong sums in
bench/scaled_mm_probe.py), block scales stay on the tile.
"""
from __future__ import annotations

import functools
import math

import torch
import triton
import triton.language as tl

from ..engine.weights.formats import FP8_MAX, Fp8Weight, fp8_rows
from .gpu_facts import MEASURED_SMS, compiled_on_gpu, cuda_index, sm_count
from .moe_gemm import FMT_FP8_BLK, FMT_FP8_ROW, _row_scale, _weight_dot
from .row_gemv import GEMV_MAX_M, row_gemv_kernel

E4M3_MAX = tl.constexpr(FP8_MAX)
# From this many tokens the FP8 tensor-core GEMMs (torch._scaled_mm) beat the Triton tile. H200,
# 48 tokens (bench/bench_fp8_linear.py): channel scales 12288x4096 29.8 -> 26.2 us, 4096x12288
# 53.2 -> 38.0, 2816x4096 18.7 -> 15.6 (4096x1408: 8.4 -> 9.3); block scales 36.3 -> 20.3, 67.0
# -> 39.1, 22.4 -> 16.3. At 32 tokens and below the tile wins or ties (cuBLAS's small-M tiles
# read the weight at ~40% of copy).
SCALED_MM_MIN_M = 33
# Software-pipeline depth of the row GEMV over K. H200, 128x128 block scales, 1 token, weights out
# of L2 (bench/bench_row_gemv.py): 4 stages against none, GLM-4.5V q/k/v 28.1 -> 24.7 us, o_proj
# 56.5 -> 49.1 us, shared expert gate/up 19.5 -> 15.6 us.
FP8_GEMV_STAGES = 4


@triton.jit
def _e4m3_round(v):
    """float32 (|v| <= 448) -> the nearest e4m3 value (ties to even) in float32, by one add and one
    subtract of 1.5 * 2^(23 + the quantum's exponent): the conversion after it is exact, which
    Triton's interpreter needs (its own rounding drops the carry into the exponent)."""
    e = ((v.to(tl.int32, bitcast=True) >> 23) & 255) - 127
    c = (((tl.maximum(e, -6) + 147) << 23) | 0x400000).to(tl.float32, bitcast=True)
    return (v + c) - c


@triton.jit
def _scaled_e4m3(x, scale):
    """x / scale (float32), saturated to e4m3's range and rounded -> e4m3."""
    return _e4m3_round(tl.minimum(tl.maximum(x / scale, -E4M3_MAX), E4M3_MAX)).to(tl.float8e4nv)


@triton.jit
def store_e4m3_row(x, k, mask, q_row_ptr, scale_ptr):
    """One row x (float32, 0 where masked off) in quant_rows' encoding: s = amax(|x|) / 448 at
    scale_ptr, e4m3(x / s) at q_row_ptr + k. Shared with the norm that writes the rows it normed
    this way (kernels/rmsnorm.py), so the two agree to the bit."""
    scale = tl.maximum(tl.max(tl.abs(x), axis=0), 1e-12) / E4M3_MAX
    tl.store(q_row_ptr + k, _scaled_e4m3(x, scale), mask=mask)
    tl.store(scale_ptr, scale)


@triton.jit
def _quant_groups_kernel(x_ptr, stride_xm, q_ptr, s_ptr, M, K, M_PAD, BLOCK_G: tl.constexpr):
    """Program (row m, BLOCK_G groups of 128 columns): s = amax(|x[m, group]|) / 448, q[m, k] =
    e4m3(x[m, k] / s); s stored transposed, s_ptr [K / 128, M_PAD]. Rows M..M_PAD-1 (padding)
    get zeros."""
    m = tl.program_id(0)
    g = tl.program_id(1) * BLOCK_G + tl.arange(0, BLOCK_G)
    k = g[:, None] * 128 + tl.arange(0, 128)[None, :]
    mask = (g < K // 128)[:, None]
    real = k < (tl.where(m < M, K, 0))  # padding rows read nothing
    x = tl.load(x_ptr + m.to(tl.int64) * stride_xm + k, mask=mask & real, other=0.0).to(tl.float32)
    scale = tl.maximum(tl.max(tl.abs(x), axis=1), 1e-12) / E4M3_MAX
    tl.store(q_ptr + m.to(tl.int64) * K + k, _scaled_e4m3(x, scale[:, None]), mask=mask)
    tl.store(s_ptr + g * M_PAD + m, scale, mask=g < K // 128)


@triton.jit
def _quant_rows_kernel(x_ptr, stride_xm, q_ptr, s_ptr, K, BLOCK_K: tl.constexpr):
    """Program m: s[m] = amax(|x[m]|) / 448, q[m, k] = e4m3(x[m, k] / s[m])."""
    m = tl.program_id(0)
    k = tl.arange(0, BLOCK_K)
    x = tl.load(x_ptr + m.to(tl.int64) * stride_xm + k, mask=k < K, other=0.0).to(tl.float32)
    store_e4m3_row(x, k, k < K, q_ptr + m.to(tl.int64) * K, s_ptr + m)


def quant_rows(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x [M, K] -> (q [M, K] e4m3, scales [M, 1] float32): x ~ q * scale per token, in one pass
    (the torch ops of quant_rows_ref take ~6 passes over a float32 copy)."""
    m, k = x.shape
    q = torch.empty((m, k), dtype=torch.float8_e4m3fn, device=x.device)
    scales = torch.empty((m, 1), dtype=torch.float32, device=x.device)
    block_k = triton.next_power_of_2(k)
    _quant_rows_kernel[(m,)](x, x.stride(0), q, scales, k, BLOCK_K=block_k, num_warps=8 if block_k >= 8192 else 4)
    return q, scales


def quant_rows_ref(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """quant_rows in torch: the per-row FP8 encoding the loader gives weights (formats.fp8_rows)."""
    q = fp8_rows(x)
    return q.weight, q.scale


def quant_groups(x: torch.Tensor, rows: int) -> tuple[torch.Tensor, torch.Tensor]:
    """x [M, K] (K a multiple of 128) -> (q [rows, K] e4m3, scales [K / 128, rows] float32): x ~ q
    * scale per token and 128-column group; rows >= M, the padding cuBLAS wants, are zeros."""
    m, k = x.shape
    q = torch.empty((rows, k), dtype=torch.float8_e4m3fn, device=x.device)
    scales = torch.empty((k // 128, rows), dtype=torch.float32, device=x.device)
    block_g = min(8, triton.next_power_of_2(k // 128))
    _quant_groups_kernel[(rows, triton.cdiv(k // 128, block_g))](x, x.stride(0), q, scales, m, k, rows,
                                                                 BLOCK_G=block_g)
    return q, scales


def quant_groups_ref(x: torch.Tensor, rows: int) -> tuple[torch.Tensor, torch.Tensor]:
    """quant_groups in torch."""
    m, k = x.shape
    xf = torch.zeros((rows, k), dtype=torch.float32, device=x.device)
    xf[:m] = x.to(torch.float32)
    groups = xf.view(rows, k // 128, 128)
    scale = groups.abs().amax(-1).clamp_min(1e-12) / FP8_MAX
    q = (groups / scale[..., None]).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn).view(rows, k)
    return q, scale.t().contiguous()


@triton.jit
def _fp8_linear_kernel(x_ptr, stride_xm, w_ptr, stride_wn, s_ptr, stride_sn, stride_sk, b_ptr, out_ptr, stride_om,
                       M, N, K, K_SPLIT, FORMAT: tl.constexpr, SBN: tl.constexpr, SBK: tl.constexpr,
                       HAS_BIAS: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                       SPLIT_K: tl.constexpr):
    """Grid (M blocks, N blocks, SPLIT_K). SPLIT_K > 1: program z reduces K columns [z * K_SPLIT,
    (z + 1) * K_SPLIT) (K_SPLIT a multiple of BLOCK_K) and stores its float32 partial, channel
    scales applied, at out [z, M, N] for _sum_splits_kernel; else the finished rows in out."""
    m = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    split = tl.program_id(2)
    m_valid = m < M
    rows = tl.where(m_valid, m, 0).to(tl.int64)
    n_mask = n < N
    zero = tl.program_id(0) * 0  # the "expert" index of the shared tile code
    acc = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
    k_lo = split * K_SPLIT
    for k0 in range(k_lo, tl.minimum(k_lo + K_SPLIT, K), BLOCK_K):
        acc = _weight_dot(acc, w_ptr, s_ptr, zero, n, n_mask, k0, K, x_ptr, rows, m_valid, stride_xm,
                          0, stride_wn, 0, stride_sn, stride_sk, FORMAT, False, SBN, SBK, BLOCK_K, "bf16", False)
    acc = _row_scale(acc, s_ptr, zero, n, n_mask, 0, stride_sn, FORMAT)
    mask = m_valid[None, :] & n_mask[:, None]
    if SPLIT_K > 1:
        tl.store(out_ptr + (split * M + rows[None, :]) * N + n[:, None], acc, mask=mask)
    else:
        if HAS_BIAS:
            acc += tl.load(b_ptr + n, mask=n_mask, other=0.0).to(tl.float32)[:, None]
        tl.store(out_ptr + rows[None, :] * stride_om + n[:, None], acc.to(out_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _sum_splits_kernel(part_ptr, b_ptr, out_ptr, stride_om, M, N, SPLIT_K: tl.constexpr, HAS_BIAS: tl.constexpr,
                       BLOCK: tl.constexpr):
    """out [M, N] = the SPLIT_K float32 partials [SPLIT_K, M, N] added in split order (+ bias)."""
    i = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = i < M * N
    acc = tl.zeros((BLOCK,), dtype=tl.float32)
    for z in tl.static_range(SPLIT_K):
        acc += tl.load(part_ptr + z * M * N + i, mask=mask, other=0.0)
    n = i % N
    if HAS_BIAS:
        acc += tl.load(b_ptr + n, mask=mask, other=0.0).to(tl.float32)
    tl.store(out_ptr + (i // N) * stride_om + n, acc.to(out_ptr.dtype.element_ty), mask=mask)


def _gemv_block_k(fmt: int, sbk: int) -> int:
    """K step of the row GEMV: 512 columns, as whole scale blocks when those are a power of two
    that divides 512 (each block scaled after its partial sum), else the largest divisor of the
    scale block up to 512. H200, 128x128 blocks, 1 token: 512 against one 128 block a step,
    GLM-4.5V o_proj 49.0 -> 24.8 us, q/k/v 26.6 -> 22.5 us (bench/bench_row_gemv.py)."""
    if fmt == FMT_FP8_ROW or (sbk & (sbk - 1) == 0 and 512 % sbk == 0):
        return 512
    return math.gcd(sbk, 512)


def tile_k_splits(programs: int, k_steps: int, num_sms: int = MEASURED_SMS) -> int:
    """K splits of the tile kernel: a grid under two programs per SM walks long K loops with the
    GPU half idle, so K is shared by up to 4 programs (about 3 per SM), when each keeps at least
    4 K steps. H200, 4-32 tokens, channel scales (bench/bench_fp8_linear.py --tiles, split 1/2/3/4/8):
    GLM-4.5V o_proj 4096 x 12288 (128 programs) 28.6 -> 21.5 us at 4 tokens, 39.6 -> 26.3 at 32 with
    4 splits; 2816 x 4096 (88) 10.8 -> 9.1 and 14.5 -> 10.6; block scales o_proj 36.4 -> 23.0 (8
    tokens), 43.6 -> 28.4 (32). Not split: q/k/v 12288 x 4096 (384 programs; 2 splits 1-4% slower)
    and 4096 x 1408 (5.5 K steps; any split 10-15% slower)."""
    if programs >= 2 * num_sms or k_steps < 16:
        return 1
    return max(1, min(4, triton.cdiv(3 * num_sms, programs), k_steps // 4))


def _triton_fp8_linear(x: torch.Tensor, w: Fp8Weight, bias: torch.Tensor | None, on_gpu: bool,
                       block_n: int | None = None, block_k: int | None = None,
                       stages: int | None = None, tile: tuple[int, int, int, int, int] | None = None) -> torch.Tensor:
    """The Triton paths: the row GEMV up to GEMV_MAX_M tokens (block_n, block_k, stages override
    its tile), else the tile kernel (tile: (block_m, block_n, block_k, warps, stages[, K splits])
    overrides its choice; benchmarks)."""
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
        else:
            # H200, 1 token: 16 rows a program from 4096 outputs, 8 below, for both scale layouts,
            # against the bf16 rule's 4 (gemv_block_n). 128x128 blocks: o_proj 24.8 -> 19.3 us,
            # 2816 outputs 7.7 us (16 rows: 8.2). Channel scales (GLM-4.5V-FP8): o_proj 20.8 -> 17.0 us,
            # the shared expert's gate/up 7.3 -> 6.6 and down 5.2 -> 5.0, q/k/v (14336) unchanged at 16
            # (bench/bench_row_gemv.py --scales channel,block)
            block_n = block_n or (16 if n >= 4096 else 8)
        row_gemv_kernel[(triton.cdiv(n, block_n),)](
            x, x.stride(0), w.weight, w.weight.stride(0), s, *s_strides, bias if bias is not None else x, out,
            out.stride(0), m, n, k, FORMAT=fmt, SBN=sbn, SBK=sbk, HAS_BIAS=bias is not None,
            M_PAD=triton.next_power_of_2(m), BLOCK_N=block_n, BLOCK_K=block_k if on_gpu else min(block_k, 32),
            STAGES=(stages or FP8_GEMV_STAGES) if on_gpu else 1, num_warps=4)
        return out
    split_k = 1
    if tile is not None:
        block_m, block_n, block_k, warps, stages, *split = tile
        split_k = split[0] if split else 1
    elif on_gpu:
        block_m = 16 if m <= 16 else (32 if m <= 32 else 64)
        block_n, block_k, warps, stages = (32, 128, 4, 4) if m <= 32 else (64, 128, 4, 3)
        if fmt == FMT_FP8_ROW and m <= 32:
            # K steps of 256, 3 stages: H200, channel scales, 4-32 tokens (bench/bench_fp8_linear.py
            # --tiles), at 4 tokens 4096x12288 31.9 -> 27.6 us, 12288x4096 20.8 -> 19.4, 2816x4096
            # 12.0 -> 10.8, 4096x1408 even; block scales measured no better than steps of 128
            block_k, stages = 256, 3
    else:
        block_m, block_n, block_k, warps, stages = 16, 32, 32, 1, 1
    if fmt == FMT_FP8_BLK and sbk % block_k:
        block_k = sbk
    if tile is None and on_gpu:
        split_k = tile_k_splits(triton.cdiv(m, block_m) * triton.cdiv(n, block_n), triton.cdiv(k, block_k),
                                sm_count(x.device))
    # each split a whole number of K steps, none empty
    k_split = triton.cdiv(triton.cdiv(k, block_k), split_k) * block_k
    split_k = triton.cdiv(k, k_split)
    part = out if split_k == 1 else torch.empty((split_k, m, n), dtype=torch.float32, device=x.device)
    _fp8_linear_kernel[(triton.cdiv(m, block_m), triton.cdiv(n, block_n), split_k)](
        x, x.stride(0), w.weight, w.weight.stride(0), s, *s_strides, bias if bias is not None else x, part,
        out.stride(0), m, n, k, k_split, FORMAT=fmt, SBN=sbn, SBK=sbk, HAS_BIAS=bias is not None,
        BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k, SPLIT_K=split_k, num_warps=warps, num_stages=stages)
    if split_k > 1:
        block = 1024
        _sum_splits_kernel[(triton.cdiv(m * n, block),)](part, bias if bias is not None else x, out, out.stride(0),
                                                         m, n, SPLIT_K=split_k, HAS_BIAS=bias is not None,
                                                         BLOCK=block)
    return out


def _scaled_mm_linear(x: torch.Tensor, w: Fp8Weight, bias: torch.Tensor | None,
                      fused_bias: bool = False, x_e4m3: tuple[torch.Tensor, torch.Tensor] | None = None
                      ) -> torch.Tensor:
    """cuBLAS's FP8 GEMM with per-token x per-channel scales. fused_bias: the bias added in the
    GEMM's epilogue (where scaled_mm_works(..., bias=True)) instead of a pass over the output:
    GLM-4.5V's 2048-token q/k/v 238 -> 174 us on an H100 (bench/scaled_mm_bias_probe.py).
    x_e4m3: quant_rows(x), when the caller has it already."""
    x_fp8, x_scale = x_e4m3 if x_e4m3 is not None else quant_rows(x)
    w_scale = w.scale.to(torch.float32).expand(w.weight.shape[0], 1).reshape(1, -1).contiguous()
    fuse = bias is not None and fused_bias
    # the tensor cores sum the whole K in their own accumulator: 1.0-1.18x at 256-2048 tokens on
    # GLM-4.5V's shapes, error 1.8-3.1e-3 against 1.7e-3 (H100, bench/fast_accum_probe.py)
    out = torch._scaled_mm(x_fp8, w.weight.t(), scale_a=x_scale, scale_b=w_scale, out_dtype=x.dtype,
                           bias=bias.to(x.dtype) if fuse else None, use_fast_accum=True)
    return out if bias is None or fuse else out + bias.to(x.dtype)


def _scaled_mm_block_linear(x: torch.Tensor, w: Fp8Weight, bias: torch.Tensor | None,
                            fused_bias: bool = False) -> torch.Tensor:
    """cuBLAS's blockwise FP8 GEMM: x quantised per token and 128 columns, W's 128x128 scales;
    fused_bias as for _scaled_mm_linear (262 -> 196 us for the same q/k/v)."""
    m = x.shape[0]
    rows = -(-m // 4) * 4  # cuBLAS wants the row count a multiple of 4
    q, x_scales = quant_groups(x, rows)
    w_scales = w.scale.to(torch.float32).contiguous()
    fuse = bias is not None and fused_bias
    out = torch._scaled_mm(q, w.weight.t(), scale_a=x_scales.t(), scale_b=w_scales.t(), out_dtype=x.dtype,
                           bias=bias.to(x.dtype) if fuse else None)[:m]
    return out if bias is None or fuse else out + bias.to(x.dtype)


@functools.lru_cache(maxsize=None)
def scaled_mm_works(device_index: int, block: bool, bias: bool = False) -> bool:
    """Whether torch._scaled_mm computes this recipe right on this GPU, tried once per device on a
    small product against the dequantised one: block, the 1x128 x 128x128 blockwise recipe
    (Hopper, CUDA 12.9+ cuBLAS, a torch that passes it through); else per-token x per-channel
    scales (cuBLAS or torch's own kernel, which not every GPU and torch pair has: Ada and consumer
    Blackwell may refuse it). Where it does not, the Triton tiles run. bias: also with a bias
    added in the epilogue (where not, the bias is added after)."""
    gen = torch.Generator(device=f"cuda:{device_index}").manual_seed(0)
    dev = torch.device("cuda", device_index)
    x = torch.randn(48, 512, device=dev, generator=gen).to(torch.bfloat16)
    wf = torch.randn(256, 512, device=dev, generator=gen)
    if block:
        scale = wf.view(2, 128, 4, 128).abs().amax(dim=(1, 3)) / FP8_MAX
        weight = (wf.view(2, 128, 4, 128) / scale[:, None, :, None]).view(256, 512).to(torch.float8_e4m3fn)
        w = Fp8Weight(weight, scale, (128, 128))
    else:
        scale = wf.abs().amax(dim=1, keepdim=True) / FP8_MAX
        w = Fp8Weight((wf / scale).to(torch.float8_e4m3fn), scale, None)
    b = torch.randn(256, device=dev, generator=gen).to(torch.bfloat16) if bias else None
    try:
        out = (_scaled_mm_block_linear if block else _scaled_mm_linear)(x, w, b, fused_bias=bias).to(torch.float32)
    except (RuntimeError, NotImplementedError, ValueError):
        return False
    ref = x.to(torch.float32) @ w.dequantize(torch.float32).T + (0 if b is None else b.to(torch.float32))
    return bool(((out - ref).norm() / ref.norm()) < 5e-2)


def _bias_in_epilogue(x: torch.Tensor, bias: torch.Tensor | None, block: bool) -> bool:
    return bias is not None and scaled_mm_works(cuda_index(x.device), block=block, bias=True)


def _takes_blockwise_scaled_mm(x: torch.Tensor, w: Fp8Weight) -> bool:
    n, k = w.weight.shape
    if not (w.block == (128, 128) and x.shape[0] >= SCALED_MM_MIN_M and x.dtype in (torch.bfloat16, torch.float16)
            and k % 512 == 0 and n % 128 == 0 and w.weight.stride(-1) == 1):
        return False
    return scaled_mm_works(cuda_index(x.device), block=True)


def takes_e4m3_rows(rows: int, dtype: torch.dtype, device: torch.device, w: Fp8Weight) -> bool:
    """Whether fp8_linear runs `rows` rows of `dtype` against w on cuBLAS's per-token x
    per-channel recipe, which quantises them with quant_rows first (so their e4m3 form, given as
    x_e4m3, saves that launch)."""
    n, k = w.weight.shape
    return (compiled_on_gpu(device) and w.block is None and rows >= SCALED_MM_MIN_M and k % 16 == 0 and n % 16 == 0
            and dtype != torch.float32 and scaled_mm_works(cuda_index(device), block=False))


def fp8_linear(x: torch.Tensor, w: Fp8Weight, bias: torch.Tensor | None = None, *, block_n: int | None = None,
               block_k: int | None = None, stages: int | None = None,
               x_e4m3: tuple[torch.Tensor, torch.Tensor] | None = None) -> torch.Tensor:
    """x [..., K] (bf16/fp16/fp32), w [N, K] e4m3 with scales -> [..., N] in x.dtype.
    block_n / block_k / stages: row-GEMV tile override (one or two tokens) for benchmarks.
    x_e4m3: quant_rows of x's rows ([M, K] e4m3, [M, 1] float32), used where takes_e4m3_rows."""
    if w.weight.dim() != 2 or x.shape[-1] != w.weight.shape[1]:
        raise ValueError(f"x [..., {x.shape[-1]}] does not match the FP8 weight {tuple(w.weight.shape)}")
    lead = x.shape[:-1]
    x2 = x.reshape(-1, x.shape[-1])
    x2 = x2 if x2.stride(-1) == 1 else x2.contiguous()
    on_gpu = compiled_on_gpu(x.device)
    n = w.weight.shape[0]
    if takes_e4m3_rows(x2.shape[0], x.dtype, x.device, w):
        out = _scaled_mm_linear(x2, w, bias, _bias_in_epilogue(x2, bias, block=False), x_e4m3)
    elif on_gpu and w.block is not None and _takes_blockwise_scaled_mm(x2, w):
        out = _scaled_mm_block_linear(x2, w, bias, _bias_in_epilogue(x2, bias, block=True))
    else:
        out = _triton_fp8_linear(x2, w, bias, on_gpu, block_n, block_k, stages)
    return out.reshape(*lead, n)


def fp8_linear_ref(x: torch.Tensor, w: Fp8Weight, bias: torch.Tensor | None = None, *, block_n: int | None = None,
                   block_k: int | None = None, stages: int | None = None,
                   x_e4m3: tuple[torch.Tensor, torch.Tensor] | None = None) -> torch.Tensor:
    y = x.to(torch.float32) @ w.dequantize(torch.float32).T
    if bias is not None:
        y = y + bias.to(torch.float32)
    return y.to(x.dtype)
