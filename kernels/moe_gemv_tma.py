"""The packed-f16 MXFP4 row kernels (moe_gemv_half2.py) with their weight words and E8M0 scales
brought in by the TMA engine (MoeConfig.tma).

In the pointer-load kernels every thread issues its own copies of the weight words, and the
one-byte scales stay synchronous loads (each program's rows' scales are 8 bytes 90 bytes apart,
below the 4 bytes an asynchronous copy takes), so every K step waits on them. Here each K step
is two bulk tensor copies per matrix, a [BLOCK_N, BLOCK_K / 8] box of words and a
[BLOCK_N, BLOCK_K / 32] box of scales, issued by one thread into the compiler's shared-memory
ring; the scales are copied ahead like the words. The tensor-copy engine needs row strides that
are multiples of 16 bytes, so the scale rows of the MXFP4 stacks are stored padded to that
(engine/weights/formats.py, `aligned_scale_rows`), and a scale box at least 16 bytes wide, so
BLOCK_K is a multiple of 512. Boxes past the end of a row read zeros (zero codes add nothing),
so K needs no mask. TAIL_K 0: the last step runs past K on zeros (gpt-oss's 2880 = 5 * 512 + 320
decodes 3072 codes a row); else K past the last whole step goes in steps of TAIL_K with the pointer
loads, as in moe_gemv_half2.py.

The decode, the packed FMAs and the activation order are moe_gemv_half2.py's; under
TRITON_INTERPRET the descriptors are read by the interpreter and the group sums computed in
float32 (INTERPRET=True).
"""
from __future__ import annotations

import triton
import triton.language as tl

from .moe_gemv_half2 import _chunk, _group_dot, _x_pairs, store_down_rows, store_swiglu_rows


@triton.jit
def _tma_steps_end(K, BLOCK_K: tl.constexpr, TAIL_K: tl.constexpr):
    """Where the descriptor-read steps stop: K (the last step partly past it) or, with a tail,
    the end of the last whole step."""
    if TAIL_K > 0:
        return K - K % BLOCK_K
    else:
        return K


@triton.jit
def _tma_chunk(acc, w_desc, s_desc, e, n0, k0, x0, x1, x2, x3, INTERPRET: tl.constexpr, BLOCK_N: tl.constexpr,
               BLOCK_K: tl.constexpr):
    """acc [BN, G] + the group sums of BLOCK_N rows from n0 over one K step, times 2^(s - 127 + 6)."""
    G: tl.constexpr = BLOCK_K // 32
    e = e.to(tl.int32)  # descriptor coordinates are 32-bit; expert ids may come as int64
    w = tl.reshape(w_desc.load([e, n0, k0 // 8]), (BLOCK_N, G, 4))
    scale = tl.reshape(s_desc.load([e, n0, k0 // 32]), (BLOCK_N, G))
    mult = ((scale.to(tl.int32) + 6) << 23).to(tl.float32, bitcast=True)
    return acc + _group_dot(w, x0, x1, x2, x3, INTERPRET) * mult


@triton.jit
def moe_gate_up_tma_kernel(
        xq_ptr, x_inv_scale_ptr,
        wg_desc, wu_desc, sg_desc, su_desc,
        wg_ptr, wu_ptr, stride_we, stride_wn,
        sg_ptr, su_ptr, stride_se, stride_sn, stride_sk,
        bg_ptr, bu_ptr, stride_be, stride_bn,
        out_ptr, act_scale, expert_ptr, N, K, top_k, alpha, limit,
        HAS_BIAS: tl.constexpr, INTERPRET: tl.constexpr,
        BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, STAGES: tl.constexpr, TAIL_K: tl.constexpr = 64,
        WIDE_X: tl.constexpr = False):
    """moe_gate_up_half2_kernel with the whole K steps' words and scales read through the tensor
    descriptors wg_desc / wu_desc (int32 codes [E, N, K / 8], box [1, BLOCK_N, BLOCK_K / 8]) and
    sg_desc / su_desc (uint8 scales [E, N, K / 32], box [1, BLOCK_N, BLOCK_K / 32]); the tail steps
    read through the pointers, which are the same tensors. Output as moe_gate_up_half2_kernel's."""
    pair = tl.program_id(0)
    e = tl.load(expert_ptr + pair)
    if e < 0:
        return
    tok = (pair // top_k).to(tl.int64)
    n0 = tl.program_id(1) * BLOCK_N
    n = n0 + tl.arange(0, BLOCK_N)
    n_mask = n < N
    BLOCK_G: tl.constexpr = BLOCK_K // 32
    acc_g = tl.zeros((BLOCK_N, BLOCK_G), dtype=tl.float32)
    acc_u = tl.zeros((BLOCK_N, BLOCK_G), dtype=tl.float32)
    xq_row = xq_ptr + tok * (K // 2)
    k_whole = _tma_steps_end(K, BLOCK_K, TAIL_K)
    for k0 in tl.range(0, k_whole, BLOCK_K, num_stages=STAGES):
        x0, x1, x2, x3 = _x_pairs(xq_row, k0, K, BLOCK_K, WIDE_X)
        acc_g = _tma_chunk(acc_g, wg_desc, sg_desc, e, n0, k0, x0, x1, x2, x3, INTERPRET, BLOCK_N, BLOCK_K)
        acc_u = _tma_chunk(acc_u, wu_desc, su_desc, e, n0, k0, x0, x1, x2, x3, INTERPRET, BLOCK_N, BLOCK_K)
    g = tl.sum(acc_g, axis=1)
    u = tl.sum(acc_u, axis=1)
    if TAIL_K > 0:
        tail_g = tl.zeros((BLOCK_N, TAIL_K // 32), dtype=tl.float32)
        tail_u = tl.zeros((BLOCK_N, TAIL_K // 32), dtype=tl.float32)
        for k0 in range(k_whole, K, TAIL_K):
            x0, x1, x2, x3 = _x_pairs(xq_row, k0, K, TAIL_K, WIDE_X)
            tail_g = _chunk(tail_g, wg_ptr, sg_ptr, e, n, n_mask, k0, K, x0, x1, x2, x3, stride_we, stride_wn,
                            stride_se, stride_sn, stride_sk, INTERPRET, TAIL_K)
            tail_u = _chunk(tail_u, wu_ptr, su_ptr, e, n, n_mask, k0, K, x0, x1, x2, x3, stride_we, stride_wn,
                            stride_se, stride_sn, stride_sk, INTERPRET, TAIL_K)
        g += tl.sum(tail_g, axis=1)
        u += tl.sum(tail_u, axis=1)
    inv = tl.load(x_inv_scale_ptr + tok)
    g = g * inv
    u = u * inv
    store_swiglu_rows(g, u, e, n, n_mask, pair, N, bg_ptr, bu_ptr, stride_be, stride_bn, out_ptr, act_scale, alpha,
                      limit, HAS_BIAS)


@triton.jit
def moe_down_tma_kernel(
        aq_ptr, a_inv_scale,
        w_desc, s_desc,
        w_ptr, stride_we, stride_wn,
        s_ptr, stride_se, stride_sn, stride_sk,
        b_ptr, stride_be,
        pair_weights_ptr, y_ptr, stride_yt, expert_ptr, N, K,
        HAS_BIAS: tl.constexpr, INTERPRET: tl.constexpr,
        BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, STAGES: tl.constexpr, TAIL_K: tl.constexpr = 64):
    """moe_down_half2_kernel with the whole K steps read through w_desc / s_desc (as in
    moe_gate_up_tma_kernel)."""
    pair = tl.program_id(0)
    e = tl.load(expert_ptr + pair)
    if e < 0:
        return
    n0 = tl.program_id(1) * BLOCK_N
    n = n0 + tl.arange(0, BLOCK_N)
    n_mask = n < N
    BLOCK_G: tl.constexpr = BLOCK_K // 32
    acc = tl.zeros((BLOCK_N, BLOCK_G), dtype=tl.float32)
    aq_row = aq_ptr + pair.to(tl.int64) * (K // 2)
    k_whole = _tma_steps_end(K, BLOCK_K, TAIL_K)
    for k0 in tl.range(0, k_whole, BLOCK_K, num_stages=STAGES):
        x0, x1, x2, x3 = _x_pairs(aq_row, k0, K, BLOCK_K)
        acc = _tma_chunk(acc, w_desc, s_desc, e, n0, k0, x0, x1, x2, x3, INTERPRET, BLOCK_N, BLOCK_K)
    y = tl.sum(acc, axis=1)
    if TAIL_K > 0:
        tail = tl.zeros((BLOCK_N, TAIL_K // 32), dtype=tl.float32)
        for k0 in range(k_whole, K, TAIL_K):
            x0, x1, x2, x3 = _x_pairs(aq_row, k0, K, TAIL_K)
            tail = _chunk(tail, w_ptr, s_ptr, e, n, n_mask, k0, K, x0, x1, x2, x3, stride_we, stride_wn, stride_se,
                          stride_sn, stride_sk, INTERPRET, TAIL_K)
        y += tl.sum(tail, axis=1)
    y = y * a_inv_scale
    store_down_rows(y, e, n, n_mask, pair, b_ptr, stride_be, pair_weights_ptr, y_ptr, stride_yt, HAS_BIAS)
