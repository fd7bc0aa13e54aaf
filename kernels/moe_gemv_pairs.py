"""MXFP4 packed-f16 row kernels over two pairs of one expert (MoeConfig block_m 2 with mx_half2).

The packed-f16 kernels (moe_gemv_half2.py) take one (token, expert) pair per program, so an expert
that two tokens chose is read and decoded twice. At 32 tokens gpt-oss-120b's 128 pairs fall on
~81 experts, and the E2M1 decode is about 70% of the instructions spent per word (13 of ~18; the
rest is the four packed FMAs and the group sum), which is the kernels' limit at that size: issue
at 55-64% of peak with the integer pipe the busiest (bench/NOTES-moe.md). Here the pairs are first
grouped by expert in blocks of two (moe_align), and a program takes one block: each word is
decoded once and meets both pairs' activations in one assembly block (_group_asm(2)); a block
with one real pair runs the one-pair loop. Words and scales come through the TMA engine as in the
TMA form of the one-pair kernels (K steps multiples of 512, the last one on the boxes' zero fill),
which keeps the words in flight out of registers: two pairs per program on pointer loads held 103
registers against 71 and ran slower (bench/NOTES-moe.md, "Two pairs of one expert per program").

The grid runs (row block, pair block) with the row blocks fastest: moe_align lists the blocks
that hold pairs first and its unused ones (up to one per expert, each program of which exits at
once) last, so those come after all real work has been scheduled instead of between it.

Results are those of the one-pair TMA kernels, summed in the same order.
"""
from __future__ import annotations

import triton
import triton.language as tl

from .moe_gemv_half2 import (_group_asm, _group_dot, _pair_slots, _split4, _tma_chunk, _x_pairs, group_constraints,
                             store_down_rows, store_swiglu_rows, tma_words)

_PAIRS_ASM = tl.constexpr(_group_asm(2))
_PAIRS_CONSTRAINTS = tl.constexpr(group_constraints(2))


@triton.jit
def _two_pair_sums(acc_a, acc_b, w, scale, xa0, xa1, xa2, xa3, xb0, xb1, xb2, xb3, INTERPRET: tl.constexpr):
    """acc_a, acc_b [BN, G] + the group sums of words w [BN, G, 4] against pairs a and b, times
    2^(s - 127 + 6) from the E8M0 scales [BN, G] (moe_gemv_half2._scaled_sums for two pairs)."""
    mult = ((scale.to(tl.int32) + 6) << 23).to(tl.float32, bitcast=True)
    if INTERPRET:
        dot_a = _group_dot(w, xa0, xa1, xa2, xa3, True)
        dot_b = _group_dot(w, xb0, xb1, xb2, xb3, True)
    else:
        w0, w1, w2, w3 = _split4(w)
        a00, a01, a02, a03, a10, a11, a12, a13, a20, a21, a22, a23, a30, a31, a32, a33 = _pair_slots(xa0, xa1, xa2,
                                                                                                     xa3)
        b00, b01, b02, b03, b10, b11, b12, b13, b20, b21, b22, b23, b30, b31, b32, b33 = _pair_slots(xb0, xb1, xb2,
                                                                                                     xb3)
        dot_a, dot_b = tl.inline_asm_elementwise(
            _PAIRS_ASM, _PAIRS_CONSTRAINTS,
            [w0, w1, w2, w3, a00, a01, a02, a03, a10, a11, a12, a13, a20, a21, a22, a23, a30, a31, a32, a33,
             b00, b01, b02, b03, b10, b11, b12, b13, b20, b21, b22, b23, b30, b31, b32, b33],
            dtype=(tl.float32, tl.float32), is_pure=True, pack=1)
    return acc_a + dot_a * mult, acc_b + dot_b * mult


@triton.jit
def _block_pair_ids(sorted_ids_ptr, block_expert_ptr, num_pairs):
    """This program's block of moe_align(..., block_m=2) -> (expert, pair a, pair b, whether b is
    real); expert -1: an unused block."""
    block = tl.program_id(1)
    e = tl.load(block_expert_ptr + block)
    pair_a = tl.load(sorted_ids_ptr + 2 * block)
    pair_b = tl.load(sorted_ids_ptr + 2 * block + 1)
    return e, pair_a, pair_b, pair_b < num_pairs


@triton.jit
def _row_block(N, BLOCK_N: tl.constexpr):
    """This program's output rows: (first row, rows [BLOCK_N], which are below N)."""
    n0 = tl.program_id(0) * BLOCK_N
    n = n0 + tl.arange(0, BLOCK_N)
    return n0, n, n < N


@triton.jit
def moe_gate_up_pairs_kernel(
        xq_ptr, x_inv_scale_ptr, wg_desc, wu_desc, sg_desc, su_desc,
        bg_ptr, bu_ptr, stride_be, stride_bn,
        out_ptr, act_scale, sorted_ids_ptr, block_expert_ptr, num_pairs, N, K, top_k, alpha, limit,
        HAS_BIAS: tl.constexpr, INTERPRET: tl.constexpr,
        BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, STAGES: tl.constexpr, WIDE_X: tl.constexpr = False):
    """Program (n-block, block of two pairs of one expert): moe_gate_up_half2_kernel's rows for
    both pairs (TMA form, TAIL_K 0), each word decoded once. sorted_ids / block_expert: moe_align
    with block_m 2 (padding slots hold num_pairs); wg_desc / wu_desc, sg_desc / su_desc: the
    tensor descriptors of moe_gate_up_half2_kernel."""
    e, pair_a, pair_b, two = _block_pair_ids(sorted_ids_ptr, block_expert_ptr, num_pairs)
    if e < 0:
        return
    n0, n, n_mask = _row_block(N, BLOCK_N)
    BLOCK_G: tl.constexpr = BLOCK_K // 32
    tok_a = (pair_a // top_k).to(tl.int64)
    row_a = xq_ptr + tok_a * (K // 2)
    inv_a = tl.load(x_inv_scale_ptr + tok_a)
    if two:
        tok_b = (pair_b // top_k).to(tl.int64)
        row_b = xq_ptr + tok_b * (K // 2)
        g_a = tl.zeros((BLOCK_N, BLOCK_G), dtype=tl.float32)
        u_a = tl.zeros((BLOCK_N, BLOCK_G), dtype=tl.float32)
        g_b = tl.zeros((BLOCK_N, BLOCK_G), dtype=tl.float32)
        u_b = tl.zeros((BLOCK_N, BLOCK_G), dtype=tl.float32)
        for k0 in tl.range(0, K, BLOCK_K, num_stages=STAGES):
            xa0, xa1, xa2, xa3 = _x_pairs(row_a, k0, K, BLOCK_K, WIDE_X)
            xb0, xb1, xb2, xb3 = _x_pairs(row_b, k0, K, BLOCK_K, WIDE_X)
            w, scale = tma_words(wg_desc, sg_desc, e, n0, k0, BLOCK_N, BLOCK_K)
            g_a, g_b = _two_pair_sums(g_a, g_b, w, scale, xa0, xa1, xa2, xa3, xb0, xb1, xb2, xb3, INTERPRET)
            w, scale = tma_words(wu_desc, su_desc, e, n0, k0, BLOCK_N, BLOCK_K)
            u_a, u_b = _two_pair_sums(u_a, u_b, w, scale, xa0, xa1, xa2, xa3, xb0, xb1, xb2, xb3, INTERPRET)
        inv_b = tl.load(x_inv_scale_ptr + tok_b)
        store_swiglu_rows(tl.sum(g_b, axis=1) * inv_b, tl.sum(u_b, axis=1) * inv_b, e, n, n_mask, pair_b, N, bg_ptr,
                          bu_ptr, stride_be, stride_bn, out_ptr, act_scale, alpha, limit, HAS_BIAS)
    else:
        g_a = tl.zeros((BLOCK_N, BLOCK_G), dtype=tl.float32)
        u_a = tl.zeros((BLOCK_N, BLOCK_G), dtype=tl.float32)
        for k0 in tl.range(0, K, BLOCK_K, num_stages=STAGES):
            x0, x1, x2, x3 = _x_pairs(row_a, k0, K, BLOCK_K, WIDE_X)
            g_a = _tma_chunk(g_a, wg_desc, sg_desc, e, n0, k0, x0, x1, x2, x3, INTERPRET, BLOCK_N, BLOCK_K)
            u_a = _tma_chunk(u_a, wu_desc, su_desc, e, n0, k0, x0, x1, x2, x3, INTERPRET, BLOCK_N, BLOCK_K)
    store_swiglu_rows(tl.sum(g_a, axis=1) * inv_a, tl.sum(u_a, axis=1) * inv_a, e, n, n_mask, pair_a, N, bg_ptr,
                      bu_ptr, stride_be, stride_bn, out_ptr, act_scale, alpha, limit, HAS_BIAS)


@triton.jit
def moe_down_pairs_kernel(
        aq_ptr, a_inv_scale, w_desc, s_desc, b_ptr, stride_be,
        pair_weights_ptr, y_ptr, stride_yt, sorted_ids_ptr, block_expert_ptr, num_pairs, N, K,
        HAS_BIAS: tl.constexpr, INTERPRET: tl.constexpr,
        BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, STAGES: tl.constexpr):
    """Program (n-block, block of two pairs of one expert): moe_down_half2_kernel's rows for both
    pairs (TMA form, TAIL_K 0), each word decoded once; blocks as in moe_gate_up_pairs_kernel."""
    e, pair_a, pair_b, two = _block_pair_ids(sorted_ids_ptr, block_expert_ptr, num_pairs)
    if e < 0:
        return
    n0, n, n_mask = _row_block(N, BLOCK_N)
    BLOCK_G: tl.constexpr = BLOCK_K // 32
    row_a = aq_ptr + pair_a.to(tl.int64) * (K // 2)
    if two:
        row_b = aq_ptr + pair_b.to(tl.int64) * (K // 2)
        y_a = tl.zeros((BLOCK_N, BLOCK_G), dtype=tl.float32)
        y_b = tl.zeros((BLOCK_N, BLOCK_G), dtype=tl.float32)
        for k0 in tl.range(0, K, BLOCK_K, num_stages=STAGES):
            xa0, xa1, xa2, xa3 = _x_pairs(row_a, k0, K, BLOCK_K)
            xb0, xb1, xb2, xb3 = _x_pairs(row_b, k0, K, BLOCK_K)
            w, scale = tma_words(w_desc, s_desc, e, n0, k0, BLOCK_N, BLOCK_K)
            y_a, y_b = _two_pair_sums(y_a, y_b, w, scale, xa0, xa1, xa2, xa3, xb0, xb1, xb2, xb3, INTERPRET)
        store_down_rows(tl.sum(y_b, axis=1) * a_inv_scale, e, n, n_mask, pair_b, b_ptr, stride_be, pair_weights_ptr,
                        y_ptr, stride_yt, HAS_BIAS)
    else:
        y_a = tl.zeros((BLOCK_N, BLOCK_G), dtype=tl.float32)
        for k0 in tl.range(0, K, BLOCK_K, num_stages=STAGES):
            x0, x1, x2, x3 = _x_pairs(row_a, k0, K, BLOCK_K)
            y_a = _tma_chunk(y_a, w_desc, s_desc, e, n0, k0, x0, x1, x2, x3, INTERPRET, BLOCK_N, BLOCK_K)
    store_down_rows(tl.sum(y_a, axis=1) * a_inv_scale, e, n, n_mask, pair_a, b_ptr, stride_be, pair_weights_ptr,
                    y_ptr, stride_yt, HAS_BIAS)

