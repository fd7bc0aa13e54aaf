"""MXFP4 MoE GEMMs on Hopper FP8 tensor cores: the E2M1 codes become e4m3 bytes, the activations
two e4m3 planes, one warp-group MMA per 32-value scale group.

moe_mx_mma.py decodes each expert's rows once for all of its pairs into bf16 (about 2.5 integer
operations and a paired multiply per two values, the E8M0 scale applied on the way). Here a code
s.e1e0.m becomes the e4m3 byte s.000.e1e0.m.00, the code's value times 2^-6 exactly (the
subnormal +-0.5 included), four bytes per 32-bit register in about 3.5 integer operations, and
feeds the FP8 MMA (wgmma, e4m3 x e4m3 -> float32) from registers. The E8M0 scale cannot ride on
an e4m3 byte, so each 32-value group is one MMA of K = 32 into a fresh accumulator, multiplied by
its rows' 2^(s - 127) and added to the sum (one FFMA per accumulator element and group).

Activations: e4m3 holds 3 significand bits, so each activation x (scaled per row by a power of
two 2^a that puts its largest magnitude in [128, 256)) is carried as two e4m3 values, hi =
e4m3(x 2^a) and lo = e4m3(x 2^a - hi): |x 2^a - hi - lo| <= 2^-8 |x 2^a| for normal values, bf16's
order. Each pair then takes two MMA columns (its hi and lo planes) whose sums are added at the
end; at the few pairs per expert of decode batches the MMA's N of 8-16 has room for both.
The gate/up kernel writes the GLU output the same way for the down kernel, with the fixed scale
2^ACT_EXP (gpt-oss's clamp bounds it by limit * (limit + 1)).

Order within each 32-value group (fp8_order): the MMA's A fragment gives a thread K positions
4q..4q+3 and 16+4q..16+4q+3 of its rows (q = lane % 4), so position 16 h + 4 j + b holds code
8 j + 2 b + h: a thread's two registers are the even and odd codes of one word j = q, and each word
is decoded once. Activations are stored in that order (mx_fp8_x_kernel, the gate/up output).

Layouts: codes as int32 words [E, N, K / 8] with strides in 16-byte groups (as the other MXFP4
kernels), scales uint8 [E, N, K / 32]; activations float8_e4m3fn [rows, 2, K] (plane 0 hi, 1 lo).

Under TRITON_INTERPRET the assembly cannot run: the kernels decode each code to float32 in the
same order and multiply in float32 (INTERPRET=True), with the same loads and masks.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from .moe_gemm import glu_tile
from .moe_gemv import _block_pairs, _e2m1_f32

# word $2 (codes 0..7 in nibbles) -> $0: e4m3 bytes of codes 0, 2, 4, 6; $1: of codes 1, 3, 5, 7
_E4M3_ASM = tl.constexpr("""{
.reg .b32 a, b;
shl.b32 a, $2, 2; and.b32 a, a, 0x1C1C1C1C; shl.b32 b, $2, 4; and.b32 b, b, 0x80808080; or.b32 $0, a, b;
shr.b32 a, $2, 2; and.b32 a, a, 0x1C1C1C1C; and.b32 b, $2, 0x80808080; or.b32 $1, a, b;
}""")
CODE_UNSCALE = tl.constexpr(64.0)  # e4m3 bytes hold code * 2^-6
INTERP_UNSCALE = tl.constexpr(16384.0)  # _e2m1_f32 gives code * 2^-14
X_TOP = 7  # activations scaled so that the row's largest magnitude is in [2^7, 2^8)


def fp8_order(k: int, size: int) -> int:
    """Position of element k of a row of `size` (a multiple of 32) in the order the kernels read."""
    c = k % 32
    return k - c + 16 * (c % 2) + 4 * (c // 8) + (c // 2) % 4


@triton.jit
def _fp8_pos(k):
    """fp8_order for tensors of indices."""
    c = k % 32
    return k - c + 16 * (c % 2) + 4 * (c // 8) + (c // 2) % 4


def act_exp(limit: float) -> int:
    """Power of two the GLU output is multiplied by before its e4m3 planes: the largest with
    limit * (limit + 1) * 2^a below 256 (e4m3 holds up to 448)."""
    bound = limit * (limit + 1.0)
    a = 0
    while bound * 2.0 ** (a + 1) < 256:
        a += 1
    while bound * 2.0 ** a >= 256:
        a -= 1
    return a


@triton.jit
def _e4m3_round(v):
    """float32 -> float32 rounded to the nearest e4m3 value (ties to even), for |v| < 448: one add
    and one subtract of 1.5 * 2^(23 + quantum exponent), the quantum 2^-3 of v's binade or the
    subnormal step 2^-9. The conversion that follows is then exact, which the interpreter's (a
    truncation with an unpropagated round bit) needs."""
    e = ((v.to(tl.int32, bitcast=True) >> 23) & 255) - 127
    c = (((tl.maximum(e, -6) + 147) << 23) | 0x400000).to(tl.float32, bitcast=True)
    return (v + c) - c


@triton.jit
def _hi_lo(v):
    """float32 (|v| < 448) -> (hi, lo) e4m3 with hi + lo the two-term approximation of v."""
    hi = _e4m3_round(v)
    return hi.to(tl.float8e4nv), _e4m3_round(v - hi).to(tl.float8e4nv)


@triton.jit
def mx_fp8_x_kernel(x_ptr, stride_xt, xq_ptr, inv_scale_ptr, H, BLOCK_H: tl.constexpr):
    """Program t: xq[t, 0 / 1, fp8_order(k)] = hi / lo of x[t, k] * 2^a, inv_scale[t] = 2^-a (float32),
    a chosen per row as X_TOP minus the exponent of its largest magnitude."""
    t = tl.program_id(0)
    k = tl.arange(0, BLOCK_H)
    mask = k < H
    x = tl.load(x_ptr + t.to(tl.int64) * stride_xt + k, mask=mask, other=0.0).to(tl.float32)
    amax = tl.max(tl.abs(x), axis=0)
    e = ((amax.to(tl.int32, bitcast=True) >> 23) & 255) - 127
    a = tl.minimum(tl.maximum(7 - e, -100), 100)
    scale = ((a + 127) << 23).to(tl.float32, bitcast=True)
    hi, lo = _hi_lo(x * scale)
    out = xq_ptr + t.to(tl.int64) * 2 * H + _fp8_pos(k)
    tl.store(out, hi, mask=mask)
    tl.store(out + H, lo, mask=mask)
    tl.store(inv_scale_ptr + t, ((127 - a) << 23).to(tl.float32, bitcast=True))


def mx_fp8_x_ref(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """mx_fp8_x_kernel in torch: x [T, H] -> (xq [T, 2, H] float8_e4m3fn in fp8_order, inv_scale [T])."""
    t, h = x.shape
    xf = x.to(torch.float32)
    amax = xf.abs().amax(dim=1)
    e = ((amax.view(torch.int32) >> 23) & 255) - 127
    a = (7 - e).clamp(-100, 100)
    v = xf * torch.exp2(a.to(torch.float32))[:, None]
    hi = v.to(torch.float8_e4m3fn)
    lo = (v - hi.to(torch.float32)).to(torch.float8_e4m3fn)
    order = torch.tensor([fp8_order(k, h) for k in range(h)], device=x.device)
    xq = torch.empty((t, 2, h), dtype=torch.float8_e4m3fn, device=x.device)
    xq[:, 0, order] = hi
    xq[:, 1, order] = lo
    return xq, torch.exp2(-a.to(torch.float32))


@triton.jit
def _split4(t):
    """[..., 4] -> its four slices along the last axis."""
    a, b = tl.split(tl.reshape(t, t.shape[:-1] + (2, 2)))
    t0, t2 = tl.split(a)
    t1, t3 = tl.split(b)
    return t0, t1, t2, t3


@triton.jit
def _operand(r):
    """int32 [BN, 8]: (even, odd)[h] decode of word j at column 4 h + j -> e4m3 [BN, 32], byte b of
    column c at 4 c + b (position 16 h + 4 j + b)."""
    b0 = r.to(tl.int8).to(tl.float8e4nv, bitcast=True)
    b1 = (r >> 8).to(tl.int8).to(tl.float8e4nv, bitcast=True)
    b2 = (r >> 16).to(tl.int8).to(tl.float8e4nv, bitcast=True)
    b3 = (r >> 24).to(tl.int8).to(tl.float8e4nv, bitcast=True)
    q = tl.join(tl.join(b0, b2), tl.join(b1, b3))
    return tl.reshape(q, (r.shape[0], r.shape[1] * 4))


@triton.jit
def _interp_operand(w):
    """int32 words [BN, 4] -> float32 [BN, 32], position 16 h + 4 j + b holding code 8 j + 2 b + h
    times 2^-14 (the interpreter's path)."""
    sh = 4 * (2 * tl.arange(0, 4)[None, None, None, :] + tl.arange(0, 2)[None, :, None, None])
    codes = (w[:, None, :, None] >> sh) & 15
    return tl.reshape(_e2m1_f32(codes), (w.shape[0], 32))


@triton.jit
def _group_dot(acc, w, mult, b, INTERPRET: tl.constexpr):
    """acc [BN, C] += (codes of w [BN, 4] as e4m3 or float32) @ b [32, C] * mult [BN]."""
    if INTERPRET:
        d = tl.dot(_interp_operand(w), b.to(tl.float32))
    else:
        ev, od = tl.inline_asm_elementwise(_E4M3_ASM, "=r,=r,r", [w], dtype=(tl.int32, tl.int32), is_pure=True,
                                           pack=1)
        r = tl.reshape(tl.permute(tl.join(ev, od), (0, 2, 1)), (w.shape[0], 8))
        d = tl.dot(_operand(r), b)
    return acc + d * mult[:, None]


@triton.jit
def _b_tiles(b_base, k0, K, b_ok):
    """The activation columns' four [32, C] tiles of the 128-wide K chunk at k0 (b_base [1, C])."""
    k = k0 + tl.arange(0, 32)[:, None]  # K is a multiple of 32: each tile is all in or all out
    b0 = tl.load(b_base + k, mask=b_ok & (k < K), other=0.0)
    b1 = tl.load(b_base + k + 32, mask=b_ok & (k + 32 < K), other=0.0)
    b2 = tl.load(b_base + k + 64, mask=b_ok & (k + 64 < K), other=0.0)
    b3 = tl.load(b_base + k + 96, mask=b_ok & (k + 96 < K), other=0.0)
    return b0, b1, b2, b3


@triton.jit
def _chunk(acc, w_ptr, row_groups, s_base, stride_sk, k0, K, b0, b1, b2, b3, INTERPRET: tl.constexpr):
    """acc [BN, C] += the 128-wide K chunk at k0 of the rows (row_groups: their first 16-byte
    group; s_base: their scale pointers) against the activation tiles b0..b3 [32, C]."""
    g = k0 // 32 + tl.arange(0, 4)
    g_ok = g < K // 32
    w = tl.load(w_ptr + (row_groups[:, None, None] + g[None, :, None]) * 4 + tl.arange(0, 4)[None, None, :],
                mask=g_ok[None, :, None], other=0)
    scale = tl.load(s_base[:, None] + g[None, :] * stride_sk, mask=g_ok[None, :], other=0)
    mult = (scale.to(tl.int32) << 23).to(tl.float32, bitcast=True)
    # [BN, G, 4] words -> four [BN, 4]; [BN, G] multipliers -> four [BN]
    w0, w1, w2, w3 = _split4(tl.permute(w, (0, 2, 1)))
    m0, m1, m2, m3 = _split4(mult)
    acc = _group_dot(acc, w0, m0, b0, INTERPRET)
    acc = _group_dot(acc, w1, m1, b1, INTERPRET)
    acc = _group_dot(acc, w2, m2, b2, INTERPRET)
    acc = _group_dot(acc, w3, m3, b3, INTERPRET)
    return acc


@triton.jit
def _columns(sorted_ids_ptr, pid_m, num_pairs, rows_of_pairs, K, BLOCK_M: tl.constexpr):
    """The MMA's 2 BLOCK_M columns: pair m's hi plane at 2 m, lo at 2 m + 1 -> (pointer offsets
    [1, C] of each column's plane row in a [rows, 2, K] buffer, real-pair mask [1, C]).
    rows_of_pairs: activations indexed by token (pair // top_k; pass top_k) or by pair (pass 1)."""
    c = tl.arange(0, 2 * BLOCK_M)
    pair = tl.load(sorted_ids_ptr + pid_m * BLOCK_M + c // 2)
    ok = pair < num_pairs
    row = tl.where(ok, pair // rows_of_pairs, 0).to(tl.int64)
    return (row * (2 * K) + (c % 2) * K)[None, :], ok[None, :]


@triton.jit
def _pair_sums(acc, BLOCK_M: tl.constexpr):
    """acc [BN, 2 BLOCK_M] (hi, lo columns) -> [BN, BLOCK_M]."""
    hi, lo = tl.split(tl.reshape(acc, (acc.shape[0], BLOCK_M, 2)))
    return hi + lo


@triton.jit
def moe_gate_up_fp8_kernel(
        xq_ptr, x_inv_scale_ptr,
        wg_ptr, wu_ptr, stride_we, stride_wn,
        sg_ptr, su_ptr, stride_se, stride_sn, stride_sk,
        bg_ptr, bu_ptr, stride_be, stride_bn,
        out_ptr, act_scale, sorted_ids_ptr, block_expert_ptr, num_pairs, N, K, top_k, alpha, limit,
        ACT: tl.constexpr, HAS_BIAS: tl.constexpr, INTERPRET: tl.constexpr,
        BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, STAGES: tl.constexpr):
    """Program (M-block of one expert's pairs, n-block): out[p, 0 / 1, fp8_order(n)] = hi / lo of
    act(gate, up) * act_scale, gate = Wg[e, n] . x[p // top_k] (+ bias). xq [T, 2, K] e4m3 and
    x_inv_scale [T] from mx_fp8_x_kernel. ACT as glu_tile."""
    pid_m = tl.program_id(0)
    e, pairs, valid = _block_pairs(sorted_ids_ptr, block_expert_ptr, pid_m, num_pairs, True, BLOCK_M)
    if e < 0:
        return
    n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    n_mask = n < N
    b_off, b_ok = _columns(sorted_ids_ptr, pid_m, num_pairs, top_k, K, BLOCK_M)
    b_base = xq_ptr + b_off
    row_groups = e.to(tl.int64) * stride_we + n.to(tl.int64) * stride_wn
    sg_base = sg_ptr + e.to(tl.int64) * stride_se + n * stride_sn
    su_base = su_ptr + e.to(tl.int64) * stride_se + n * stride_sn
    acc_g = tl.zeros((BLOCK_N, 2 * BLOCK_M), dtype=tl.float32)
    acc_u = tl.zeros((BLOCK_N, 2 * BLOCK_M), dtype=tl.float32)
    for k0 in tl.range(0, K, 128, num_stages=STAGES):
        b0, b1, b2, b3 = _b_tiles(b_base, k0, K, b_ok)
        acc_g = _chunk(acc_g, wg_ptr, row_groups, sg_base, stride_sk, k0, K, b0, b1, b2, b3, INTERPRET)
        acc_u = _chunk(acc_u, wu_ptr, row_groups, su_base, stride_sk, k0, K, b0, b1, b2, b3, INTERPRET)
    tokens = tl.where(valid, pairs // top_k, 0)
    unscale = tl.load(x_inv_scale_ptr + tokens, mask=valid, other=0.0) * (INTERP_UNSCALE if INTERPRET else
                                                                           CODE_UNSCALE)
    g = _pair_sums(acc_g, BLOCK_M) * unscale[None, :]
    u = _pair_sums(acc_u, BLOCK_M) * unscale[None, :]
    h = glu_tile(g, u, bg_ptr, bu_ptr, stride_be, stride_bn, e, n, n_mask, alpha, limit, ACT, HAS_BIAS)
    hi, lo = _hi_lo(h * act_scale)
    out = out_ptr + tl.where(valid, pairs, 0).to(tl.int64)[None, :] * (2 * N) + _fp8_pos(n)[:, None]
    mask = valid[None, :] & n_mask[:, None]
    tl.store(out, hi, mask=mask)
    tl.store(out + N, lo, mask=mask)


@triton.jit
def moe_down_fp8_kernel(
        aq_ptr, a_inv_scale,
        w_ptr, stride_we, stride_wn,
        s_ptr, stride_se, stride_sn, stride_sk,
        b_ptr, stride_be,
        pair_weights_ptr, y_ptr, stride_yt, sorted_ids_ptr, block_expert_ptr, num_pairs, N, K,
        HAS_BIAS: tl.constexpr, INTERPRET: tl.constexpr,
        BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, STAGES: tl.constexpr):
    """Program (M-block of one expert's pairs, n-block): y[p, n] = pair weight * (Wd[e, n] . a[p]
    + bias[e, n]) in float32. aq: the gate/up output [pairs, 2, K] e4m3, a_inv_scale its scale's
    inverse."""
    pid_m = tl.program_id(0)
    e, pairs, valid = _block_pairs(sorted_ids_ptr, block_expert_ptr, pid_m, num_pairs, True, BLOCK_M)
    if e < 0:
        return
    rows = tl.where(valid, pairs, 0).to(tl.int64)
    n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    n_mask = n < N
    b_off, b_ok = _columns(sorted_ids_ptr, pid_m, num_pairs, 1, K, BLOCK_M)
    row_groups = e.to(tl.int64) * stride_we + n.to(tl.int64) * stride_wn
    s_base = s_ptr + e.to(tl.int64) * stride_se + n * stride_sn
    acc = tl.zeros((BLOCK_N, 2 * BLOCK_M), dtype=tl.float32)
    for k0 in tl.range(0, K, 128, num_stages=STAGES):
        b0, b1, b2, b3 = _b_tiles(aq_ptr + b_off, k0, K, b_ok)
        acc = _chunk(acc, w_ptr, row_groups, s_base, stride_sk, k0, K, b0, b1, b2, b3, INTERPRET)
    y = _pair_sums(acc, BLOCK_M) * (a_inv_scale * (INTERP_UNSCALE if INTERPRET else CODE_UNSCALE))
    if HAS_BIAS:
        y += tl.load(b_ptr + e.to(tl.int64) * stride_be + n, mask=n_mask, other=0.0).to(tl.float32)[:, None]
    y = y * tl.load(pair_weights_ptr + rows, mask=valid, other=0.0)[None, :]
    tl.store(y_ptr + rows[None, :] * stride_yt + n[:, None], y, mask=valid[None, :] & n_mask[:, None])
