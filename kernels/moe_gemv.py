"""Decode-size MoE GEMVs: each program streams BLOCK_N weight rows of one expert.

At a handful of (token, expert) pairs per expert the tensor-core tile of moe_gemm.py is mostly
padding and the MXFP4 dot goes through an upcast, so these kernels read wide contiguous row
slabs, decode them in registers and reduce against each pair's activation row with FMAs. MXFP4
scales are applied once per 32-element group after the partial sum, not per element. Weight
formats and activations are those of moe_gemm.py. This file holds the code-by-code kernels and
the pieces every row kernel shares (pair lookup, GLU epilogue); moe_gemv_words.py decodes MXFP4
a word at a time. The K loops are software-pipelined to STAGES (asynchronous copies of the next
chunks into shared memory while the current one is reduced).
"""
from __future__ import annotations

import triton
import triton.language as tl

from .moe_gemm import _row_scale, glu_tile, token_rows_sum
from .row_gemv import slab_dot, weight_slab


@triton.jit
def _e2m1_f32(codes):
    """E2M1 codes (int32 0..15) -> value * 2^-14 in float32 (fp16 bit placement, see above)."""
    bits = ((codes & 7) << 9) | ((codes & 8) << 12)
    return bits.to(tl.int16).to(tl.float16, bitcast=True).to(tl.float32)


@triton.jit
def _gemv_chunk(acc, w_ptr, s_ptr, e, n, n_mask, k0, K, x_ptr, pair_ptr, pid_m, num_pairs, top_k,
                stride_xt, stride_we, stride_wn, stride_se, stride_sn, stride_sk,
                FORMAT: tl.constexpr, SBN: tl.constexpr, SBK: tl.constexpr, SORTED: tl.constexpr,
                X_BY_TOKEN: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr):
    """acc [BLOCK_N, BLOCK_M] += W[e, n, k0:k0+BLOCK_K] . x_m[k0:k0+BLOCK_K] for the block's pairs."""
    w_base = w_ptr + e.to(tl.int64) * stride_we + n.to(tl.int64) * stride_wn
    cols = tl.arange(0, BLOCK_M)
    if FORMAT == 3:
        BLOCK_G: tl.constexpr = BLOCK_K // 32
        g = k0 // 32 + tl.arange(0, BLOCK_G)
        g_mask = g < K // 32
        byte = g[:, None] * 16 + tl.arange(0, 16)[None, :]  # [G, 16] offsets inside a weight row
        m3 = n_mask[:, None, None] & g_mask[None, :, None]
        packed = tl.load(w_base[:, None, None] + byte[None, :, :], mask=m3, other=0).to(tl.int32)
        lo = _e2m1_f32(packed & 15)
        hi = _e2m1_f32(packed >> 4)
        s_base = s_ptr + e.to(tl.int64) * stride_se + n * stride_sn
        scale = tl.load(s_base[:, None] + g[None, :] * stride_sk, mask=n_mask[:, None] & g_mask[None, :], other=0)
        # 2^(s - 127) * 2^14 built from its exponent field (valid for scales <= 240)
        mult = ((scale.to(tl.int32) + 14) << 23).to(tl.float32, bitcast=True)
        for m in tl.static_range(BLOCK_M):
            if SORTED:
                pair = tl.load(pair_ptr + pid_m * BLOCK_M + m)
            else:
                pair = pid_m
            ok = pair < num_pairs
            if X_BY_TOKEN:
                row = (pair // top_k).to(tl.int64)
            else:
                row = pair.to(tl.int64)
            x_row = x_ptr + tl.where(ok, row, 0) * stride_xt + 2 * byte
            # The row check is broadcast as a tensor: Triton 3.9's interpreter rejects a mask
            # made of a tensor and a scalar condition.
            xm = g_mask[:, None] & ((byte * 0 + pair) < num_pairs)
            x_even = tl.load(x_row, mask=xm, other=0.0).to(tl.float32)
            x_odd = tl.load(x_row + 1, mask=xm, other=0.0).to(tl.float32)
            part = tl.sum(lo * x_even[None, :, :] + hi * x_odd[None, :, :], axis=2)
            part = tl.sum(part * mult, axis=1)
            acc = tl.where(cols[None, :] == m, acc + part[:, None], acc)
    else:
        # dense or FP8: one slab, its block scales applied per scale block (row_gemv.weight_slab)
        kk, k_mask, w, s = weight_slab(w_base, s_ptr + e.to(tl.int64) * stride_se, n, n_mask, k0, K, stride_sn,
                                       stride_sk, FORMAT, SBN, SBK, BLOCK_K)
        for m in tl.static_range(BLOCK_M):
            if SORTED:
                pair = tl.load(pair_ptr + pid_m * BLOCK_M + m)
            else:
                pair = pid_m
            ok = pair < num_pairs
            if X_BY_TOKEN:
                row = (pair // top_k).to(tl.int64)
            else:
                row = pair.to(tl.int64)
            xv = tl.load(x_ptr + tl.where(ok, row, 0) * stride_xt + kk, mask=k_mask & ((kk * 0 + pair) < num_pairs),
                         other=0.0)
            acc = tl.where(cols[None, :] == m, acc + slab_dot(w, s, xv, FORMAT, SBK, BLOCK_K)[:, None], acc)
    return acc


@triton.jit
def _block_pairs(pair_ptr, expert_ptr, pid_m, num_pairs, SORTED: tl.constexpr, BLOCK_M: tl.constexpr):
    """-> (expert, pairs [BLOCK_M], valid [BLOCK_M]). Unsorted: pair pid_m, expert topk_ids[pid_m]."""
    e = tl.load(expert_ptr + pid_m)
    if SORTED:
        pairs = tl.load(pair_ptr + pid_m * BLOCK_M + tl.arange(0, BLOCK_M))
    else:
        pairs = pid_m + tl.arange(0, BLOCK_M)
    return e, pairs, pairs < num_pairs


@triton.jit
def moe_gate_up_gemv_kernel(
        x_ptr, stride_xt,
        wg_ptr, wu_ptr, stride_we, stride_wn,
        sg_ptr, su_ptr, stride_se, stride_sn, stride_sk,
        bg_ptr, bu_ptr, stride_be, stride_bn,
        out_ptr, stride_ot,
        pair_ptr, expert_ptr, num_pairs, N, K, top_k, alpha, limit,
        FORMAT: tl.constexpr, SBN: tl.constexpr, SBK: tl.constexpr, SORTED: tl.constexpr,
        ACT: tl.constexpr, HAS_BIAS: tl.constexpr,
        BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, STAGES: tl.constexpr):
    """moe_gate_up_kernel's result by row streaming. SORTED: pairs from moe_align blocks of
    BLOCK_M; else BLOCK_M must be 1, program m is pair m and expert_ptr is topk_ids flattened."""
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    e, pairs, valid = _block_pairs(pair_ptr, expert_ptr, pid_m, num_pairs, SORTED, BLOCK_M)
    if e < 0:
        return
    n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    n_mask = n < N
    acc_g = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
    acc_u = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
    for k0 in tl.range(0, K, BLOCK_K, num_stages=STAGES):
        acc_g = _gemv_chunk(acc_g, wg_ptr, sg_ptr, e, n, n_mask, k0, K, x_ptr, pair_ptr, pid_m, num_pairs, top_k,
                            stride_xt, stride_we, stride_wn, stride_se, stride_sn, stride_sk,
                            FORMAT, SBN, SBK, SORTED, True, BLOCK_M, BLOCK_K)
        acc_u = _gemv_chunk(acc_u, wu_ptr, su_ptr, e, n, n_mask, k0, K, x_ptr, pair_ptr, pid_m, num_pairs, top_k,
                            stride_xt, stride_we, stride_wn, stride_se, stride_sn, stride_sk,
                            FORMAT, SBN, SBK, SORTED, True, BLOCK_M, BLOCK_K)
    acc_g = _row_scale(acc_g, sg_ptr, e, n, n_mask, stride_se, stride_sn, FORMAT)
    acc_u = _row_scale(acc_u, su_ptr, e, n, n_mask, stride_se, stride_sn, FORMAT)
    _glu_store(acc_g, acc_u, bg_ptr, bu_ptr, stride_be, stride_bn, out_ptr, stride_ot, e, n, n_mask, pairs, valid,
               alpha, limit, ACT, HAS_BIAS)


@triton.jit
def _glu_store(acc_g, acc_u, bg_ptr, bu_ptr, stride_be, stride_bn, out_ptr, stride_ot, e, n, n_mask, pairs, valid,
               alpha, limit, ACT: tl.constexpr, HAS_BIAS: tl.constexpr):
    """Biases, the GLU activation and the store of a [BLOCK_N, BLOCK_M] gate/up tile."""
    h = glu_tile(acc_g, acc_u, bg_ptr, bu_ptr, stride_be, stride_bn, e, n, n_mask, alpha, limit, ACT, HAS_BIAS)
    out_ptrs = out_ptr + pairs[None, :].to(tl.int64) * stride_ot + n[:, None]
    tl.store(out_ptrs, h.to(out_ptr.dtype.element_ty), mask=valid[None, :] & n_mask[:, None])


@triton.jit
def moe_down_gemv_kernel(
        a_ptr, stride_at,
        w_ptr, stride_we, stride_wn,
        s_ptr, stride_se, stride_sn, stride_sk,
        b_ptr, stride_be,
        pair_weights_ptr, out_ptr, stride_ot,
        pair_ptr, expert_ptr, num_pairs, N, K,
        arrivals_ptr, sum_ptr, stride_sum,
        FORMAT: tl.constexpr, SBN: tl.constexpr, SBK: tl.constexpr, SORTED: tl.constexpr,
        HAS_BIAS: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
        STAGES: tl.constexpr, COMBINE: tl.constexpr = False, TOP_K: tl.constexpr = 1):
    """moe_down_kernel's result by row streaming (pairs as in moe_gate_up_gemv_kernel): out
    [pairs, N] float32. COMBINE (one pair per program, unsorted): the last of each token's TOP_K
    programs per row block also writes the token's sum of its rows to sum [T, N]
    (_combine_if_last), which saves the combine launch."""
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    e, pairs, valid = _block_pairs(pair_ptr, expert_ptr, pid_m, num_pairs, SORTED, BLOCK_M)
    n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    n_mask = n < N
    if e >= 0:
        _down_rows(a_ptr, stride_at, w_ptr, stride_we, stride_wn, s_ptr, stride_se, stride_sn, stride_sk, b_ptr,
                   stride_be, pair_weights_ptr, out_ptr, stride_ot, pair_ptr, pid_m, e, pairs, valid, n, n_mask,
                   num_pairs, K, FORMAT, SBN, SBK, SORTED, HAS_BIAS, BLOCK_M, BLOCK_N, BLOCK_K, STAGES)
    if COMBINE:  # a pair of expert -1 still counts its arrival
        _combine_if_last(out_ptr, stride_ot, expert_ptr, arrivals_ptr, sum_ptr, stride_sum, pid_m, n, n_mask, TOP_K)


@triton.jit
def _down_rows(a_ptr, stride_at, w_ptr, stride_we, stride_wn, s_ptr, stride_se, stride_sn, stride_sk, b_ptr, stride_be,
               pair_weights_ptr, out_ptr, stride_ot, pair_ptr, pid_m, e, pairs, valid, n, n_mask, num_pairs, K,
               FORMAT: tl.constexpr, SBN: tl.constexpr, SBK: tl.constexpr, SORTED: tl.constexpr,
               HAS_BIAS: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
               STAGES: tl.constexpr):
    """out[pairs, n] = pair weight * (down rows n of expert e (>= 0) . act + bias), float32."""
    rows = tl.where(valid, pairs, 0).to(tl.int64)
    acc = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
    for k0 in tl.range(0, K, BLOCK_K, num_stages=STAGES):
        acc = _gemv_chunk(acc, w_ptr, s_ptr, e, n, n_mask, k0, K, a_ptr, pair_ptr, pid_m, num_pairs, 1,
                          stride_at, stride_we, stride_wn, stride_se, stride_sn, stride_sk,
                          FORMAT, SBN, SBK, SORTED, False, BLOCK_M, BLOCK_K)
    acc = _row_scale(acc, s_ptr, e, n, n_mask, stride_se, stride_sn, FORMAT)
    if HAS_BIAS:
        acc += tl.load(b_ptr + e.to(tl.int64) * stride_be + n, mask=n_mask, other=0.0).to(tl.float32)[:, None]
    gate = tl.load(pair_weights_ptr + rows, mask=valid, other=0.0)
    acc = acc * gate[None, :]
    tl.store(out_ptr + rows[None, :] * stride_ot + n[:, None], acc, mask=valid[None, :] & n_mask[:, None])


@triton.jit
def _combine_if_last(y_ptr, stride_yt, expert_ptr, arrivals_ptr, out_ptr, stride_out, pair, n, n_mask,
                     TOP_K: tl.constexpr):
    """The TOP_K pair programs of one token and row block count their arrival; the last one adds
    the token's TOP_K rows of y (float32 [pairs, N]) in pair order (token_rows_sum), whoever
    arrives last, casts the sum into out [T, N] and resets the count for the next call."""
    tok = pair // TOP_K
    slot = arrivals_ptr + tok * tl.num_programs(1) + tl.program_id(1)
    tl.debug_barrier()  # every thread's stores of this program's rows come before its arrival
    arrived = tl.atomic_add(slot, 1, sem="acq_rel", scope="gpu")
    if arrived == TOP_K - 1:
        # written by other programs of this launch: read from L2
        acc = token_rows_sum(y_ptr, stride_yt, expert_ptr, tok, n, n_mask, TOP_K, ".cg")
        tl.store(out_ptr + tok.to(tl.int64) * stride_out + n, acc.to(out_ptr.dtype.element_ty), mask=n_mask)
        tl.store(slot, 0)
