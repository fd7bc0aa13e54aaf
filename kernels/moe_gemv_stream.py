"""Decode-size MoE GEMVs with the next chunk in flight (MoeConfig.prefetch; dense and FP8).

The per-chunk reduction of the code-by-code row kernels (moe_gemv.py), with the next chunk's
weights requested before the current one is used, and block scales folded into the activations.
"""
from __future__ import annotations

import triton
import triton.language as tl

from .moe_gemm import _row_scale
from .moe_gemv import _block_pairs, _glu_store


@triton.jit
def _stream_x(x_row, k0, K, s_ptr, e, nb, stride_se, stride_sn, stride_sk,
              FORMAT: tl.constexpr, SBK: tl.constexpr, BLOCK_K: tl.constexpr):
    """One K chunk of an activation row in float32; block-scaled FP8 folds the weight scales of
    the program's row block into it (one multiply per activation instead of per weight)."""
    kk = k0 + tl.arange(0, BLOCK_K)
    k_mask = kk < K
    xv = tl.load(x_row + kk, mask=k_mask, other=0.0).to(tl.float32)
    if FORMAT == 2:
        s = tl.load(s_ptr + e.to(tl.int64) * stride_se + nb * stride_sn + (kk // SBK) * stride_sk, mask=k_mask,
                    other=0.0)
        xv = xv * s
    return xv


@triton.jit
def _stream_w(w_ptr, e, n, n_mask, k0, K, stride_we, stride_wn, BLOCK_K: tl.constexpr):
    """One K chunk of BLOCK_N weight rows as stored (a chunk past K loads nothing)."""
    kk = k0 + tl.arange(0, BLOCK_K)
    w_base = w_ptr + e.to(tl.int64) * stride_we + n.to(tl.int64) * stride_wn
    return tl.load(w_base[:, None] + kk[None, :], mask=n_mask[:, None] & (kk < K)[None, :], other=0.0)


@triton.jit
def _carried(w, FORMAT: tl.constexpr):
    """A prefetched chunk as carried across the loop: FP8 as float16 (exact for e4m3; carried as
    loaded, 8-bit values cost a byte permute each per iteration), dense weights as loaded."""
    if FORMAT == 0:
        return w
    else:
        return w.to(tl.float16)


@triton.jit
def _slot_add(acc, part, m: tl.constexpr, BLOCK_M: tl.constexpr):
    """acc[:, m] += part for a [BLOCK_N, BLOCK_M] accumulator."""
    if BLOCK_M == 1:
        return acc + part[:, None]
    else:
        return tl.where(tl.arange(0, BLOCK_M)[None, :] == m, acc + part[:, None], acc)


@triton.jit
def moe_gate_up_stream_kernel(
        x_ptr, stride_xt,
        wg_ptr, wu_ptr, stride_we, stride_wn,
        sg_ptr, su_ptr, stride_se, stride_sn, stride_sk,
        bg_ptr, bu_ptr, stride_be, stride_bn,
        out_ptr, stride_ot,
        pair_ptr, expert_ptr, num_pairs, N, K, top_k, alpha, limit,
        FORMAT: tl.constexpr, SBN: tl.constexpr, SBK: tl.constexpr, SORTED: tl.constexpr,
        ACT: tl.constexpr, HAS_BIAS: tl.constexpr,
        BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    """moe_gate_up_gemv_kernel for dense and FP8 weights with the next chunk's weights requested
    before the current chunk is used (register double buffering: a program keeps one chunk in
    flight while it computes), one activation load per pair shared by gate and up, and no
    branch on the pair in the one-pair-per-program case. Block-scaled FP8: BLOCK_N divides SBN
    (the program's rows share one scale row, folded into the activations) and BLOCK_K divides
    SBK or is a multiple of it."""
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    e, pairs, valid = _block_pairs(pair_ptr, expert_ptr, pid_m, num_pairs, SORTED, BLOCK_M)
    if e < 0:
        return
    n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    n_mask = n < N
    nb = (pid_n * BLOCK_N) // SBN
    tok = tl.where(valid, pairs // top_k, 0).to(tl.int64)
    cols = tl.arange(0, BLOCK_M)
    acc_g = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
    acc_u = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
    # the chunk in flight is converted for carrying at the end of the iteration, after the chunk
    # in hand is used
    nwg = _carried(_stream_w(wg_ptr, e, n, n_mask, 0, K, stride_we, stride_wn, BLOCK_K), FORMAT)
    nwu = _carried(_stream_w(wu_ptr, e, n, n_mask, 0, K, stride_we, stride_wn, BLOCK_K), FORMAT)
    for k0 in range(0, K, BLOCK_K):
        wg = nwg.to(tl.float32)
        wu = nwu.to(tl.float32)
        rwg = _stream_w(wg_ptr, e, n, n_mask, k0 + BLOCK_K, K, stride_we, stride_wn, BLOCK_K)
        rwu = _stream_w(wu_ptr, e, n, n_mask, k0 + BLOCK_K, K, stride_we, stride_wn, BLOCK_K)
        for m in tl.static_range(BLOCK_M):
            row = tl.sum(tl.where(cols == m, tok, 0))
            if SORTED:
                pair = tl.load(pair_ptr + pid_m * BLOCK_M + m)
                if pair < num_pairs:  # padding slots of a sorted block skip their FMAs
                    xg = _stream_x(x_ptr + row * stride_xt, k0, K, sg_ptr, e, nb, stride_se, stride_sn, stride_sk,
                                   FORMAT, SBK, BLOCK_K)
                    xu = xg
                    if FORMAT == 2:
                        xu = _stream_x(x_ptr + row * stride_xt, k0, K, su_ptr, e, nb, stride_se, stride_sn,
                                       stride_sk, FORMAT, SBK, BLOCK_K)
                    acc_g = _slot_add(acc_g, tl.sum(wg * xg[None, :], axis=1), m, BLOCK_M)
                    acc_u = _slot_add(acc_u, tl.sum(wu * xu[None, :], axis=1), m, BLOCK_M)
            else:
                xg = _stream_x(x_ptr + row * stride_xt, k0, K, sg_ptr, e, nb, stride_se, stride_sn, stride_sk,
                               FORMAT, SBK, BLOCK_K)
                xu = xg
                if FORMAT == 2:
                    xu = _stream_x(x_ptr + row * stride_xt, k0, K, su_ptr, e, nb, stride_se, stride_sn, stride_sk,
                                   FORMAT, SBK, BLOCK_K)
                acc_g = _slot_add(acc_g, tl.sum(wg * xg[None, :], axis=1), m, BLOCK_M)
                acc_u = _slot_add(acc_u, tl.sum(wu * xu[None, :], axis=1), m, BLOCK_M)
        nwg = _carried(rwg, FORMAT)
        nwu = _carried(rwu, FORMAT)
    acc_g = _row_scale(acc_g, sg_ptr, e, n, n_mask, stride_se, stride_sn, FORMAT)
    acc_u = _row_scale(acc_u, su_ptr, e, n, n_mask, stride_se, stride_sn, FORMAT)
    _glu_store(acc_g, acc_u, bg_ptr, bu_ptr, stride_be, stride_bn, out_ptr, stride_ot, e, n, n_mask, pairs, valid,
               alpha, limit, ACT, HAS_BIAS)


@triton.jit
def moe_down_stream_kernel(
        a_ptr, stride_at,
        w_ptr, stride_we, stride_wn,
        s_ptr, stride_se, stride_sn, stride_sk,
        b_ptr, stride_be,
        pair_weights_ptr, out_ptr, stride_ot,
        pair_ptr, expert_ptr, num_pairs, N, K,
        FORMAT: tl.constexpr, SBN: tl.constexpr, SBK: tl.constexpr, SORTED: tl.constexpr,
        HAS_BIAS: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    """moe_down_gemv_kernel with the next chunk prefetched (as moe_gate_up_stream_kernel)."""
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    e, pairs, valid = _block_pairs(pair_ptr, expert_ptr, pid_m, num_pairs, SORTED, BLOCK_M)
    if e < 0:
        return
    rows = tl.where(valid, pairs, 0).to(tl.int64)
    n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    n_mask = n < N
    nb = (pid_n * BLOCK_N) // SBN
    cols = tl.arange(0, BLOCK_M)
    acc = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
    nw = _carried(_stream_w(w_ptr, e, n, n_mask, 0, K, stride_we, stride_wn, BLOCK_K), FORMAT)
    for k0 in range(0, K, BLOCK_K):
        w = nw.to(tl.float32)
        rw = _stream_w(w_ptr, e, n, n_mask, k0 + BLOCK_K, K, stride_we, stride_wn, BLOCK_K)
        for m in tl.static_range(BLOCK_M):
            row = tl.sum(tl.where(cols == m, rows, 0))
            if SORTED:
                pair = tl.load(pair_ptr + pid_m * BLOCK_M + m)
                if pair < num_pairs:
                    xv = _stream_x(a_ptr + row * stride_at, k0, K, s_ptr, e, nb, stride_se, stride_sn, stride_sk,
                                   FORMAT, SBK, BLOCK_K)
                    acc = _slot_add(acc, tl.sum(w * xv[None, :], axis=1), m, BLOCK_M)
            else:
                xv = _stream_x(a_ptr + row * stride_at, k0, K, s_ptr, e, nb, stride_se, stride_sn, stride_sk,
                               FORMAT, SBK, BLOCK_K)
                acc = _slot_add(acc, tl.sum(w * xv[None, :], axis=1), m, BLOCK_M)
        nw = _carried(rw, FORMAT)
    acc = _row_scale(acc, s_ptr, e, n, n_mask, stride_se, stride_sn, FORMAT)
    if HAS_BIAS:
        acc += tl.load(b_ptr + e.to(tl.int64) * stride_be + n, mask=n_mask, other=0.0).to(tl.float32)[:, None]
    gate = tl.load(pair_weights_ptr + rows, mask=valid, other=0.0)
    acc = acc * gate[None, :]
    tl.store(out_ptr + rows[None, :] * stride_ot + n[:, None], acc, mask=valid[None, :] & n_mask[:, None])
