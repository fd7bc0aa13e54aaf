"""MXFP4 decode-size MoE GEMVs on packed half-precision FMAs (MoeConfig.mx_half2).

The word-decode kernels (moe_gemv_words.py) spend about 5 instructions per weight value, most of
them turning codes into float32 operands. Here each int32 word of 8 codes becomes four f16x2
registers and meets the activations in four packed FMAs (fma.rn.f16x2, two products each); the
float32 side sees one sum per 32-value group (about 2.8 instructions per value in all,
bench/sass_count.py).

Decode: each code s e1 e0 m becomes the e4m3 byte s.000.e1e0.m.00, which is the code's value
times 2^-6, zero and +-0.5 (e4m3 subnormal) included, by shifts and masks on the whole word
(about 7 integer operations per word); the hardware then converts two bytes at a time to f16x2
(cvt.rn.f16x2.e4m3x2, sm_89+). The pairs of a word hold codes (0, 2), (4, 6), (1, 3), (5, 7);
activations are stored in that order (`half2_order`). Placing the bits straight into f16
patterns instead (the value times 2^-14) takes about twice the integer work and measured 10-20%
slower (bench/NOTES-moe.md).

Range: activations enter as f16 times a power of two 2^k, so that products and sums stay inside
f16's range and above its subnormals: the gate/up input is scaled per token to a largest
magnitude below 2^14 (mx_half2_x_kernel), the GLU output by a fixed 2^k from the clamp limit
(|act| <= limit * (limit + 1)). Products are then at most 6 * 2^-6 * 2^14 = 1536 and a group's 32
of them at most 49152, below f16's 65504. Each f16 lane adds at most 8 products; the group sum,
the E8M0 scale 2^(s - 127) and 2^-k are applied in float32. The GLU output kept in f16 (11-bit
mantissa) is finer than the bf16 that the reference rounds it to.

Loads: the K loop is software-pipelined STAGES deep (asynchronous copies of the words and the
activation pairs); the one-byte E8M0 scales stay ordinary loads (reading them through 32-bit
words, so that they are copied ahead too, or as words read a step ahead into registers, measured
slower: bench/NOTES-moe.md). With TMA (
MoeConfig.tma / tma_down) each whole K step is instead two bulk tensor copies per matrix, a
[BLOCK_N, BLOCK_K / 8] box of words and a [BLOCK_N, BLOCK_K / 32] box of scales, issued by one
thread into the same pipeline, so the scales are copied ahead too. The tensor-copy engine needs
row strides in multiples of 16 bytes, so the MXFP4 scale rows are stored padded to that
(engine/weights/formats.py, `aligned_scale_rows`), and boxes at least 16 bytes wide, so BLOCK_K is
a multiple of 512; boxes past the end of a row read zeros (zero codes add nothing).

Under TRITON_INTERPRET the assembly cannot run; the kernels compute the same group sums in
float32 instead (INTERPRET=True), which tests every index, order and scale around it.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from .moe_gemv import _e2m1_f32
from .moe_gemv_words import _mx_words_raw

X_MAX_EXP = 14  # scaled activations stay below 2^14 in magnitude
_PAIRS = [(0, 2), (4, 6), (1, 3), (5, 7)]  # codes of a word in its four f16x2 registers (low, high)


def half2_order() -> list[int]:
    """Position of element r (0..7) of each 8-value word in the f16 activation row."""
    pos = [0] * 8
    for p, (lo, hi) in enumerate(_PAIRS):
        pos[lo], pos[hi] = 2 * p, 2 * p + 1
    return pos


def act_scale_exp(limit: float) -> int:
    """k with limit * (limit + 1) * 2^k < 2^14: the scale of the stored GLU output."""
    k = X_MAX_EXP - 1
    while limit * (limit + 1.0) * 2.0 ** k >= 2.0 ** X_MAX_EXP:
        k -= 1
    return k


@triton.jit
def _half2_pos(n):
    """Element index n of a row -> its f16 slot in the pair order (half2_order)."""
    r = n % 8
    return n - r + (r % 2) * 4 + (r // 4) * 2 + (r // 2) % 2


# One word (register {w}) -> four f16x2 registers p0..p3 holding the codes of _PAIRS times 2^-6.
_DECODE = (
    "shl.b32 t, {w}, 2; and.b32 t, t, 0x1C1C1C1C; shl.b32 s, {w}, 4; and.b32 s, s, 0x80808080; or.b32 t, t, s;\n"
    "mov.b32 {{b0, b1}}, t; cvt.rn.f16x2.e4m3x2 p0, b0; cvt.rn.f16x2.e4m3x2 p1, b1;\n"
    "shr.b32 t, {w}, 2; and.b32 t, t, 0x1C1C1C1C; and.b32 s, {w}, 0x80808080; or.b32 t, t, s;\n"
    "mov.b32 {{b0, b1}}, t; cvt.rn.f16x2.e4m3x2 p2, b0; cvt.rn.f16x2.e4m3x2 p3, b1;\n")


def _group_asm(pairs: int = 1) -> str:
    """PTX of an elementwise op: $q (f32, q < pairs) = sum over the 4 words of a group (operands
    $pairs..$pairs+3) of their codes times pair q's f16x2 activation pairs (word j pair p: operand
    pairs + 4 + 16 q + 4 j + p). Each word is decoded once for every pair. Words 0-1 and 2-3 go to
    two packed accumulators per pair (shorter dependency chains, at most 8 products per f16 lane),
    added once before the conversion to float32."""
    def acc(q: int, half: int) -> str:
        return f"acc{half}" if pairs == 1 else f"acc{q}_{half}"

    accs = ", ".join(acc(q, half) for q in range(pairs) for half in range(2))
    lines = ["{", f".reg .b32 t, s, p0, p1, p2, p3, {accs};", ".reg .b16 b0, b1, lo, hi;",
             ".reg .f32 flo, fhi;"]
    for j in range(4):
        lines.append(_DECODE.format(w=f"${pairs + j}"))
        for q in range(pairs):
            a = acc(q, j // 2)
            for p in range(4):
                x = f"${pairs + 4 + 16 * q + 4 * j + p}"
                lines.append(f"mul.rn.f16x2 {a}, p{p}, {x};" if j % 2 == 0 and p == 0 else
                             f"fma.rn.f16x2 {a}, p{p}, {x}, {a};")
    for q in range(pairs):
        lines += [f"add.rn.f16x2 {acc(q, 0)}, {acc(q, 0)}, {acc(q, 1)};", f"mov.b32 {{lo, hi}}, {acc(q, 0)};",
                  "cvt.f32.f16 flo, lo;", "cvt.f32.f16 fhi, hi;", f"add.f32 ${q}, flo, fhi;"]
    return "\n".join(lines + ["}"])


def group_constraints(pairs: int = 1) -> str:
    """The operand constraints of _group_asm(pairs): pairs float32 outputs, 4 + 16 pairs int32 inputs."""
    return ",".join(["=f"] * pairs + ["r"] * (4 + 16 * pairs))


_GROUP_ASM = tl.constexpr(_group_asm())
_GROUP_CONSTRAINTS = tl.constexpr(group_constraints())


@triton.jit
def _f16_half(pair, HIGH: tl.constexpr):
    """One f16 half of packed pairs (int32) -> float32."""
    if HIGH:
        bits = (pair >> 16) & 0xFFFF
    else:
        bits = pair & 0xFFFF
    return bits.to(tl.uint16).to(tl.float16, bitcast=True).to(tl.float32)


@triton.jit
def _pair_ref(w, x, LO: tl.constexpr, HI: tl.constexpr):
    """codes LO and HI of each word (value * 2^-14) times the low and high f16 halves of x, in float32."""
    lo = _e2m1_f32((w >> (4 * LO)) & 15) * _f16_half(x, False)
    return lo + _e2m1_f32((w >> (4 * HI)) & 15) * _f16_half(x, True)


@triton.jit
def _word_ref(w, x0, x1, x2, x3):
    """What the assembly computes for one word, in float32: sum of code value * 2^-6 * activation."""
    acc = _pair_ref(w, x0, 0, 2) + _pair_ref(w, x1, 4, 6) + _pair_ref(w, x2, 1, 3) + _pair_ref(w, x3, 5, 7)
    return acc * 256.0  # value * 2^-14 -> value * 2^-6


@triton.jit
def _x_pairs(xq_row, k0, K, BLOCK_K: tl.constexpr, WIDE: tl.constexpr = False):
    """The f16x2 activation pairs of one K chunk: 4 int32 tensors [1, G, 4] (pair p of word w of
    group g at int32 offset (g * 4 + w) * 4 + p of the row). Past K: clamped onto the last word
    (its weights load as zero codes). WIDE: each word's four pairs in one 16-byte load, split in
    registers, instead of four loads of every fourth 32-bit word (4-byte copies); see
    MoeConfig.wide_x for where each is faster."""
    BLOCK_G: tl.constexpr = BLOCK_K // 32
    g = k0 // 32 + tl.arange(0, BLOCK_G)
    word = tl.minimum(g[:, None] * 4 + tl.arange(0, 4)[None, :], K // 8 - 1)
    if WIDE:
        x0, x1, x2, x3 = _split4(tl.load(xq_row + word[:, :, None] * 4 + tl.arange(0, 4)[None, None, :]))
        return x0[None, :, :], x1[None, :, :], x2[None, :, :], x3[None, :, :]
    base = xq_row + word * 4
    x0 = tl.load(base)[None, :, :]
    x1 = tl.load(base + 1)[None, :, :]
    x2 = tl.load(base + 2)[None, :, :]
    x3 = tl.load(base + 3)[None, :, :]
    return x0, x1, x2, x3


@triton.jit
def _split4(t):
    """[..., 4] -> its four slices [...] (elements 0, 1, 2, 3 of the last dimension)."""
    a, b = tl.split(tl.reshape(t, t.shape[:-1] + [2, 2]))
    t0, t2 = tl.split(a)
    t1, t3 = tl.split(b)
    return t0, t1, t2, t3


@triton.jit
def _pair_slots(x0, x1, x2, x3):
    """One pair's activation pairs (_x_pairs: slot p of every word of a group, [1, G, 4]) -> the
    16 operands of _group_asm, word j slot p at 4 j + p."""
    x00, x10, x20, x30 = _split4(x0)  # x{word}{slot}
    x01, x11, x21, x31 = _split4(x1)
    x02, x12, x22, x32 = _split4(x2)
    x03, x13, x23, x33 = _split4(x3)
    return x00, x01, x02, x03, x10, x11, x12, x13, x20, x21, x22, x23, x30, x31, x32, x33


@triton.jit
def _group_dot(w, x0, x1, x2, x3, INTERPRET: tl.constexpr):
    """w int32 [BN, G, 4] words of 8 codes; x0..x3 int32 [1, G, 4] the f16x2 activation pairs of
    each word -> float32 [BN, G]: per group, sum of code value * 2^-6 * activation."""
    w0, w1, w2, w3 = _split4(w)
    x00, x01, x02, x03, x10, x11, x12, x13, x20, x21, x22, x23, x30, x31, x32, x33 = _pair_slots(x0, x1, x2, x3)
    if INTERPRET:
        return (_word_ref(w0, x00, x01, x02, x03) + _word_ref(w1, x10, x11, x12, x13)
                + _word_ref(w2, x20, x21, x22, x23) + _word_ref(w3, x30, x31, x32, x33))
    else:
        return tl.inline_asm_elementwise(
            _GROUP_ASM, _GROUP_CONSTRAINTS, [w0, w1, w2, w3, x00, x01, x02, x03, x10, x11, x12, x13, x20, x21, x22,
                                             x23, x30, x31, x32, x33], dtype=tl.float32, is_pure=True, pack=1)


@triton.jit
def _scaled_sums(acc, w, scale, x0, x1, x2, x3, INTERPRET: tl.constexpr):
    """acc [BN, G] + the group sums of words w [BN, G, 4] times 2^(s - 127 + 6), from the E8M0
    exponent field of scale [BN, G] (valid for scales s <= 248)."""
    mult = ((scale.to(tl.int32) + 6) << 23).to(tl.float32, bitcast=True)
    return acc + _group_dot(w, x0, x1, x2, x3, INTERPRET) * mult


@triton.jit
def _chunk(acc, w_ptr, s_ptr, e, n, n_mask, k0, K, x0, x1, x2, x3, stride_we, stride_wn, stride_se, stride_sn,
           stride_sk, INTERPRET: tl.constexpr, BLOCK_K: tl.constexpr):
    """_scaled_sums of this K chunk of rows n, read through the pointers (past K: masked)."""
    w, scale = _mx_words_raw(w_ptr, s_ptr, e, n, n_mask, k0, K, stride_we, stride_wn, stride_se, stride_sn,
                             stride_sk, BLOCK_K)
    return _scaled_sums(acc, w, scale, x0, x1, x2, x3, INTERPRET)


@triton.jit
def tma_words(w_desc, s_desc, e, n0, k0, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    """This K chunk of BLOCK_N rows from n0 of expert e through the tensor descriptors (past K or
    N: the boxes' zero fill) -> (words int32 [BLOCK_N, G, 4], E8M0 scales [BLOCK_N, G])."""
    G: tl.constexpr = BLOCK_K // 32
    e = e.to(tl.int32)  # descriptor coordinates are 32-bit; expert ids may come as int64
    w = tl.reshape(w_desc.load([e, n0, k0 // 8]), (BLOCK_N, G, 4))
    scale = tl.reshape(s_desc.load([e, n0, k0 // 32]), (BLOCK_N, G))
    return w, scale


@triton.jit
def _tma_chunk(acc, w_desc, s_desc, e, n0, k0, x0, x1, x2, x3, INTERPRET: tl.constexpr, BLOCK_N: tl.constexpr,
               BLOCK_K: tl.constexpr):
    """_scaled_sums of this K chunk of BLOCK_N rows from n0, read through the tensor descriptors."""
    w, scale = tma_words(w_desc, s_desc, e, n0, k0, BLOCK_N, BLOCK_K)
    return _scaled_sums(acc, w, scale, x0, x1, x2, x3, INTERPRET)


@triton.jit
def _whole_steps_end(K, BLOCK_K: tl.constexpr, TAIL_K: tl.constexpr):
    """Where the pipelined BLOCK_K steps stop: the end of the last whole one, the rest going in
    TAIL_K steps; with TAIL_K 0 at K, the last step running past it."""
    if TAIL_K > 0:
        return K - K % BLOCK_K
    else:
        return K


@triton.jit
def store_half2_row(x, offs, mask, xq_row_ptr, inv_scale_ptr):
    """One activation row x [BLOCK] (float32, 0 where masked) -> f16 x * 2^k in pair order at
    xq_row_ptr and 2^-k (float32) at inv_scale_ptr, k chosen so the largest |x| * 2^k is below
    2^14: the packed-f16 kernels' input (half2_input_ref)."""
    amax = tl.max(tl.abs(x), axis=0)
    top = ((amax.to(tl.int32, bitcast=True) >> 23) & 0xFF) - 127  # floor(log2(amax)) for normal amax
    k = tl.minimum(tl.maximum(13 - top, -100), 100)
    scale = ((k + 127) << 23).to(tl.float32, bitcast=True)
    tl.store(xq_row_ptr + _half2_pos(offs), (x * scale).to(tl.float16), mask=mask)
    tl.store(inv_scale_ptr, ((127 - k) << 23).to(tl.float32, bitcast=True))


@triton.jit
def mx_half2_x_kernel(x_ptr, stride_xt, xq_ptr, inv_scale_ptr, H, BLOCK_H: tl.constexpr):
    """Row t of x [T, H] -> its packed-f16 input form: xq [T, H] f16, inv_scale [T] float32
    (store_half2_row)."""
    t = tl.program_id(0)
    offs = tl.arange(0, BLOCK_H)
    mask = offs < H
    x = tl.load(x_ptr + t.to(tl.int64) * stride_xt + offs, mask=mask, other=0.0).to(tl.float32)
    store_half2_row(x, offs, mask, xq_ptr + t.to(tl.int64) * H, inv_scale_ptr + t)


def half2_input_ref(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x [T, H] (bf16/fp16) -> (xq [T, H] f16: x * 2^k per row in pair order, inv_scale [T]
    float32: 2^-k), k = 13 - floor(log2(max |x|)) clamped to [-100, 100] (a zero row takes 100),
    so every |x| * 2^k < 2^14."""
    xf = x.to(torch.float32)
    amax = xf.abs().amax(dim=1)
    # floor(log2) from the exponent bits, as the kernel reads it (0 and subnormals: -127)
    top = ((amax.view(torch.int32) >> 23) & 0xFF).to(torch.float32) - 127
    k = (13 - top).clamp(-100, 100)
    xq = (xf * torch.exp2(k)[:, None]).to(torch.float16)
    n = torch.arange(x.shape[1], device=x.device)
    pos = n // 8 * 8 + torch.tensor(half2_order(), device=x.device)[n % 8]
    out = torch.empty_like(xq)
    out[:, pos] = xq
    return out, torch.exp2(-k)


@triton.jit
def store_swiglu_rows(g, u, e, n, n_mask, pair, N, bg_ptr, bu_ptr, stride_be, stride_bn, out_ptr, act_scale, alpha,
                      limit, HAS_BIAS: tl.constexpr):
    """g, u [BLOCK_N] float32: one pair's gate and up sums for rows n of expert e -> the biases, the
    clamped SwiGLU (gpt-oss), stored as f16 act * act_scale in pair order to out [pairs, N]."""
    if HAS_BIAS:
        b_off = e.to(tl.int64) * stride_be + n * stride_bn
        g += tl.load(bg_ptr + b_off, mask=n_mask, other=0.0).to(tl.float32)
        u += tl.load(bu_ptr + b_off, mask=n_mask, other=0.0).to(tl.float32)
    g = tl.minimum(g, limit)
    u = tl.minimum(tl.maximum(u, -limit), limit)
    h = g * tl.sigmoid(alpha * g) * (u + 1.0)
    tl.store(out_ptr + pair.to(tl.int64) * N + _half2_pos(n), (h * act_scale).to(tl.float16), mask=n_mask)


@triton.jit
def store_down_rows(y, e, n, n_mask, pair, b_ptr, stride_be, pair_weights_ptr, y_ptr, stride_yt, HAS_BIAS: tl.constexpr):
    """y [BLOCK_N] float32: one pair's down sums for rows n of expert e -> (y + bias) * the pair's
    routing weight, stored to y [pairs, H]."""
    if HAS_BIAS:
        y += tl.load(b_ptr + e.to(tl.int64) * stride_be + n, mask=n_mask, other=0.0).to(tl.float32)
    y = y * tl.load(pair_weights_ptr + pair)
    tl.store(y_ptr + pair.to(tl.int64) * stride_yt + n, y, mask=n_mask)


# The scale row stride and the up scales' address are not specialized on being 16-byte multiples:
# scale rows stored padded for the TMA loads would otherwise compile the pointer loads with other
# layouts, measured 4-8% slower (bench/NOTES-moe.md), instead of the code the
# checkpoint's 90-byte rows get.
@triton.jit(do_not_specialize=["stride_sn", "su_ptr"])
def moe_gate_up_half2_kernel(
        xq_ptr, x_inv_scale_ptr,
        wg_ptr, wu_ptr, stride_we, stride_wn,
        sg_ptr, su_ptr, stride_se, stride_sn, stride_sk,
        bg_ptr, bu_ptr, stride_be, stride_bn,
        out_ptr, act_scale, expert_ptr, N, K, top_k, alpha, limit,
        HAS_BIAS: tl.constexpr, INTERPRET: tl.constexpr,
        BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, STAGES: tl.constexpr, TAIL_K: tl.constexpr = 64,
        WIDE_X: tl.constexpr = False, wg_desc=None, wu_desc=None, sg_desc=None, su_desc=None,
        TMA: tl.constexpr = False):
    """Program (pair, n-block): gate and up rows [BLOCK_N] of the pair's expert against the
    pair's token, clamped SwiGLU (gpt-oss), stored as f16 act * act_scale in pair order to
    out [pairs, N]. xq: int32 view of the f16 pair-ordered activations [T, K / 2]; wg / wu:
    int32 views of the codes with strides in 16-byte groups; expert_ptr: topk_ids flattened.
    K past the last whole BLOCK_K step goes in steps of TAIL_K (<= BLOCK_K): every decoded
    code is used (gpt-oss's 2880 = 11 * 256 + 64); TAIL_K 0: the last step runs past K.
    WIDE_X: _x_pairs' 16-byte activation loads. TMA: the whole steps' words and scales read
    through the tensor descriptors wg_desc / wu_desc (int32 codes [E, N, K / 8], boxes
    [1, BLOCK_N, BLOCK_K / 8]) and sg_desc / su_desc (uint8 scales [E, N, K / 32], boxes
    [1, BLOCK_N, BLOCK_K / 32]) of the same tensors; the tail steps through the pointers."""
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
    k_whole = _whole_steps_end(K, BLOCK_K, TAIL_K)
    for k0 in tl.range(0, k_whole, BLOCK_K, num_stages=STAGES):
        x0, x1, x2, x3 = _x_pairs(xq_row, k0, K, BLOCK_K, WIDE_X)
        if TMA:
            acc_g = _tma_chunk(acc_g, wg_desc, sg_desc, e, n0, k0, x0, x1, x2, x3, INTERPRET, BLOCK_N, BLOCK_K)
            acc_u = _tma_chunk(acc_u, wu_desc, su_desc, e, n0, k0, x0, x1, x2, x3, INTERPRET, BLOCK_N, BLOCK_K)
        else:
            acc_g = _chunk(acc_g, wg_ptr, sg_ptr, e, n, n_mask, k0, K, x0, x1, x2, x3, stride_we, stride_wn,
                           stride_se, stride_sn, stride_sk, INTERPRET, BLOCK_K)
            acc_u = _chunk(acc_u, wu_ptr, su_ptr, e, n, n_mask, k0, K, x0, x1, x2, x3, stride_we, stride_wn,
                           stride_se, stride_sn, stride_sk, INTERPRET, BLOCK_K)
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
    store_swiglu_rows(g * inv, u * inv, e, n, n_mask, pair, N, bg_ptr, bu_ptr, stride_be, stride_bn, out_ptr,
                      act_scale, alpha, limit, HAS_BIAS)


@triton.jit(do_not_specialize=["stride_sn"])
def moe_down_half2_kernel(
        aq_ptr, a_inv_scale,
        w_ptr, stride_we, stride_wn,
        s_ptr, stride_se, stride_sn, stride_sk,
        b_ptr, stride_be,
        pair_weights_ptr, y_ptr, stride_yt, expert_ptr, N, K,
        HAS_BIAS: tl.constexpr, INTERPRET: tl.constexpr,
        BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, STAGES: tl.constexpr, TAIL_K: tl.constexpr = 64,
        w_desc=None, s_desc=None, TMA: tl.constexpr = False):
    """Program (pair, n-block): y[pair, n] = pair weight * (down rows [BLOCK_N] . act + bias) in
    float32; aq: int32 view of the f16 pair-ordered GLU output [pairs, K / 2] scaled by
    1 / a_inv_scale. TAIL_K and TMA (descriptors w_desc / s_desc) as in
    moe_gate_up_half2_kernel."""
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
    k_whole = _whole_steps_end(K, BLOCK_K, TAIL_K)
    for k0 in tl.range(0, k_whole, BLOCK_K, num_stages=STAGES):
        x0, x1, x2, x3 = _x_pairs(aq_row, k0, K, BLOCK_K)
        if TMA:
            acc = _tma_chunk(acc, w_desc, s_desc, e, n0, k0, x0, x1, x2, x3, INTERPRET, BLOCK_N, BLOCK_K)
        else:
            acc = _chunk(acc, w_ptr, s_ptr, e, n, n_mask, k0, K, x0, x1, x2, x3, stride_we, stride_wn, stride_se,
                         stride_sn, stride_sk, INTERPRET, BLOCK_K)
    y = tl.sum(acc, axis=1)
    if TAIL_K > 0:
        tail = tl.zeros((BLOCK_N, TAIL_K // 32), dtype=tl.float32)
        for k0 in range(k_whole, K, TAIL_K):
            x0, x1, x2, x3 = _x_pairs(aq_row, k0, K, TAIL_K)
            tail = _chunk(tail, w_ptr, s_ptr, e, n, n_mask, k0, K, x0, x1, x2, x3, stride_we, stride_wn, stride_se,
                          stride_sn, stride_sk, INTERPRET, TAIL_K)
        y += tl.sum(tail, axis=1)
    store_down_rows(y * a_inv_scale, e, n, n_mask, pair, b_ptr, stride_be, pair_weights_ptr, y_ptr, stride_yt,
                    HAS_BIAS)
