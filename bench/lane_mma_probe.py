"""Offline sm_90 compile probe (no GPU): can a Triton kernel drive the MMA units from per-lane
registers, so that MXFP4 weights are decoded once per expert without the waits and shared-memory
staging that the tensor-core attempts paid (bench/NOTES-moe.md, "Per-lane MMA")?

Three kernels, compiled for sm_90 with the installed Triton's ptxas, main loop counted from the SASS
(helpers of tests/kernels/sass_tools.py):
  chain   a [64, 32] e4m3 operand decoded in registers, `acc = tl.dot(a, b, acc)` over K (4 warps):
          whether the warp-group MMAs of one accumulator chain stay in flight;
  e4m3    the warp-level e4m3 MMA (mma.sync m16n8k32) written in PTX from [32]-shaped tensors (one
          element per lane): whether sm_90 runs it on tensor cores as such;
  imma    the same per-lane form with the integer MMA (m16n8k32, u8 x s8): E2M1 words become biased
          bytes 2v + 12 by PRMT table lookups (the bias taken out with each group's activation sums),
          one MMA per 32-value group, the E8M0 scale applied to each group's sums in float32;
          `tiles` 16-row tiles of one warp share the activation loads.
Run: `env -u TRITON_INTERPRET PYTHONPATH=<dir holding localchat> python bench/lane_mma_probe.py`.
"""
from __future__ import annotations

import collections
import os
import re
import sys

import triton
import triton.language as tl

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "tests", "kernels"))
from sass_tools import _types, compile_kernel, disassemble, main_loop, opcode  # noqa: E402

_E4M3_MMA = tl.constexpr("mma.sync.aligned.m16n8k32.row.col.f32.e4m3.e4m3.f32 {$0, $1, $2, $3}, {$4, $5, $6, $7}, "
                         "{$8, $9}, {$10, $11, $12, $13};")
_IMMA = tl.constexpr("mma.sync.aligned.m16n8k32.row.col.s32.u8.s8.s32 {$0, $1, $2, $3}, {$4, $5, $6, $7}, "
                     "{$8, $9}, {0, 0, 0, 0};")
# word $2 (8 E2M1 codes, sign in each nibble's bit 3) -> $0 / $1: the bytes 2v + 12 of codes 0-3 / 4-7.
# A PRMT selector nibble with bit 3 set gives the selected byte's sign replicated, 0 for these
# tables: each code's byte comes from the positive table when its sign is clear, else the negative.
_DECODE = tl.constexpr("""{
.reg .b32 x, hw, hx, p, n;
xor.b32 x, $2, 0x88888888;
prmt.b32 p, 0x0F0E0D0C, 0x18141210, $2;
prmt.b32 n, 0x090A0B0C, 0x00040608, x;
or.b32 $0, p, n;
shr.u32 hw, $2, 16;
shr.u32 hx, x, 16;
prmt.b32 p, 0x0F0E0D0C, 0x18141210, hw;
prmt.b32 n, 0x090A0B0C, 0x00040608, hx;
or.b32 $1, p, n;
}""")


@triton.jit
def _bytes_e4m3(r):
    """int32 [BN, 8] -> e4m3 [BN, 32], byte b of column c at 4 c + b."""
    b0 = r.to(tl.int8).to(tl.float8e4nv, bitcast=True)
    b1 = (r >> 8).to(tl.int8).to(tl.float8e4nv, bitcast=True)
    b2 = (r >> 16).to(tl.int8).to(tl.float8e4nv, bitcast=True)
    b3 = (r >> 24).to(tl.int8).to(tl.float8e4nv, bitcast=True)
    return tl.reshape(tl.join(tl.join(b0, b2), tl.join(b1, b3)), (r.shape[0], r.shape[1] * 4))


@triton.jit
def chain_kernel(w_ptr, b_ptr, out_ptr, K, BN: tl.constexpr, C: tl.constexpr):
    n = tl.arange(0, BN)
    acc = tl.zeros((BN, C), tl.float32)
    for k0 in tl.range(0, K, 128, num_stages=3):
        for g in tl.static_range(4):
            w = tl.load(w_ptr + n[:, None] * (K // 4) + (k0 + 32 * g) // 4 + tl.arange(0, 8)[None, :])
            a = _bytes_e4m3(w ^ 0x01010101)
            b = tl.load(b_ptr + (k0 + 32 * g + tl.arange(0, 32))[:, None] * C + tl.arange(0, C)[None, :])
            acc = tl.dot(a, b, acc)
    tl.store(out_ptr + n[:, None] * C + tl.arange(0, C)[None, :], acc)


@triton.jit
def e4m3_lane_kernel(w_ptr, b_ptr, out_ptr, K):
    lane = tl.arange(0, 32)
    r = lane // 4
    q = lane % 4
    c0 = tl.zeros((32,), tl.float32)
    for k0 in tl.range(0, K, 32):
        wr = tl.load(w_ptr + r * (K // 8) + k0 // 8 + q)
        wr8 = tl.load(w_ptr + (r + 8) * (K // 8) + k0 // 8 + q)
        b0 = tl.load(b_ptr + r * (K // 4) + k0 // 4 + q)
        b1 = tl.load(b_ptr + r * (K // 4) + k0 // 4 + 4 + q)
        d0, d1, d2, d3 = tl.inline_asm_elementwise(
            _E4M3_MMA, "=f,=f,=f,=f,r,r,r,r,r,r,f,f,f,f", [wr, wr8, wr >> 2, wr8 >> 2, b0, b1, c0, c0, c0, c0],
            dtype=(tl.float32, tl.float32, tl.float32, tl.float32), is_pure=True, pack=1)
        c0 = d0 + d1 + d2 + d3
    tl.store(out_ptr + lane, c0)


@triton.jit
def imma_lane_kernel(w_ptr, s_ptr, b_ptr, sum_ptr, out_ptr, K, TILES: tl.constexpr):
    """One warp, TILES 16-row tiles; lane l holds rows l // 4 and l // 4 + 8 of each tile and word
    l % 4 of each 32-value group (the activations ordered to match); 4 pairs' hi/lo planes as the
    MMA's 8 columns."""
    lane = tl.arange(0, 32)
    r = lane // 4
    q = lane % 4
    acc0 = tl.zeros((TILES, 32), tl.float32)
    acc1 = tl.zeros((TILES, 32), tl.float32)
    acc2 = tl.zeros((TILES, 32), tl.float32)
    acc3 = tl.zeros((TILES, 32), tl.float32)
    rows = 16 * tl.arange(0, TILES)[:, None] + r[None, :]
    for k0 in tl.range(0, K, 128):
        sw = tl.load(s_ptr + rows * 24 + k0 // 128)  # the 4 groups' scales of a row as one word
        sw8 = tl.load(s_ptr + (rows + 8) * 24 + k0 // 128)
        for g in tl.static_range(4):
            wr = tl.load(w_ptr + rows * (K // 8) + (k0 + 32 * g) // 8 + q[None, :])
            wr8 = tl.load(w_ptr + (rows + 8) * (K // 8) + (k0 + 32 * g) // 8 + q[None, :])
            a0, a2 = tl.inline_asm_elementwise(_DECODE, "=r,=r,r", [wr], dtype=(tl.int32, tl.int32), is_pure=True,
                                               pack=1)
            a1, a3 = tl.inline_asm_elementwise(_DECODE, "=r,=r,r", [wr8], dtype=(tl.int32, tl.int32), is_pure=True,
                                               pack=1)
            b0 = tl.load(b_ptr + r * (K // 4) + (k0 + 32 * g) // 4 + q)
            b1 = tl.load(b_ptr + r * (K // 4) + (k0 + 32 * g) // 4 + 4 + q)
            b0 = tl.broadcast_to(b0[None, :], (TILES, 32))
            b1 = tl.broadcast_to(b1[None, :], (TILES, 32))
            t0, t1, t2, t3 = tl.inline_asm_elementwise(
                _IMMA, "=r,=r,=r,=r,r,r,r,r,r,r", [a0, a1, a2, a3, b0, b1],
                dtype=(tl.int32, tl.int32, tl.int32, tl.int32), is_pure=True, pack=1)
            bias0 = tl.load(sum_ptr + (k0 // 32 + g) * 8 + 2 * q)[None, :]
            bias1 = tl.load(sum_ptr + (k0 // 32 + g) * 8 + 2 * q + 1)[None, :]
            m = (((sw >> (8 * g)) & 255) << 23).to(tl.float32, bitcast=True)
            m8 = (((sw8 >> (8 * g)) & 255) << 23).to(tl.float32, bitcast=True)
            acc0 += (t0.to(tl.float32) - bias0) * m
            acc1 += (t1.to(tl.float32) - bias1) * m
            acc2 += (t2.to(tl.float32) - bias0) * m8
            acc3 += (t3.to(tl.float32) - bias1) * m8
    out = out_ptr + rows * 128 + 4 * q[None, :]
    tl.store(out, acc0)
    tl.store(out + 1, acc1)
    tl.store(out + 2, acc2)
    tl.store(out + 3, acc3)


def report(name: str, kernel, values_per_trip_and_lane: int) -> None:
    loop = main_loop(disassemble(kernel))
    ops = collections.Counter(opcode(i) for i in loop)
    mma = sorted({m for i in loop for m in re.findall(r"\b[A-Z]*MMA\.[\w.]+", i)})
    waits = sum("WARPGROUP.DEPBAR" in i for i in loop)
    layouts = set(re.findall(r"sizePerThread = \[[^\]]*\], threadsPerWarp = \[[^\]]*\]", kernel.asm["ttgir"]))
    print(f"{name}: {len(loop)} instructions a trip, {len(loop) / values_per_trip_and_lane:.2f} per weight value "
          f"and lane; MMA {mma}; warp-group waits {waits}; layout conversions "
          f"{kernel.asm['ttgir'].count('convert_layout')}; layouts {sorted(layouts)}")
    print("    ", dict(ops.most_common(16)))


def main() -> None:
    chain = compile_kernel(chain_kernel, _types({"w_ptr": "*i32", "b_ptr": "*fp8e4nv", "out_ptr": "*fp32"}),
                           dict(BN=64, C=16), num_warps=4, num_stages=3, divisible=True)
    report("chain (wgmma, A in registers, 4 warps)", chain, 64 * 128 // 128)
    e4m3 = compile_kernel(e4m3_lane_kernel, _types({"w_ptr": "*i32", "b_ptr": "*i32", "out_ptr": "*fp32"}), {},
                          num_warps=1, num_stages=1, divisible=True)
    report("e4m3 mma.sync per lane", e4m3, 16 * 32 // 32)
    types = _types({"w_ptr": "*i32", "s_ptr": "*i32", "b_ptr": "*i32", "sum_ptr": "*fp32", "out_ptr": "*fp32"})
    for tiles in (1, 4):  # 4: the [TILES, 32] tensors no longer map element (t, l) to lane l (see layouts)
        imma = compile_kernel(imma_lane_kernel, types, dict(TILES=tiles), num_warps=1, num_stages=1, divisible=True)
        report(f"imma per lane, {tiles} tile(s)", imma, tiles * 16 * 128 // 32)


if __name__ == "__main__":
    main()
