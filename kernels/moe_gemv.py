"""Decode-size MoE GEMVs: each program streams BLOCK_N weight rows of one expert.

At a handful of (token, expert) pairs per expert the tensor-core tile of moe_gemm.py is mostly
padding and the MXFP4 dot goes through an upcast, so these kernels read wide contiguous row
slabs, decode them in registers and reduce against each pair's activation row with FMAs. MXFP4
scales are applied once per 32-element group after the partial sum, not per element. Weight
formats and activations are those of moe_gemm.py.

MXFP4 word decode (moe_*_words_kernel, MoeConfig.mx_words): the weight row is read as int32
words of 8 codes and each word is
decoded two values per 32-bit operation into bf16 bit patterns (no float conversion
instruction), then widened to float32 by a shift or a mask. The decode costs about 3 integer
operations per weight value against about 7 plus a conversion per value for the code-by-code
path (half the instructions per value overall); what is left limiting these kernels at decode
sizes is the number of loads in flight per SM (bench/NOTES-moe.md).
The decoded value is E2M1 * 2^-126 (code 1 is a float32 subnormal, which the GPU keeps: no
flush-to-zero in Triton's float arithmetic), so activations are scaled by 2^100 on load to keep
the products normal, and the E8M0 group multiplier carries the remaining 2^26.

Stream kernels (moe_*_stream_kernel, MoeConfig.prefetch, dense and FP8): the per-chunk
reduction of the gemv kernels with the next chunk's weights requested before the current one is
used, and block scales folded into the activations.
"""
from __future__ import annotations

import triton
import triton.language as tl

from .moe_gemm import _row_scale


@triton.jit
def _e2m1_f32(codes):
    """E2M1 codes (int32 0..15) -> value * 2^-14 in float32 (fp16 bit placement, see above)."""
    bits = ((codes & 7) << 9) | ((codes & 8) << 12)
    return bits.to(tl.int16).to(tl.float16, bitcast=True).to(tl.float32)


# 2^100 on the activations and 2^26 in the group multiplier undo the word decode's 2^-126.
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
    BLOCK_G: tl.constexpr = BLOCK_K // 32
    g = k0 // 32 + tl.arange(0, BLOCK_G)
    g_mask = g < K // 32
    # offsets as (groups) * 4 + word: the compiler sees 16-byte aligned runs of 4 words and
    # issues one 128-bit load per row and group
    row_groups = e.to(tl.int64) * stride_we + n.to(tl.int64) * stride_wn
    offs = (row_groups[:, None, None] + g[None, :, None]) * 4 + tl.arange(0, 4)[None, None, :]
    w = tl.load(w_ptr + offs, mask=n_mask[:, None, None] & g_mask[None, :, None], other=0)
    s_base = s_ptr + e.to(tl.int64) * stride_se + n * stride_sn
    scale = tl.load(s_base[:, None] + g[None, :] * stride_sk, mask=n_mask[:, None] & g_mask[None, :], other=0)
    return w, scale


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
    elif FORMAT == 2 and BLOCK_K > SBK:
        # several scale blocks per K step (SBK a power of two dividing BLOCK_K): partial sums
        # per block, each scaled once
        NSB: tl.constexpr = BLOCK_K // SBK
        sb = k0 // SBK + tl.arange(0, NSB)
        kk = sb[:, None] * SBK + tl.arange(0, SBK)[None, :]
        k_mask = kk < K
        w = tl.load(w_base[:, None, None] + kk[None, :, :], mask=n_mask[:, None, None] & k_mask[None, :, :],
                    other=0.0).to(tl.float32)
        s = tl.load(s_ptr + e.to(tl.int64) * stride_se + (n // SBN)[:, None] * stride_sn + sb[None, :] * stride_sk,
                    mask=n_mask[:, None] & (sb * SBK < K)[None, :], other=0.0)
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
            part = tl.sum(tl.sum(w * xv.to(tl.float32)[None, :, :], axis=2) * s, axis=1)
            acc = tl.where(cols[None, :] == m, acc + part[:, None], acc)
    else:
        kk = k0 + tl.arange(0, BLOCK_K)
        k_mask = kk < K
        w = tl.load(w_base[:, None] + kk[None, :], mask=n_mask[:, None] & k_mask[None, :], other=0.0)
        w = w.to(tl.float32)
        if FORMAT == 2:
            # BLOCK_K divides SBK, so one K step lies inside one scale block
            s = tl.load(s_ptr + e.to(tl.int64) * stride_se + (n // SBN) * stride_sn + (k0 // SBK) * stride_sk,
                        mask=n_mask, other=0.0)
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
            xv = tl.load(x_ptr + tl.where(ok, row, 0) * stride_xt + kk, mask=k_mask & ((kk * 0 + pair) < num_pairs), other=0.0)
            part = tl.sum(w * xv.to(tl.float32)[None, :], axis=1)
            if FORMAT == 2:
                part = part * s
            acc = tl.where(cols[None, :] == m, acc + part[:, None], acc)
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
        BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
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
    for k0 in range(0, K, BLOCK_K):
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
    if HAS_BIAS:
        b_off = e.to(tl.int64) * stride_be + n * stride_bn
        acc_g += tl.load(bg_ptr + b_off, mask=n_mask, other=0.0).to(tl.float32)[:, None]
        acc_u += tl.load(bu_ptr + b_off, mask=n_mask, other=0.0).to(tl.float32)[:, None]
    if ACT == 0:
        h = acc_g * tl.sigmoid(acc_g) * acc_u
    else:
        g = tl.minimum(acc_g, limit)
        u = tl.minimum(tl.maximum(acc_u, -limit), limit)
        h = g * tl.sigmoid(alpha * g) * (u + 1.0)
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
        FORMAT: tl.constexpr, SBN: tl.constexpr, SBK: tl.constexpr, SORTED: tl.constexpr,
        HAS_BIAS: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    """moe_down_kernel's result by row streaming (pairs as in moe_gate_up_gemv_kernel)."""
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    e, pairs, valid = _block_pairs(pair_ptr, expert_ptr, pid_m, num_pairs, SORTED, BLOCK_M)
    if e < 0:
        return
    rows = tl.where(valid, pairs, 0).to(tl.int64)
    n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    n_mask = n < N
    acc = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
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
        nwg, nsg = _mx_words_raw(wg_ptr, sg_ptr, e, n, n_mask, 0, K, stride_we, stride_wn, stride_se, stride_sn,
                                 stride_sk, BLOCK_K)
        nwu, nsu = _mx_words_raw(wu_ptr, su_ptr, e, n, n_mask, 0, K, stride_we, stride_wn, stride_se, stride_sn,
                                 stride_sk, BLOCK_K)
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
    _glu_store(acc_g, acc_u, bg_ptr, bu_ptr, stride_be, stride_bn, out_ptr, stride_ot, e, n, n_mask, pairs, valid,
               alpha, limit, ACT, HAS_BIAS)


@triton.jit
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
            nw, ns = _mx_words_raw(w_ptr, s_ptr, e, n, n_mask, k0 + BLOCK_K, K, stride_we, stride_wn, stride_se,
                                   stride_sn, stride_sk, BLOCK_K)
        else:
            cw, cs = _mx_words_raw(w_ptr, s_ptr, e, n, n_mask, k0, K, stride_we, stride_wn, stride_se, stride_sn,
                                   stride_sk, BLOCK_K)
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
