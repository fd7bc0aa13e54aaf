"""Grouped MoE GEMMs over expert-sorted (token, expert) pairs (see moe_align.py).

Each program owns one BLOCK_M slice of pairs (all of one expert) and BLOCK_N output features,
and computes the transposed tile out^T [BLOCK_N, BLOCK_M] = W [BLOCK_N, K] @ X^T [K, BLOCK_M],
so the weight is the left operand: that is the orientation `tl.dot_scaled` wants for MXFP4
weights packed along K, and at decode (one real row per block) the program is a stream over
BLOCK_N weight rows. Weights are read in their checkpoint format and dequantised in registers:

  FMT_DENSE   weight [E, N, K] any float dtype
  FMT_FP8_ROW float8_e4m3fn [E, N, K], scale [E, N] (channel, or tensor broadcast over N)
  FMT_FP8_BLK float8_e4m3fn [E, N, K], scale [E, ceil(N/SBN), ceil(K/SBK)] (edge blocks partial)
  FMT_MXFP4   uint8 [E, N, K/2] (two E2M1 codes a byte, low nibble first), scale uint8 E8M0
              [E, N, K/32] (OCP Microscaling v1.0 section 5.3.3 / 6.3)

Activations are bf16 / fp16 / fp32, or (X_SCALED, FP8 weights) e4m3 rows with a float32 scale each,
so the dot is FP8 x FP8 on the tensor cores and the row scales are applied once after the K loop.
With channel (or tensor) weight scales those dots sum the whole K loop in the tensor cores' own
FP8 accumulation, as vLLM's Triton fused MoE does for such weights
(vllm/model_executor/layers/fused_moe/fused_moe.py), so the compiler keeps each step's wgmma in
flight; block scales multiply each step's dot before it is added, one wait a step.

PAIRS_MAJOR (FP8 and dense weights) turns the tile round: out [BLOCK_M, BLOCK_N] = X @ W^T, the
pairs as the tensor cores' M and the weight rows as their N. Hopper's wgmma takes M in steps of
64 per warp group and N up to 256, so prefill-sized blocks of pairs against wide rows of weights
issue fewer, wider instructions that way round.

Kernel 1 computes both gate and up tiles for the same pairs and applies the GLU activation;
kernel 2 applies the down projection, the down bias and the routing weight of each pair.
"""
from __future__ import annotations

import triton
import triton.language as tl

FMT_DENSE = 0
FMT_FP8_ROW = 1
FMT_FP8_BLK = 2
FMT_MXFP4 = 3

ACT_SILU_GLU = 0
ACT_SWIGLU_OAI = 1


@triton.jit
def _mxfp4_dequant(codes, scale, dtype: tl.constexpr):
    """E2M1 codes (int32 in 0..15) and E8M0 scales -> values in `dtype`.

    Placing the code's exponent and mantissa bits (e1 e0 m) at fp16 bits 11..9 gives an fp16
    whose value is the E2M1 value times 2^-14, subnormals included; the sign goes to bit 15.
    """
    bits = ((codes & 7) << 9) | ((codes & 8) << 12)
    v = bits.to(tl.int16).to(tl.float16, bitcast=True).to(tl.float32)
    # 2^(s - 127) * 2^14 as an fp32 built from its exponent field (valid for scales <= 240)
    mult = ((scale.to(tl.int32) + 14) << 23).to(tl.float32, bitcast=True)
    return (v * mult).to(dtype)


@triton.jit
def _to_dot_dtype(w, dtype: tl.constexpr):
    """Weights -> the tensor-core operand dtype. FP8 -> bf16 goes through float32: Triton's direct
    f16 -> bf16 step (after the paired e4m3 -> f16 conversion) compiles to one slow conversion
    instruction per value (F2F), the float32 route to a paired half-add and one paired pack, all
    exact for e4m3 values."""
    if w.dtype == tl.float8e4nv and dtype == tl.bfloat16:
        return w.to(tl.float16).to(tl.float32).to(tl.bfloat16)
    else:
        return w.to(dtype)


@triton.jit
def along_n(v, PAIRS_MAJOR: tl.constexpr):
    """A vector over a tile's weight rows, broadcast along its pairs."""
    if PAIRS_MAJOR:
        return v[None, :]
    else:
        return v[:, None]


@triton.jit
def along_m(v, PAIRS_MAJOR: tl.constexpr):
    """A vector over a tile's pairs, broadcast along its weight rows."""
    if PAIRS_MAJOR:
        return v[:, None]
    else:
        return v[None, :]


@triton.jit
def tile_zeros(BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, PAIRS_MAJOR: tl.constexpr):
    """A float32 accumulator in the tile's orientation: [BLOCK_M, BLOCK_N] pairs-major, else
    [BLOCK_N, BLOCK_M]."""
    if PAIRS_MAJOR:
        return tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    else:
        return tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)


@triton.jit
def _oriented_dot(w, x, acc, PAIRS_MAJOR: tl.constexpr):
    """w [BLOCK_N, BLOCK_K] with x [BLOCK_M, BLOCK_K] (PAIRS_MAJOR: -> acc + x @ w^T) or x^T
    [BLOCK_K, BLOCK_M] (-> acc + w @ x^T), summed into acc by the dot itself; acc None: the
    product alone."""
    if PAIRS_MAJOR:
        return tl.dot(x, tl.trans(w), acc)
    else:
        return tl.dot(w, x, acc)


@triton.jit
def _weight_dot(acc, w_ptr, s_ptr, e, n, n_mask, k0, K, x_ptr, x_rows, x_valid, stride_xt,
                stride_we, stride_wn, stride_se, stride_sn, stride_sk,
                FORMAT: tl.constexpr, MX_DOT_SCALED: tl.constexpr, SBN: tl.constexpr, SBK: tl.constexpr,
                BLOCK_K: tl.constexpr, X_FMT: tl.constexpr, X_SCALED: tl.constexpr,
                PAIRS_MAJOR: tl.constexpr = False):
    """acc [BLOCK_N, BLOCK_M] += W[e, n, k0:k0+BLOCK_K] @ X[x_rows, k0:k0+BLOCK_K]^T (PAIRS_MAJOR, not
    for MXFP4: acc [BLOCK_M, BLOCK_N] += X[x_rows] @ W[e, n]^T). X_SCALED: X is e4m3 (rows quantised
    with a scale each, applied by the caller) and W FP8: an FP8 x FP8 dot."""
    x_dtype = x_ptr.dtype.element_ty
    w_base = w_ptr + e.to(tl.int64) * stride_we + n[:, None].to(tl.int64) * stride_wn
    if FORMAT == 3:
        kb = k0 // 2 + tl.arange(0, BLOCK_K // 2)
        kb_mask = kb < K // 2
        m2 = n_mask[:, None] & kb_mask[None, :]
        packed = tl.load(w_base + kb[None, :], mask=m2, other=0)
        s_base = s_ptr + e.to(tl.int64) * stride_se + n[:, None] * stride_sn
        if MX_DOT_SCALED:
            kg = k0 // 32 + tl.arange(0, BLOCK_K // 32)
            scale = tl.load(s_base + kg[None, :] * stride_sk,
                            mask=n_mask[:, None] & (kg < K // 32)[None, :], other=127)
            kk = k0 + tl.arange(0, BLOCK_K)
            xt = tl.load(x_ptr + x_rows[None, :] * stride_xt + kk[:, None],
                         mask=x_valid[None, :] & (kk < K)[:, None], other=0.0)
            acc += tl.dot_scaled(packed, scale, "e2m1", xt, None, X_FMT)
        else:
            # byte j holds elements 2j (low nibble) and 2j+1: split X into even and odd columns
            # instead of interleaving the decoded weights
            scale = tl.load(s_base + (kb // 16)[None, :] * stride_sk, mask=m2, other=127)
            codes = packed.to(tl.int32)
            lo = _mxfp4_dequant(codes & 15, scale, x_dtype)
            hi = _mxfp4_dequant(codes >> 4, scale, x_dtype)
            x_mask = x_valid[None, :] & kb_mask[:, None]
            x_even = tl.load(x_ptr + x_rows[None, :] * stride_xt + 2 * kb[:, None], mask=x_mask, other=0.0)
            x_odd = tl.load(x_ptr + x_rows[None, :] * stride_xt + 2 * kb[:, None] + 1, mask=x_mask, other=0.0)
            acc += tl.dot(lo, x_even.to(x_dtype)) + tl.dot(hi, x_odd.to(x_dtype))
    else:
        kk = k0 + tl.arange(0, BLOCK_K)
        k_mask = kk < K
        w = tl.load(w_base + kk[None, :], mask=n_mask[:, None] & k_mask[None, :], other=0.0)
        if PAIRS_MAJOR:
            xk = tl.load(x_ptr + x_rows[:, None] * stride_xt + kk[None, :],
                         mask=x_valid[:, None] & k_mask[None, :], other=0.0)
        else:
            xk = tl.load(x_ptr + x_rows[None, :] * stride_xt + kk[:, None],
                         mask=x_valid[None, :] & k_mask[:, None], other=0.0)
        if X_SCALED and FORMAT != 2:
            # summed inside the dot: an FP8 dot's result added afterwards is not folded into it (its
            # accumulation is not float32's), so each K step's wgmma was waited for before the next
            acc = _oriented_dot(w, xk, acc, PAIRS_MAJOR)
        elif FORMAT == 2:
            # BLOCK_K divides SBK, so one K step lies inside one scale block
            part = _oriented_dot(w if X_SCALED else _to_dot_dtype(w, x_dtype), xk, None, PAIRS_MAJOR)
            s = tl.load(s_ptr + e.to(tl.int64) * stride_se + (n // SBN) * stride_sn + (k0 // SBK) * stride_sk,
                        mask=n_mask, other=0.0)
            acc += part * along_n(s, PAIRS_MAJOR)
        else:
            acc += _oriented_dot(_to_dot_dtype(w, x_dtype), xk, None, PAIRS_MAJOR)
    return acc


@triton.jit
def _row_scale(acc, s_ptr, e, n, n_mask, stride_se, stride_sn, FORMAT: tl.constexpr,
               PAIRS_MAJOR: tl.constexpr = False):
    if FORMAT == 1:
        s = tl.load(s_ptr + e.to(tl.int64) * stride_se + n * stride_sn, mask=n_mask, other=0.0)
        acc = acc * along_n(s, PAIRS_MAJOR)
    return acc


@triton.jit
def glu_tile(acc_g, acc_u, bg_ptr, bu_ptr, stride_be, stride_bn, e, n, n_mask, alpha, limit,
             ACT: tl.constexpr, HAS_BIAS: tl.constexpr, PAIRS_MAJOR: tl.constexpr = False):
    """Gate and up tiles [BLOCK_N, BLOCK_M] (PAIRS_MAJOR: [BLOCK_M, BLOCK_N]; float32, rows n of
    expert e) -> act(gate + bias, up + bias). ACT 0: silu(gate) * up; 1: gpt-oss clamped SwiGLU."""
    if HAS_BIAS:
        b_off = e.to(tl.int64) * stride_be + n * stride_bn
        acc_g += along_n(tl.load(bg_ptr + b_off, mask=n_mask, other=0.0).to(tl.float32), PAIRS_MAJOR)
        acc_u += along_n(tl.load(bu_ptr + b_off, mask=n_mask, other=0.0).to(tl.float32), PAIRS_MAJOR)
    if ACT == 0:
        return acc_g * tl.sigmoid(acc_g) * acc_u
    else:
        # gpt-oss clamped SwiGLU (models.md C.4): gate clamped from above only, `up + 1`
        g = tl.minimum(acc_g, limit)
        u = tl.minimum(tl.maximum(acc_u, -limit), limit)
        return g * tl.sigmoid(alpha * g) * (u + 1.0)


@triton.jit
def moe_gate_up_kernel(
        x_ptr, stride_xt,
        wg_ptr, wu_ptr, stride_we, stride_wn,
        sg_ptr, su_ptr, stride_se, stride_sn, stride_sk,
        bg_ptr, bu_ptr, stride_be, stride_bn,
        out_ptr, stride_ot,
        sorted_ids_ptr, block_expert_ptr, num_pairs, N, K, top_k, alpha, limit, xs_ptr,
        FORMAT: tl.constexpr, MX_DOT_SCALED: tl.constexpr, SBN: tl.constexpr, SBK: tl.constexpr,
        X_FMT: tl.constexpr, ACT: tl.constexpr, HAS_BIAS: tl.constexpr,
        BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, X_SCALED: tl.constexpr = False,
        PAIRS_MAJOR: tl.constexpr = False):
    """out[p, n] = act(gate_p[n], up_p[n]) with gate_p = Wg[e] @ x[p // top_k] (+ bias). X_SCALED: x
    holds e4m3 rows, x[t] * xs[t] the token's activations (FP8 weights only). PAIRS_MAJOR: the
    tile's orientation (module docstring; not MXFP4)."""
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    e = tl.load(block_expert_ptr + pid_m)
    if e < 0:
        return
    pairs = tl.load(sorted_ids_ptr + pid_m * BLOCK_M + tl.arange(0, BLOCK_M))
    valid = pairs < num_pairs
    tokens = tl.where(valid, pairs // top_k, 0).to(tl.int64)
    n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    n_mask = n < N

    acc_g = tile_zeros(BLOCK_M, BLOCK_N, PAIRS_MAJOR)
    acc_u = tile_zeros(BLOCK_M, BLOCK_N, PAIRS_MAJOR)
    for k0 in range(0, K, BLOCK_K):
        acc_g = _weight_dot(acc_g, wg_ptr, sg_ptr, e, n, n_mask, k0, K, x_ptr, tokens, valid, stride_xt,
                            stride_we, stride_wn, stride_se, stride_sn, stride_sk,
                            FORMAT, MX_DOT_SCALED, SBN, SBK, BLOCK_K, X_FMT, X_SCALED, PAIRS_MAJOR)
        acc_u = _weight_dot(acc_u, wu_ptr, su_ptr, e, n, n_mask, k0, K, x_ptr, tokens, valid, stride_xt,
                            stride_we, stride_wn, stride_se, stride_sn, stride_sk,
                            FORMAT, MX_DOT_SCALED, SBN, SBK, BLOCK_K, X_FMT, X_SCALED, PAIRS_MAJOR)
    acc_g = _row_scale(acc_g, sg_ptr, e, n, n_mask, stride_se, stride_sn, FORMAT, PAIRS_MAJOR)
    acc_u = _row_scale(acc_u, su_ptr, e, n, n_mask, stride_se, stride_sn, FORMAT, PAIRS_MAJOR)
    if X_SCALED:
        xs = along_m(tl.load(xs_ptr + tokens, mask=valid, other=0.0), PAIRS_MAJOR)
        acc_g *= xs
        acc_u *= xs
    h = glu_tile(acc_g, acc_u, bg_ptr, bu_ptr, stride_be, stride_bn, e, n, n_mask, alpha, limit, ACT, HAS_BIAS,
                 PAIRS_MAJOR)
    out_ptrs = out_ptr + along_m(pairs.to(tl.int64) * stride_ot, PAIRS_MAJOR) + along_n(n, PAIRS_MAJOR)
    tl.store(out_ptrs, h.to(out_ptr.dtype.element_ty),
             mask=along_m(valid, PAIRS_MAJOR) & along_n(n_mask, PAIRS_MAJOR))


@triton.jit
def moe_down_kernel(
        a_ptr, stride_at,
        w_ptr, stride_we, stride_wn,
        s_ptr, stride_se, stride_sn, stride_sk,
        b_ptr, stride_be,
        pair_weights_ptr, out_ptr, stride_ot,
        sorted_ids_ptr, block_expert_ptr, num_pairs, N, K, as_ptr,
        FORMAT: tl.constexpr, MX_DOT_SCALED: tl.constexpr, SBN: tl.constexpr, SBK: tl.constexpr,
        X_FMT: tl.constexpr, HAS_BIAS: tl.constexpr,
        BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, X_SCALED: tl.constexpr = False,
        PAIRS_MAJOR: tl.constexpr = False):
    """out[p, n] = w_p * (Wd[e] @ a[p] + bd[e])[n], summed in float32 and stored in out's dtype
    (float32 or bf16), one row per (token, expert) pair.
    X_SCALED: a holds e4m3 rows, a[p] * as[p] the pair's activations (FP8 weights only).
    PAIRS_MAJOR: the tile's orientation (module docstring; not MXFP4)."""
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    e = tl.load(block_expert_ptr + pid_m)
    if e < 0:
        return
    pairs = tl.load(sorted_ids_ptr + pid_m * BLOCK_M + tl.arange(0, BLOCK_M))
    valid = pairs < num_pairs
    rows = tl.where(valid, pairs, 0).to(tl.int64)
    n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    n_mask = n < N

    acc = tile_zeros(BLOCK_M, BLOCK_N, PAIRS_MAJOR)
    for k0 in range(0, K, BLOCK_K):
        acc = _weight_dot(acc, w_ptr, s_ptr, e, n, n_mask, k0, K, a_ptr, rows, valid, stride_at,
                          stride_we, stride_wn, stride_se, stride_sn, stride_sk,
                          FORMAT, MX_DOT_SCALED, SBN, SBK, BLOCK_K, X_FMT, X_SCALED, PAIRS_MAJOR)
    acc = _row_scale(acc, s_ptr, e, n, n_mask, stride_se, stride_sn, FORMAT, PAIRS_MAJOR)
    if X_SCALED:
        acc *= along_m(tl.load(as_ptr + rows, mask=valid, other=0.0), PAIRS_MAJOR)
    if HAS_BIAS:
        acc += along_n(tl.load(b_ptr + e.to(tl.int64) * stride_be + n, mask=n_mask, other=0.0).to(tl.float32),
                       PAIRS_MAJOR)
    gate = tl.load(pair_weights_ptr + rows, mask=valid, other=0.0)
    acc = acc * along_m(gate, PAIRS_MAJOR)
    out_ptrs = out_ptr + along_m(rows * stride_ot, PAIRS_MAJOR) + along_n(n, PAIRS_MAJOR)
    tl.store(out_ptrs, acc.to(out_ptr.dtype.element_ty),
             mask=along_m(valid, PAIRS_MAJOR) & along_n(n_mask, PAIRS_MAJOR))


@triton.jit
def moe_combine_kernel(y_ptr, ids_ptr, out_ptr, H, TOP_K: tl.constexpr, BLOCK_H: tl.constexpr):
    """out[t, :] = sum_j y[t * TOP_K + j, :] (y float32 or bf16 [T*k, H]), summed in float32 and
    cast to out's dtype, over the
    pairs whose expert id (ids [T*k]) is not -1: those rows were never written. Fixed summation
    order."""
    t = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    mask = h < H
    acc = token_rows_sum(y_ptr, H, ids_ptr, t, h, mask, TOP_K, "")
    tl.store(out_ptr + t * H + h, acc.to(out_ptr.dtype.element_ty), mask=mask)


@triton.jit
def token_rows_sum(y_ptr, stride_yt, ids_ptr, t, h, mask, TOP_K: tl.constexpr, CACHE: tl.constexpr):
    """Columns h of token t's TOP_K rows of y (float32 or bf16 [T*k, H], row stride stride_yt) added in
    pair order, skipping pairs of expert -1 (ids [T*k]), whose rows were never written. CACHE:
    the loads' cache modifier (".cg", past L1, for rows written by other programs of the same
    launch)."""
    acc = tl.zeros(h.shape, dtype=tl.float32)
    for j in tl.static_range(TOP_K):
        row = t * TOP_K + j
        # broadcast to a tensor: Triton 3.9's interpreter rejects a tensor & scalar mask
        here = (h * 0 + tl.load(ids_ptr + row)) >= 0
        acc += tl.load(y_ptr + row.to(tl.int64) * stride_yt + h, mask=mask & here, other=0.0,
                       cache_modifier=CACHE).to(tl.float32)
    return acc
