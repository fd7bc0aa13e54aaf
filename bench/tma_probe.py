"""Would the TMA engine feed the MXFP4 gate/up kernel at one token better than per-thread copies?
A pure-read probe over gpt-oss-120b's gate/up weights of 4 experts (the grid of
bench/layout_probe.py: programs of BLOCK_R rows, a 128-byte chunk of each row a trip), reading the
words either with per-thread pointer loads (asynchronous copies, as the packed-f16 kernels do) or
with tensor-descriptor loads (one bulk copy a trip issued by the TMA engine), and the E8M0 scales
not at all, with one-byte pointer loads, or as 16-byte TMA boxes of a copy with rows padded to 96
bytes (each box holds two trips' scales).

    python bench/tma_probe.py

Timed as bench/read_floor.py times (CUDA graph over copies rotated out of L2, median of 10 replays).
"""
from __future__ import annotations

import os
import sys

import torch
import triton
import triton.language as tl
from triton.tools.tensor_descriptor import TensorDescriptor

sys.path.insert(0, os.path.dirname(__file__))
from bench_moe_sweep import COPY_CEILING_GBS, copies_out_of_l2, graph_time_us  # noqa: E402

EXPERTS, ROWS, ROW_WORDS, SCALES_PER_ROW, PADDED_SCALES = 4, 5760, 360, 90, 96


@triton.jit
def _pointer_kernel(w_ptr, s_ptr, out_ptr, ROW_WORDS: tl.constexpr, SCALES_PER_ROW: tl.constexpr,
                    ROWS: tl.constexpr, SCALES: tl.constexpr, BLOCK_R: tl.constexpr, STAGES: tl.constexpr):
    e = tl.program_id(0)
    r = tl.arange(0, BLOCK_R)
    rows = tl.program_id(1) * BLOCK_R + r
    acc = tl.zeros((BLOCK_R, 32), dtype=tl.int32)
    for c in tl.range(0, (ROW_WORDS + 31) // 32, num_stages=STAGES):
        col = c * 32 + tl.arange(0, 32)
        offs = (e * ROWS + rows).to(tl.int64)[:, None] * ROW_WORDS + col[None, :]
        acc += tl.load(w_ptr + offs, mask=(col < ROW_WORDS)[None, :] & (r >= 0)[:, None], other=0)
        if SCALES:
            g = c * 8 + tl.arange(0, 8)
            s = tl.load(s_ptr + (e * ROWS + rows).to(tl.int64)[:, None] * SCALES_PER_ROW + g[None, :],
                        mask=(g < SCALES_PER_ROW)[None, :] & (r >= 0)[:, None], other=0)
            acc += tl.sum(s.to(tl.int32), axis=1)[:, None]
    tl.store(out_ptr + (e * tl.num_programs(1) + tl.program_id(1)) * BLOCK_R + r, tl.sum(acc, axis=1))


@triton.jit
def _tma_kernel(w_desc, s_ptr, s_desc, out_ptr, ROW_WORDS: tl.constexpr, SCALES_PER_ROW: tl.constexpr,
                ROWS: tl.constexpr, SCALES: tl.constexpr, BLOCK_R: tl.constexpr, STAGES: tl.constexpr):
    """SCALES 0: none; 1: one-byte pointer loads; 2: 16-byte TMA boxes of the padded copy."""
    e = tl.program_id(0)
    r = tl.arange(0, BLOCK_R)
    row0 = tl.program_id(1) * BLOCK_R
    rows = row0 + r
    acc = tl.zeros((BLOCK_R, 32), dtype=tl.int32)
    for c in tl.range(0, (ROW_WORDS + 31) // 32, num_stages=STAGES):
        acc += tl.reshape(w_desc.load([e, row0, c * 32]), (BLOCK_R, 32))
        if SCALES == 1:
            g = c * 8 + tl.arange(0, 8)
            s = tl.load(s_ptr + (e * ROWS + rows).to(tl.int64)[:, None] * SCALES_PER_ROW + g[None, :],
                        mask=(g < SCALES_PER_ROW)[None, :] & (r >= 0)[:, None], other=0)
            acc += tl.sum(s.to(tl.int32), axis=1)[:, None]
        if SCALES == 2:
            s = tl.reshape(s_desc.load([e, row0, (c // 2) * 16]), (BLOCK_R, 16)).to(tl.int32)
            half = (tl.arange(0, 16) // 8 == c % 2)[None, :]
            acc += tl.sum(tl.where(half, s, 0), axis=1)[:, None]
    tl.store(out_ptr + (e * tl.num_programs(1) + tl.program_id(1)) * BLOCK_R + r, tl.sum(acc, axis=1))


def main() -> None:
    w_bytes = EXPERTS * ROWS * ROW_WORDS * 4
    s_bytes = EXPERTS * ROWS * SCALES_PER_ROW
    copies = copies_out_of_l2(w_bytes + s_bytes * 2)
    ws = [torch.randint(-2 ** 20, 2 ** 20, (EXPERTS, ROWS, ROW_WORDS), device="cuda", dtype=torch.int32)
          for _ in range(copies)]
    ss = [torch.randint(0, 255, (EXPERTS, ROWS, SCALES_PER_ROW), device="cuda", dtype=torch.uint8)
          for _ in range(copies)]
    sps = [torch.nn.functional.pad(s, (0, PADDED_SCALES - SCALES_PER_ROW)).contiguous() for s in ss]
    out = torch.empty(EXPERTS * ROWS, device="cuda", dtype=torch.int32)

    def report(label, fns, scales):
        try:
            us = graph_time_us(fns)
        except Exception as exc:  # a shape the compiler refuses: say so and go on
            print(f"{label}: failed ({type(exc).__name__}: {str(exc).splitlines()[0][:120]})", flush=True)
            return
        nbytes = w_bytes + (s_bytes if scales else 0)
        print(f"{label}: {us:.1f} us, {nbytes / us / 1e3:.0f} GB/s ({nbytes / us / 1e3 / COPY_CEILING_GBS:.0%} of copy)",
              flush=True)

    for block_r, warps in ((16, 1), (32, 1), (32, 2), (64, 2), (64, 4), (128, 4)):
        grid = (EXPERTS, ROWS // block_r)
        for stages in (2, 3, 4, 6):
            for scales in (0, 1):
                if block_r <= 32 and stages <= 3:
                    report(f"pointer r{block_r} w{warps} s{stages} scales {scales}",
                           [lambda w=w, s=s: _pointer_kernel[grid](
                               w, s, out, ROW_WORDS, SCALES_PER_ROW, ROWS, bool(scales), block_r, stages,
                               num_warps=warps) for w, s in zip(ws, ss)], scales)
            w_descs = [TensorDescriptor.from_tensor(w, [1, block_r, 32]) for w in ws]
            s_descs = [TensorDescriptor.from_tensor(s, [1, block_r, 16]) for s in sps]
            for scales in (0, 1, 2):
                report(f"tma r{block_r} w{warps} s{stages} scales {scales}",
                       [lambda wd=wd, s=s, sd=sd: _tma_kernel[grid](
                           wd, s, sd, out, ROW_WORDS, SCALES_PER_ROW, ROWS, scales, block_r, stages, num_warps=warps)
                        for wd, s, sd in zip(w_descs, ss, s_descs)], scales)


if __name__ == "__main__":
    main()
