"""MXFP4 MoE GEMMs on the tensor cores: each expert's weights decoded once for all of its pairs.

The row kernels (moe_gemv_half2.py) decode every weight once per (token, expert) pair. From two
pairs per expert on (on average over all experts), decoding each expert's rows once and
multiplying them against all of its pairs on the tensor cores is faster (bench/NOTES-moe.md,
"Tensor-core MXFP4"; at one pair per expert the two are even). Programs take BLOCK_M pairs of one
expert (grouped by moe_align) and BLOCK_N output rows, and compute out^T [BLOCK_N, BLOCK_M] =
W [BLOCK_N, K] @ X^T [K, BLOCK_M], the decoded weights being the register operand of the MMA.

Decode (per int32 word of 8 codes, code i in bits 4i..4i+3): four bf16x2 registers r_i holding
codes i and i + 4 (i = 0..3); the E2M1 bits e1 e0 m go to bf16 bits 8..6 and the sign to bit 15,
so each half reads as the code's value times 2^-126 (code 0.5 is a bf16 subnormal, which the
multiply below keeps: tested on the H200), about 4 integer operations per register. One packed
multiply (mul.rn.bf16x2) by 2^(s - 65), built from the E8M0 scale s, makes it value * 2^(s - 127)
* 2^-64 exactly; the accumulator is multiplied by 2^64 once at the end. Exact and tested for
scales 66..192 (2^-61..2^65; checkpoints use scales near 127); above 192 the multiplier
overflows, below 66 the smallest products are bf16 subnormals (untested).

Activation order: register r_i pairs codes (i, i + 4) of every word, so one dot per i takes the
activations at k = 32 g + 8 j + 4 h + i (group g, word j, half h) as its K column 8 g + 2 j + h.
Activations are therefore stored "quarter-major" (quarter_order): element k of a row at
(k % 4) * (K / 4) + 8 (k // 32) + 2 ((k // 8) % 4) + (k // 4) % 2; the gate/up kernel writes
its output for the down kernel in that order.

Before Hopper (ASM_DECODE=False: Ampere and Ada have no mul.bf16x2) the codes are decoded to
float32 and scaled there (exact), then rounded to bf16 (exact: two significant bits) for the same
dots in the same order, so the sums are those of the assembly. Under TRITON_INTERPRET the
assembly cannot run either (and bf16 arithmetic is unreliable there): the kernels take that
float32 decode and multiply in float32 (INTERPRET=True), with the same loads, orders and masks.
"""
from __future__ import annotations

import triton
import triton.language as tl

from .moe_gemm import glu_tile
from .moe_gemv import _block_pairs, _e2m1_f32
from .moe_gemv_words import _mx_words_raw

# word $4, multiplier $5 (bf16x2, both halves 2^(s - 65)) -> $0..$3: codes (i, i + 4) as bf16x2
_DECODE_ASM = tl.constexpr("""{
.reg .b32 a, b;
shl.b32 a, $4, 6; and.b32 a, a, 0x01C001C0; shl.b32 b, $4, 12; and.b32 b, b, 0x80008000; or.b32 a, a, b;
mul.rn.bf16x2 $0, a, $5;
shl.b32 a, $4, 2; and.b32 a, a, 0x01C001C0; shl.b32 b, $4, 8; and.b32 b, b, 0x80008000; or.b32 a, a, b;
mul.rn.bf16x2 $1, a, $5;
shr.b32 a, $4, 2; and.b32 a, a, 0x01C001C0; shl.b32 b, $4, 4; and.b32 b, b, 0x80008000; or.b32 a, a, b;
mul.rn.bf16x2 $2, a, $5;
shr.b32 a, $4, 6; and.b32 a, a, 0x01C001C0; and.b32 b, $4, 0x80008000; or.b32 a, a, b;
mul.rn.bf16x2 $3, a, $5;
}""")
_DECODE_CONSTRAINTS = tl.constexpr("=r,=r,=r,=r,r,r")
UNSCALE = tl.constexpr(2.0 ** 64)  # the decoded weights are value * 2^-64


def quarter_order(k: int, size: int) -> int:
    """Position of element k of a row of `size` (a multiple of 32) in the quarter-major order."""
    return (k % 4) * (size // 4) + 8 * (k // 32) + 2 * ((k // 8) % 4) + (k // 4) % 2


@triton.jit
def _quarter_pos(k, size):
    """quarter_order for tensors of indices."""
    return (k % 4) * (size // 4) + 8 * (k // 32) + 2 * ((k // 8) % 4) + (k // 4) % 2


@triton.jit
def _interleave(lo, hi):
    """lo, hi [BN, G, 4] -> [BN, 8 G], column 8 g + 2 j + h from (lo, hi)[h][:, g, j]."""
    pairs = tl.join(lo, hi)
    return tl.reshape(pairs, (pairs.shape[0], pairs.shape[1] * pairs.shape[2] * 2))


@triton.jit
def _bf16_halves(r):
    """int32 [BN, G, 4] of bf16x2 -> bf16 [BN, 8 G] (low half first)."""
    lo = r.to(tl.int16).to(tl.bfloat16, bitcast=True)
    hi = (r >> 16).to(tl.int16).to(tl.bfloat16, bitcast=True)
    return _interleave(lo, hi)


@triton.jit
def _code_f32(w, i: tl.constexpr, mult):
    """Code i of each word (int32 [BN, G, 4]) times mult (float32 [BN, G, 1])."""
    return _e2m1_f32((w >> (4 * i)) & 15) * mult


@triton.jit
def _mma_chunk(acc, w_ptr, s_ptr, e, n, n_mask, k0, K, x_rows, x_mask,
               stride_we, stride_wn, stride_se, stride_sn, stride_sk,
               INTERPRET: tl.constexpr, ASM_DECODE: tl.constexpr, BLOCK_K: tl.constexpr):
    """acc [BN, BM] += this K chunk of W (rows n of expert e) @ the chunk's activations. x_rows
    [1, BM]: pointers to each pair's quarter-major activation row; x_mask [1, BM]: real pairs.
    With the assembly decode (ASM_DECODE, compiled) acc holds the sums times 2^-64 (UNSCALE)."""
    G: tl.constexpr = BLOCK_K // 32
    w, scale = _mx_words_raw(w_ptr, s_ptr, e, n, n_mask, k0, K, stride_we, stride_wn, stride_se, stride_sn,
                             stride_sk, BLOCK_K)
    c = tl.arange(0, 8 * G)
    quarter = K // 4
    col = k0 // 4 + c
    x_ptrs = x_rows + col[:, None]
    x_ok = x_mask & (col < quarter)[:, None]
    if INTERPRET or not ASM_DECODE:
        mult = ((scale.to(tl.int32) + 14) << 23).to(tl.float32, bitcast=True)[:, :, None]
        for i in tl.static_range(4):
            a = _interleave(_code_f32(w, i, mult), _code_f32(w, i + 4, mult))
            xi = tl.load(x_ptrs + i * quarter, mask=x_ok, other=0.0)
            if INTERPRET:
                acc = tl.dot(a, xi.to(tl.float32), acc)
            else:
                acc = tl.dot(a.to(tl.bfloat16), xi, acc)
    else:
        m = (scale.to(tl.int32) + 62) << 7
        m = (m | (m << 16))[:, :, None] + tl.zeros((1, 1, 4), dtype=tl.int32)
        r0, r1, r2, r3 = tl.inline_asm_elementwise(_DECODE_ASM, _DECODE_CONSTRAINTS, [w, m],
                                                   dtype=(tl.int32, tl.int32, tl.int32, tl.int32), is_pure=True,
                                                   pack=1)
        acc = tl.dot(_bf16_halves(r0), tl.load(x_ptrs, mask=x_ok, other=0.0), acc)
        acc = tl.dot(_bf16_halves(r1), tl.load(x_ptrs + quarter, mask=x_ok, other=0.0), acc)
        acc = tl.dot(_bf16_halves(r2), tl.load(x_ptrs + 2 * quarter, mask=x_ok, other=0.0), acc)
        acc = tl.dot(_bf16_halves(r3), tl.load(x_ptrs + 3 * quarter, mask=x_ok, other=0.0), acc)
    return acc


@triton.jit(do_not_specialize=["stride_sn", "su_ptr"])  # scale rows: see moe_gemv_half2.py
def moe_gate_up_mma_kernel(
        xq_ptr,
        wg_ptr, wu_ptr, stride_we, stride_wn,
        sg_ptr, su_ptr, stride_se, stride_sn, stride_sk,
        bg_ptr, bu_ptr, stride_be, stride_bn,
        out_ptr, sorted_ids_ptr, block_expert_ptr, num_pairs, N, K, top_k, alpha, limit,
        ACT: tl.constexpr, HAS_BIAS: tl.constexpr, INTERPRET: tl.constexpr,
        BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, STAGES: tl.constexpr,
        ASM_DECODE: tl.constexpr = True):
    """Program (M-block of one expert's pairs, n-block): out[p, quarter_pos(n)] = act(gate, up)
    (bf16, quarter-major [pairs, N]) with gate = Wg[e, n] . x[p // top_k] (+ bias). xq: bf16
    activations [T, K] in quarter-major order; wg / wu: int32 views of the codes [E, N, K / 8],
    strides in 16-byte groups. ACT 0: silu(gate) * up; 1: gpt-oss clamped SwiGLU."""
    e, pairs, valid = _block_pairs(sorted_ids_ptr, block_expert_ptr, tl.program_id(0), num_pairs, True, BLOCK_M)
    if e < 0:
        return
    tokens = tl.where(valid, pairs // top_k, 0).to(tl.int64)
    n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    n_mask = n < N
    x_rows = (xq_ptr + tokens * K)[None, :]
    x_mask = valid[None, :]
    acc_g = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
    acc_u = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
    for k0 in tl.range(0, K, BLOCK_K, num_stages=STAGES):
        acc_g = _mma_chunk(acc_g, wg_ptr, sg_ptr, e, n, n_mask, k0, K, x_rows, x_mask, stride_we, stride_wn,
                           stride_se, stride_sn, stride_sk, INTERPRET, ASM_DECODE, BLOCK_K)
        acc_u = _mma_chunk(acc_u, wu_ptr, su_ptr, e, n, n_mask, k0, K, x_rows, x_mask, stride_we, stride_wn,
                           stride_se, stride_sn, stride_sk, INTERPRET, ASM_DECODE, BLOCK_K)
    if ASM_DECODE and not INTERPRET:
        acc_g = acc_g * UNSCALE
        acc_u = acc_u * UNSCALE
    h = glu_tile(acc_g, acc_u, bg_ptr, bu_ptr, stride_be, stride_bn, e, n, n_mask, alpha, limit, ACT, HAS_BIAS)
    out_ptrs = out_ptr + pairs[None, :].to(tl.int64) * N + _quarter_pos(n, N)[:, None]
    tl.store(out_ptrs, h.to(out_ptr.dtype.element_ty), mask=valid[None, :] & n_mask[:, None])


@triton.jit(do_not_specialize=["stride_sn"])  # scale rows: see moe_gemv_half2.py
def moe_down_mma_kernel(
        aq_ptr,
        w_ptr, stride_we, stride_wn,
        s_ptr, stride_se, stride_sn, stride_sk,
        b_ptr, stride_be,
        pair_weights_ptr, y_ptr, stride_yt, sorted_ids_ptr, block_expert_ptr, num_pairs, N, K,
        HAS_BIAS: tl.constexpr, INTERPRET: tl.constexpr,
        BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, STAGES: tl.constexpr,
        ASM_DECODE: tl.constexpr = True):
    """Program (M-block of one expert's pairs, n-block): y[p, n] = pair weight * (Wd[e, n] . a[p]
    + bias[e, n]) in float32. aq: the gate/up output [pairs, K], quarter-major."""
    e, pairs, valid = _block_pairs(sorted_ids_ptr, block_expert_ptr, tl.program_id(0), num_pairs, True, BLOCK_M)
    if e < 0:
        return
    rows = tl.where(valid, pairs, 0).to(tl.int64)
    n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    n_mask = n < N
    a_rows = (aq_ptr + rows * K)[None, :]
    acc = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
    for k0 in tl.range(0, K, BLOCK_K, num_stages=STAGES):
        acc = _mma_chunk(acc, w_ptr, s_ptr, e, n, n_mask, k0, K, a_rows, valid[None, :], stride_we, stride_wn,
                         stride_se, stride_sn, stride_sk, INTERPRET, ASM_DECODE, BLOCK_K)
    if ASM_DECODE and not INTERPRET:
        acc = acc * UNSCALE
    if HAS_BIAS:
        acc += tl.load(b_ptr + e.to(tl.int64) * stride_be + n, mask=n_mask, other=0.0).to(tl.float32)[:, None]
    acc = acc * tl.load(pair_weights_ptr + rows, mask=valid, other=0.0)[None, :]
    tl.store(y_ptr + rows[None, :] * stride_yt + n[:, None], acc, mask=valid[None, :] & n_mask[:, None])
