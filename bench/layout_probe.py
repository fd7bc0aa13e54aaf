"""Does the MXFP4 MoE's weight layout cost bandwidth at one token? A pure-read probe with the
packed-f16 gate/up kernel's grid and loads (one-warp programs, 16 rows of 1440 bytes a program,
one 128-byte chunk of each row a trip, pipelined 3 deep), reading either the checkpoint's row-major
layout (a trip touches 16 rows 1440 bytes apart) or a tiled copy in which each program's chunk of
a trip is 2 KB in one piece; with and without the one-byte scale loads.

    python bench/layout_probe.py

Bytes: gpt-oss-120b's gate/up weights of 4 experts (33.2 MB, plus 2.1 MB of scales), timed as
bench/read_floor.py times (CUDA graph over copies rotated out of L2, median of 10 replays).
"""
from __future__ import annotations

import os
import sys

import torch
import triton
import triton.language as tl

sys.path.insert(0, os.path.dirname(__file__))
from bench_moe_sweep import COPY_CEILING_GBS, copies_out_of_l2, graph_time_us  # noqa: E402

EXPERTS, ROWS, ROW_WORDS, SCALES_PER_ROW = 4, 5760, 360, 90  # gate/up [E, 2I, H / 2 bytes], int32 words


@triton.jit
def _probe_kernel(w_ptr, s_ptr, out_ptr, ROW_WORDS: tl.constexpr, SCALES_PER_ROW: tl.constexpr,
                  ROWS: tl.constexpr, TILED: tl.constexpr, SCALES: tl.constexpr, BLOCK_R: tl.constexpr,
                  STAGES: tl.constexpr):
    e = tl.program_id(0)
    nb = tl.program_id(1)
    r = tl.arange(0, BLOCK_R)
    cw = tl.arange(0, 32)  # a trip: 32 words (256 codes) of each row
    rows = nb * BLOCK_R + r
    chunks: tl.constexpr = (ROW_WORDS + 31) // 32
    acc = tl.zeros((BLOCK_R, 32), dtype=tl.int32)
    for c in tl.range(0, chunks, num_stages=STAGES):
        col = c * 32 + cw
        mask = (col < ROW_WORDS)[None, :] & (r >= 0)[:, None]
        if TILED:  # [E, row blocks, chunks, BLOCK_R, 32]
            base = ((e * (ROWS // BLOCK_R) + nb) * chunks + c).to(tl.int64) * (BLOCK_R * 32)
            offs = base + r[:, None] * 32 + cw[None, :]
        else:  # [E, ROWS, ROW_WORDS]
            offs = (e * ROWS + rows).to(tl.int64)[:, None] * ROW_WORDS + col[None, :]
        acc += tl.load(w_ptr + offs, mask=mask, other=0)
        if SCALES:
            g = c * 8 + tl.arange(0, 8)
            s = tl.load(s_ptr + (e * ROWS + rows).to(tl.int64)[:, None] * SCALES_PER_ROW + g[None, :],
                        mask=(g < SCALES_PER_ROW)[None, :] & (r >= 0)[:, None], other=0)
            acc += tl.sum(s.to(tl.int32), axis=1)[:, None]
    tl.store(out_ptr + (e * tl.num_programs(1) + nb) * BLOCK_R + r, tl.sum(acc, axis=1))


def main() -> None:
    chunks = triton.cdiv(ROW_WORDS, 32)
    w_bytes = EXPERTS * ROWS * ROW_WORDS * 4
    s_bytes = EXPERTS * ROWS * SCALES_PER_ROW
    copies = copies_out_of_l2(w_bytes + s_bytes)
    # the tiled copy pads each row to whole chunks (a few masked words), so both layouts hold room
    # for EXPERTS * ROWS * chunks * 32 words
    ws = [torch.randint(-2 ** 20, 2 ** 20, (EXPERTS * ROWS * chunks * 32,), device="cuda", dtype=torch.int32)
          for _ in range(copies)]
    ss = [torch.randint(0, 255, (s_bytes,), device="cuda", dtype=torch.uint8) for _ in range(copies)]
    for block_r in (16, 8):
        out = torch.empty(EXPERTS * ROWS, device="cuda", dtype=torch.int32)
        for tiled in (False, True):
            for scales in (False, True):
                def run(w, s, tiled=tiled, scales=scales, block_r=block_r):
                    _probe_kernel[(EXPERTS, ROWS // block_r)](w, s, out, ROW_WORDS=ROW_WORDS,
                                                              SCALES_PER_ROW=SCALES_PER_ROW, ROWS=ROWS, TILED=tiled,
                                                              SCALES=scales, BLOCK_R=block_r, STAGES=3, num_warps=1)
                us = graph_time_us([lambda w=w, s=s: run(w, s) for w, s in zip(ws, ss)])
                nbytes = w_bytes + (s_bytes if scales else 0)
                print(f"{block_r} rows a program, {'tiled' if tiled else 'row-major'}, "
                      f"{'with' if scales else 'no'} scales: {us:.1f} us, {nbytes / us / 1e3:.0f} GB/s "
                      f"({nbytes / us / 1e3 / COPY_CEILING_GBS:.0%} of copy)", flush=True)


if __name__ == "__main__":
    main()
