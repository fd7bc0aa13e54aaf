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

Activation order: register r_i pairs codes (i, i + 4) of every word, so a K step's registers r_i
of all its words form one [BLOCK_N, BLOCK_K / 4] operand whose column 8 g + 2 j + h holds k =
32 g + 8 j + 4 h + i of the step (group g, word j, half h). The activations are stored
"chunk-major" to match (chunk_order): each BLOCK_K-wide chunk of a row as its four quarters i one
after another, rows padded with zeros to whole chunks, so that each quarter's dot reads one
contiguous slice; one torch copy reorders x, and the gate/up kernel writes its output in the down
kernel's chunk order. Tiles of 64 pairs and more (prefill) lay the four operands side by side
(r_0 | r_1 | r_2 | r_3) and take the whole step in one dot, so the compiler issues its wgmma
instructions back to back and waits once; with four dots it waited after each.

Before Hopper (ASM_DECODE=False: Ampere and Ada have no mul.bf16x2) the codes are decoded to
float32 and scaled there (exact), then rounded to bf16 (exact: two significant bits) for the same
dot. Under TRITON_INTERPRET the assembly cannot run either (and bf16 arithmetic is unreliable
there): the kernels take that float32 decode and multiply in float32 (INTERPRET=True), with the
same loads, orders and masks.
"""
from __future__ import annotations

import torch
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
    """Position of element k of a chunk of `size` (a multiple of 32) when its four quarters
    (k % 4 = 0..3) are laid one after another, each in the order of the 32-value groups."""
    return (k % 4) * (size // 4) + 8 * (k // 32) + 2 * ((k // 8) % 4) + (k // 4) % 2


def chunk_order(k: int, chunk: int) -> int:
    """Position of element k of a row in the chunk-major order: each chunk of `chunk` elements
    (a K step of the kernels) in quarter_order of its own; rows are padded to whole chunks."""
    return (k // chunk) * chunk + quarter_order(k % chunk, chunk)


def chunk_major(x: torch.Tensor, chunk: int) -> torch.Tensor:
    """x [T, K] -> [T, K rounded up to whole chunks] in chunk_order (the kernels' activations), zeros
    past K: within each chunk, element 32 g + 8 j + 4 h + q goes to q * chunk / 4 + 8 g + 2 j + h."""
    t, k = x.shape
    padded = triton.cdiv(k, chunk) * chunk
    if padded != k:
        x = torch.nn.functional.pad(x, (0, padded - k))
    return x.reshape(t, padded // chunk, chunk // 32, 4, 2, 4).permute(0, 1, 5, 2, 3, 4).reshape(t, padded)


@triton.jit
def _quarter_pos(k, size: tl.constexpr):
    """quarter_order for tensors of indices."""
    return (k % 4) * (size // 4) + 8 * (k // 32) + 2 * ((k // 8) % 4) + (k // 4) % 2


@triton.jit
def _chunk_pos(k, CHUNK: tl.constexpr):
    """chunk_order for tensors of indices."""
    return (k // CHUNK) * CHUNK + _quarter_pos(k % CHUNK, CHUNK)


@triton.jit
def _quarters(a0, a1, a2, a3):
    """Four [BN, C] -> [BN, 4 C], a0 | a1 | a2 | a3 along the columns."""
    a = tl.join(tl.join(a0, a1), tl.join(a2, a3))  # [BN, C, 2 (low bit of the quarter), 2 (high bit)]
    a = tl.permute(a, (0, 3, 2, 1))
    return tl.reshape(a, (a.shape[0], a.shape[1] * a.shape[2] * a.shape[3]))


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
               INTERPRET: tl.constexpr, ASM_DECODE: tl.constexpr, BLOCK_K: tl.constexpr, ONE_DOT: tl.constexpr):
    """acc [BN, BM] += this K chunk of W (rows n of expert e) @ the chunk's activations. x_rows
    [1, BM]: pointers to each pair's chunk-major activation row; x_mask [1, BM]: real pairs.
    ONE_DOT: the step as one dot, else as four of a quarter each. With the assembly decode
    (ASM_DECODE, compiled) acc holds the sums times 2^-64 (UNSCALE)."""
    w, scale = _mx_words_raw(w_ptr, s_ptr, e, n, n_mask, k0, K, stride_we, stride_wn, stride_se, stride_sn,
                             stride_sk, BLOCK_K)
    QUARTER: tl.constexpr = BLOCK_K // 4
    if INTERPRET or not ASM_DECODE:
        mult = ((scale.to(tl.int32) + 14) << 23).to(tl.float32, bitcast=True)[:, :, None]
        a0 = _interleave(_code_f32(w, 0, mult), _code_f32(w, 4, mult))
        a1 = _interleave(_code_f32(w, 1, mult), _code_f32(w, 5, mult))
        a2 = _interleave(_code_f32(w, 2, mult), _code_f32(w, 6, mult))
        a3 = _interleave(_code_f32(w, 3, mult), _code_f32(w, 7, mult))
        if not INTERPRET:
            a0, a1, a2, a3 = a0.to(tl.bfloat16), a1.to(tl.bfloat16), a2.to(tl.bfloat16), a3.to(tl.bfloat16)
    else:
        m = (scale.to(tl.int32) + 62) << 7
        m = (m | (m << 16))[:, :, None] + tl.zeros((1, 1, 4), dtype=tl.int32)
        r0, r1, r2, r3 = tl.inline_asm_elementwise(_DECODE_ASM, _DECODE_CONSTRAINTS, [w, m],
                                                   dtype=(tl.int32, tl.int32, tl.int32, tl.int32), is_pure=True,
                                                   pack=1)
        a0, a1, a2, a3 = _bf16_halves(r0), _bf16_halves(r1), _bf16_halves(r2), _bf16_halves(r3)
    if ONE_DOT:
        x = tl.load(x_rows + (k0 + tl.arange(0, BLOCK_K))[:, None], mask=x_mask, other=0.0)
        if INTERPRET:
            x = x.to(tl.float32)
        acc = tl.dot(_quarters(a0, a1, a2, a3), x, acc)
    else:
        x_ptrs = x_rows + (k0 + tl.arange(0, QUARTER))[:, None]
        x0 = tl.load(x_ptrs, mask=x_mask, other=0.0)
        x1 = tl.load(x_ptrs + QUARTER, mask=x_mask, other=0.0)
        x2 = tl.load(x_ptrs + 2 * QUARTER, mask=x_mask, other=0.0)
        x3 = tl.load(x_ptrs + 3 * QUARTER, mask=x_mask, other=0.0)
        if INTERPRET:
            x0, x1, x2, x3 = x0.to(tl.float32), x1.to(tl.float32), x2.to(tl.float32), x3.to(tl.float32)
        acc = tl.dot(a0, x0, acc)
        acc = tl.dot(a1, x1, acc)
        acc = tl.dot(a2, x2, acc)
        acc = tl.dot(a3, x3, acc)
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
        OUT_CHUNK: tl.constexpr, ONE_DOT: tl.constexpr, ASM_DECODE: tl.constexpr = True):
    """Program (M-block of one expert's pairs, n-block): out[p, chunk_pos(n)] = act(gate, up)
    (bf16 [pairs, N rounded up to OUT_CHUNK], chunk-major in chunks of OUT_CHUNK, the down
    kernel's K step) with gate = Wg[e, n] . x[p // top_k] (+ bias). xq: bf16 activations [T, K
    rounded up to BLOCK_K], chunk-major in chunks of BLOCK_K; wg / wu: int32 views of the codes
    [E, N, K / 8], strides in 16-byte groups. ACT 0: silu(gate) * up; 1: gpt-oss clamped SwiGLU."""
    e, pairs, valid = _block_pairs(sorted_ids_ptr, block_expert_ptr, tl.program_id(0), num_pairs, True, BLOCK_M)
    if e < 0:
        return
    tokens = tl.where(valid, pairs // top_k, 0).to(tl.int64)
    n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    n_mask = n < N
    x_rows = (xq_ptr + tokens * (tl.cdiv(K, BLOCK_K) * BLOCK_K))[None, :]
    x_mask = valid[None, :]
    acc_g = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
    acc_u = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
    # with the loop known to run, the compiler keeps the MMAs asynchronous (ptxas serialises
    # them when the accumulators are also defined on a path that skips the loop)
    tl.assume(K > 0)
    for k0 in tl.range(0, K, BLOCK_K, num_stages=STAGES):
        acc_g = _mma_chunk(acc_g, wg_ptr, sg_ptr, e, n, n_mask, k0, K, x_rows, x_mask, stride_we, stride_wn,
                           stride_se, stride_sn, stride_sk, INTERPRET, ASM_DECODE, BLOCK_K, ONE_DOT)
        acc_u = _mma_chunk(acc_u, wu_ptr, su_ptr, e, n, n_mask, k0, K, x_rows, x_mask, stride_we, stride_wn,
                           stride_se, stride_sn, stride_sk, INTERPRET, ASM_DECODE, BLOCK_K, ONE_DOT)
    if ASM_DECODE and not INTERPRET:
        acc_g = acc_g * UNSCALE
        acc_u = acc_u * UNSCALE
    h = glu_tile(acc_g, acc_u, bg_ptr, bu_ptr, stride_be, stride_bn, e, n, n_mask, alpha, limit, ACT, HAS_BIAS)
    out_row = tl.cdiv(N, OUT_CHUNK) * OUT_CHUNK
    out_ptrs = out_ptr + pairs[None, :].to(tl.int64) * out_row + _chunk_pos(n, OUT_CHUNK)[:, None]
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
        ONE_DOT: tl.constexpr, ASM_DECODE: tl.constexpr = True):
    """Program (M-block of one expert's pairs, n-block): y[p, n] = pair weight * (Wd[e, n] . a[p]
    + bias[e, n]) in float32. aq: the gate/up output [pairs, K rounded up to BLOCK_K], chunk-major
    in chunks of BLOCK_K."""
    e, pairs, valid = _block_pairs(sorted_ids_ptr, block_expert_ptr, tl.program_id(0), num_pairs, True, BLOCK_M)
    if e < 0:
        return
    rows = tl.where(valid, pairs, 0).to(tl.int64)
    n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    n_mask = n < N
    a_rows = (aq_ptr + rows * (tl.cdiv(K, BLOCK_K) * BLOCK_K))[None, :]
    acc = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
    tl.assume(K > 0)  # as in the gate/up kernel
    for k0 in tl.range(0, K, BLOCK_K, num_stages=STAGES):
        acc = _mma_chunk(acc, w_ptr, s_ptr, e, n, n_mask, k0, K, a_rows, valid[None, :], stride_we, stride_wn,
                         stride_se, stride_sn, stride_sk, INTERPRET, ASM_DECODE, BLOCK_K, ONE_DOT)
    if ASM_DECODE and not INTERPRET:
        acc = acc * UNSCALE
    if HAS_BIAS:
        acc += tl.load(b_ptr + e.to(tl.int64) * stride_be + n, mask=n_mask, other=0.0).to(tl.float32)[:, None]
    acc = acc * tl.load(pair_weights_ptr + rows, mask=valid, other=0.0)[None, :]
    tl.store(y_ptr + rows[None, :] * stride_yt + n[:, None], acc.to(y_ptr.dtype.element_ty),
             mask=valid[None, :] & n_mask[:, None])
