"""MXFP4 decode-size MoE GEMVs reading the weight row as int32 words of 8 codes (MoeConfig.mx_words).

Each word is decoded two values per 32-bit operation into bf16 bit patterns (no float conversion
instruction), then widened to float32 by a shift or a mask. The decode costs about 3 integer
operations per weight value against about 7 plus a conversion per value for the code-by-code
path (half the instructions per value overall). gpt-oss's experts run on the packed-f16 kernels
of moe_gemv_half2.py instead (about 2.8 instructions per value, bench/NOTES-moe.md); these
serve MXFP4 experts with other activations.
The decoded value is E2M1 * 2^-126 (code 1 is a float32 subnormal, which the GPU keeps: no
flush-to-zero in Triton's float arithmetic), so activations are scaled by 2^100 on load to keep
the products normal, and the E8M0 group multiplier carries the remaining 2^26.
"""
from __future__ import annotations

import triton
import triton.language as tl

from .moe_gemv import _block_pairs, _glu_store

X_WORD_SCALE = tl.constexpr(2.0 ** 100)  # exact in float32
X_WORD_EXP = tl.constexpr(100 << 23)  # the same, added to a float32 exponent field
MULT_WORD_BIAS = tl.constexpr(26)


@triton.jit
def _mx_words_raw(w_ptr, s_ptr, e, n, n_mask, k0, K, stride_we, stride_wn, stride_se, stride_sn, stride_sk,
                  BLOCK_K: tl.constexpr):
    """One K chunk of BLOCK_N MXFP4 rows read through an int32 view of the codes, weight strides
    in 16-byte groups (one group = 4 words = 32 codes; word j holds codes 8j..8j+7, code i in
    bits 4i..4i+3). -> (words int32 [BLOCK_N, G, 4], E8M0 scales uint8 [BLOCK_N, G]); a chunk
    past K loads nothing (all masked)."""
    w = mx_words(w_ptr, e, n, n_mask, k0, K, stride_we, stride_wn, BLOCK_K)
    BLOCK_G: tl.constexpr = BLOCK_K // 32
    g = k0 // 32 + tl.arange(0, BLOCK_G)
    s_base = s_ptr + e.to(tl.int64) * stride_se + n * stride_sn
    scale = tl.load(s_base[:, None] + g[None, :] * stride_sk, mask=n_mask[:, None] & (g < K // 32)[None, :], other=0)
    return w, scale


@triton.jit
def mx_words(w_ptr, e, n, n_mask, k0, K, stride_we, stride_wn, BLOCK_K: tl.constexpr):
    """The words of _mx_words_raw alone: int32 [BLOCK_N, G, 4]."""
    BLOCK_G: tl.constexpr = BLOCK_K // 32
    g = k0 // 32 + tl.arange(0, BLOCK_G)
    g_mask = g < K // 32
    # offsets as (groups) * 4 + word: the compiler sees 16-byte aligned runs of 4 words and
    # issues one 128-bit load per row and group
    row_groups = e.to(tl.int64) * stride_we + n.to(tl.int64) * stride_wn
    offs = (row_groups[:, None, None] + g[None, :, None]) * 4 + tl.arange(0, 4)[None, None, :]
    return tl.load(w_ptr + offs, mask=n_mask[:, None, None] & g_mask[None, :, None], other=0)


@triton.jit
def _mx_words_decode(w, scale):
    """-> t0..t3 uint32 [BLOCK_N, G, 4], mult float32 [BLOCK_N, G].

    t_i holds code i of each word as a bf16 bit pattern in its low half and code i + 4 in its
    high half: the E2M1 bits e1 e0 m land on bf16 bits 8..6 (the two low exponent bits and the
    top mantissa bit), the sign on bit 15, so each half reads as the E2M1 value * 2^-126.
    mult = 2^(scale - 127) * 2^26 built from its exponent field: valid for E8M0 scales 0..228
    (gpt-oss checkpoints use scales near 127)."""
    w = w.to(tl.uint32, bitcast=True)
    t0 = ((w & 0x00070007) << 6) | ((w & 0x00080008) << 12)
    t1 = ((w & 0x00700070) << 2) | ((w & 0x00800080) << 8)
    t2 = ((w & 0x07000700) >> 2) | ((w & 0x08000800) << 4)
    t3 = ((w & 0x70007000) >> 6) | (w & 0x80008000)
    mult = ((scale.to(tl.int32) + MULT_WORD_BIAS) << 23).to(tl.float32, bitcast=True)
    return t0, t1, t2, t3, mult


@triton.jit
def _lo_f32(t):
    """Low bf16 half of a uint32 -> float32 (a shift instead of a conversion)."""
    return (t << 16).to(tl.float32, bitcast=True)


@triton.jit
def _hi_f32(t):
    """High bf16 half of a uint32 -> float32."""
    return (t & 0xFFFF0000).to(tl.float32, bitcast=True)


@triton.jit
def _x_plane(x_row, k, X_BF16: tl.constexpr):
    """Activations at offsets k as float32 times 2^100. bf16: the bits shifted into a float32
    and 100 added to the exponent field in one integer multiply-add; exact for normal values,
    while zeros and bf16 subnormals (|x| < 2^-126) come out below 2^-126 in magnitude."""
    if X_BF16:
        bits = tl.load(x_row + k).to(tl.uint16, bitcast=True).to(tl.uint32)
        return (bits * 65536 + X_WORD_EXP).to(tl.float32, bitcast=True)
    else:
        return tl.load(x_row + k).to(tl.float32) * X_WORD_SCALE


@triton.jit
def _mx_words_x(x_row, k0, K, X_BF16: tl.constexpr, BLOCK_K: tl.constexpr):
    """One K chunk of an activation row as 8 float32 tensors [G, 4] (x_i holds element 8j + i
    of each group's word j) times 2^100. Offsets past the row are clamped onto its last word
    instead of masked (no fill instruction per load): the weights there load as zero codes, and
    the clamped activations are finite values of the same row."""
    BLOCK_G: tl.constexpr = BLOCK_K // 32
    g = k0 // 32 + tl.arange(0, BLOCK_G)
    k = tl.minimum(g[:, None] * 32 + tl.arange(0, 4)[None, :] * 8, K - 8)
    x0 = _x_plane(x_row, k, X_BF16)
    x1 = _x_plane(x_row, k + 1, X_BF16)
    x2 = _x_plane(x_row, k + 2, X_BF16)
    x3 = _x_plane(x_row, k + 3, X_BF16)
    x4 = _x_plane(x_row, k + 4, X_BF16)
    x5 = _x_plane(x_row, k + 5, X_BF16)
    x6 = _x_plane(x_row, k + 6, X_BF16)
    x7 = _x_plane(x_row, k + 7, X_BF16)
    return x0, x1, x2, x3, x4, x5, x6, x7


@triton.jit
def _mx_words_dot(t0, t1, t2, t3, mult, x0, x1, x2, x3, x4, x5, x6, x7):
    """-> [BLOCK_N, G] per-group dot products of decoded weights and activations, scaled."""
    acc = _lo_f32(t0) * x0[None, :, :]
    acc += _lo_f32(t1) * x1[None, :, :]
    acc += _lo_f32(t2) * x2[None, :, :]
    acc += _lo_f32(t3) * x3[None, :, :]
    acc += _hi_f32(t0) * x4[None, :, :]
    acc += _hi_f32(t1) * x5[None, :, :]
    acc += _hi_f32(t2) * x6[None, :, :]
    acc += _hi_f32(t3) * x7[None, :, :]
    return tl.sum(acc, axis=2) * mult


@triton.jit
def _slot_sums(a0, a1, a2, a3, BLOCK_M: tl.constexpr):
    """Per-slot [BLOCK_N, G] accumulators -> [BLOCK_N, BLOCK_M] row sums."""
    cols = tl.arange(0, BLOCK_M)[None, :]
    out = tl.where(cols == 0, tl.sum(a0, axis=1)[:, None], 0.0)
    if BLOCK_M > 1:
        out = tl.where(cols == 1, tl.sum(a1, axis=1)[:, None], out)
    if BLOCK_M > 2:
        out = tl.where(cols == 2, tl.sum(a2, axis=1)[:, None], out)
        out = tl.where(cols == 3, tl.sum(a3, axis=1)[:, None], out)
    return out


@triton.jit(do_not_specialize=["stride_sn", "su_ptr"])  # scale rows: see moe_gemv_half2.py
def moe_gate_up_words_kernel(
        x_ptr, stride_xt,
        wg_ptr, wu_ptr, stride_we, stride_wn,
        sg_ptr, su_ptr, stride_se, stride_sn, stride_sk,
        bg_ptr, bu_ptr, stride_be, stride_bn,
        out_ptr, stride_ot,
        pair_ptr, expert_ptr, num_pairs, N, K, top_k, alpha, limit,
        SORTED: tl.constexpr, ACT: tl.constexpr, HAS_BIAS: tl.constexpr, X_BF16: tl.constexpr,
        PREFETCH: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    """moe_gate_up_gemv_kernel for MXFP4 by word decode: wg/wu are int32 views with strides in
    16-byte groups. Each chunk is decoded once for the block's pairs (BLOCK_M <= 4), gate and up
    share one activation load per pair, and the per-group partial sums are kept per row and
    group (one cross-thread reduction at the end instead of one per chunk). PREFETCH: the next
    chunk's weights are requested before this chunk is decoded (register double buffering)."""
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    e, pairs, valid = _block_pairs(pair_ptr, expert_ptr, pid_m, num_pairs, SORTED, BLOCK_M)
    if e < 0:
        return
    n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    n_mask = n < N
    BLOCK_G: tl.constexpr = BLOCK_K // 32
    g0 = tl.zeros((BLOCK_N, BLOCK_G), dtype=tl.float32)
    g1, g2, g3, u0, u1, u2, u3 = g0, g0, g0, g0, g0, g0, g0
    # activation rows of the slots, out of the K loop (padding slots point at row 0, unused)
    tok = tl.where(valid, pairs // top_k, 0).to(tl.int64)
    cols = tl.arange(0, BLOCK_M)
    if PREFETCH:
        nwg, nsg = _mx_words_raw(wg_ptr, sg_ptr, e, n, n_mask, 0, K, stride_we, stride_wn, stride_se,
                                 stride_sn, stride_sk, BLOCK_K)
        nwu, nsu = _mx_words_raw(wu_ptr, su_ptr, e, n, n_mask, 0, K, stride_we, stride_wn, stride_se,
                                 stride_sn, stride_sk, BLOCK_K)
    for k0 in range(0, K, BLOCK_K):
        if PREFETCH:
            cwg, csg, cwu, csu = nwg, nsg, nwu, nsu
            nwg, nsg = _mx_words_raw(wg_ptr, sg_ptr, e, n, n_mask, k0 + BLOCK_K, K, stride_we, stride_wn,
                                     stride_se, stride_sn, stride_sk, BLOCK_K)
            nwu, nsu = _mx_words_raw(wu_ptr, su_ptr, e, n, n_mask, k0 + BLOCK_K, K, stride_we, stride_wn,
                                     stride_se, stride_sn, stride_sk, BLOCK_K)
        else:
            cwg, csg = _mx_words_raw(wg_ptr, sg_ptr, e, n, n_mask, k0, K, stride_we, stride_wn, stride_se,
                                     stride_sn, stride_sk, BLOCK_K)
            cwu, csu = _mx_words_raw(wu_ptr, su_ptr, e, n, n_mask, k0, K, stride_we, stride_wn, stride_se,
                                     stride_sn, stride_sk, BLOCK_K)
        tg0, tg1, tg2, tg3, mg = _mx_words_decode(cwg, csg)
        tu0, tu1, tu2, tu3, mu = _mx_words_decode(cwu, csu)
        for m in tl.static_range(BLOCK_M):
            if SORTED:
                pair = tl.load(pair_ptr + pid_m * BLOCK_M + m)
                if pair < num_pairs:  # padding slots of a sorted block skip their FMAs
                    row = tl.sum(tl.where(cols == m, tok, 0))
                    x0, x1, x2, x3, x4, x5, x6, x7 = _mx_words_x(x_ptr + row * stride_xt, k0, K, X_BF16, BLOCK_K)
                    pg = _mx_words_dot(tg0, tg1, tg2, tg3, mg, x0, x1, x2, x3, x4, x5, x6, x7)
                    pu = _mx_words_dot(tu0, tu1, tu2, tu3, mu, x0, x1, x2, x3, x4, x5, x6, x7)
                    if m == 0:
                        g0 += pg
                        u0 += pu
                    elif m == 1:
                        g1 += pg
                        u1 += pu
                    elif m == 2:
                        g2 += pg
                        u2 += pu
                    else:
                        g3 += pg
                        u3 += pu
            else:
                # one pair per program, always valid: no branch, so the activation loads can be
                # issued together with the weight loads
                x0, x1, x2, x3, x4, x5, x6, x7 = _mx_words_x(x_ptr + tl.sum(tok) * stride_xt, k0, K, X_BF16,
                                                             BLOCK_K)
                g0 += _mx_words_dot(tg0, tg1, tg2, tg3, mg, x0, x1, x2, x3, x4, x5, x6, x7)
                u0 += _mx_words_dot(tu0, tu1, tu2, tu3, mu, x0, x1, x2, x3, x4, x5, x6, x7)
    acc_g = _slot_sums(g0, g1, g2, g3, BLOCK_M)
    acc_u = _slot_sums(u0, u1, u2, u3, BLOCK_M)
    _glu_store(acc_g, acc_u, bg_ptr, bu_ptr, stride_be, stride_bn, out_ptr, stride_ot, e, n, n_mask, pairs,
               valid, alpha, limit, ACT, HAS_BIAS)


@triton.jit(do_not_specialize=["stride_sn"])  # scale rows: see moe_gemv_half2.py
def moe_down_words_kernel(
        a_ptr, stride_at,
        w_ptr, stride_we, stride_wn,
        s_ptr, stride_se, stride_sn, stride_sk,
        b_ptr, stride_be,
        pair_weights_ptr, out_ptr, stride_ot,
        pair_ptr, expert_ptr, num_pairs, N, K,
        SORTED: tl.constexpr, HAS_BIAS: tl.constexpr, X_BF16: tl.constexpr, PREFETCH: tl.constexpr,
        BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    """moe_down_gemv_kernel for MXFP4 by word decode (as moe_gate_up_words_kernel)."""
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    e, pairs, valid = _block_pairs(pair_ptr, expert_ptr, pid_m, num_pairs, SORTED, BLOCK_M)
    if e < 0:
        return
    rows = tl.where(valid, pairs, 0).to(tl.int64)
    n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    n_mask = n < N
    BLOCK_G: tl.constexpr = BLOCK_K // 32
    a0 = tl.zeros((BLOCK_N, BLOCK_G), dtype=tl.float32)
    a1, a2, a3 = a0, a0, a0
    cols = tl.arange(0, BLOCK_M)
    if PREFETCH:
        nw, ns = _mx_words_raw(w_ptr, s_ptr, e, n, n_mask, 0, K, stride_we, stride_wn, stride_se, stride_sn,
                               stride_sk, BLOCK_K)
    for k0 in range(0, K, BLOCK_K):
        if PREFETCH:
            cw, cs = nw, ns
            nw, ns = _mx_words_raw(w_ptr, s_ptr, e, n, n_mask, k0 + BLOCK_K, K, stride_we, stride_wn,
                                   stride_se, stride_sn, stride_sk, BLOCK_K)
        else:
            cw, cs = _mx_words_raw(w_ptr, s_ptr, e, n, n_mask, k0, K, stride_we, stride_wn, stride_se,
                                   stride_sn, stride_sk, BLOCK_K)
        t0, t1, t2, t3, mult = _mx_words_decode(cw, cs)
        for m in tl.static_range(BLOCK_M):
            if SORTED:
                pair = tl.load(pair_ptr + pid_m * BLOCK_M + m)
                if pair < num_pairs:
                    row = tl.sum(tl.where(cols == m, rows, 0))
                    x0, x1, x2, x3, x4, x5, x6, x7 = _mx_words_x(a_ptr + row * stride_at, k0, K, X_BF16, BLOCK_K)
                    part = _mx_words_dot(t0, t1, t2, t3, mult, x0, x1, x2, x3, x4, x5, x6, x7)
                    if m == 0:
                        a0 += part
                    elif m == 1:
                        a1 += part
                    elif m == 2:
                        a2 += part
                    else:
                        a3 += part
            else:
                x0, x1, x2, x3, x4, x5, x6, x7 = _mx_words_x(a_ptr + tl.sum(rows) * stride_at, k0, K, X_BF16,
                                                             BLOCK_K)
                a0 += _mx_words_dot(t0, t1, t2, t3, mult, x0, x1, x2, x3, x4, x5, x6, x7)
    acc = _slot_sums(a0, a1, a2, a3, BLOCK_M)
    if HAS_BIAS:
        acc += tl.load(b_ptr + e.to(tl.int64) * stride_be + n, mask=n_mask, other=0.0).to(tl.float32)[:, None]
    gate = tl.load(pair_weights_ptr + rows, mask=valid, other=0.0)
    acc = acc * gate[None, :]
    tl.store(out_ptr + rows[None, :] * stride_ot + n[:, None], acc, mask=valid[None, :] & n_mask[:, None])
