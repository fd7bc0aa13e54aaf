"""What a pure read of a decode step's bytes costs on its own: the floor that a kernel reading the
same bytes can reach, at the sizes of the step rather than at the gigabytes the copy ceiling was
measured with.

    python bench/read_floor.py [--mb 16.8,33.6,52.9,138] [--pairs 35.3+17.6] [--wide]

For each size: a streaming-read kernel (each program sums a contiguous slice, loads software-
pipelined; the best of a sweep over programs, warps, tile and stages), torch's float32 sum and
torch's copy (which also writes the bytes), each timed as the benchmarks time kernels: a CUDA graph
over buffers rotated so that L2 holds none of them when their turn comes again, median of 10
replays. A pair "A+B" times two dependent reads one after the other (the MoE step's gate/up and
down kernels). Percentages are of the 4.27 TB/s copy ceiling, as in BENCHMARKS.md.
"""
from __future__ import annotations

import argparse
import itertools
import os
import sys

import torch
import triton
import triton.language as tl

sys.path.insert(0, os.path.dirname(__file__))
from bench_moe_sweep import COPY_CEILING_GBS, copies_out_of_l2, graph_time_us  # noqa: E402


@triton.jit
def _read_kernel(src_ptr, sums_ptr, n, per_program, BLOCK: tl.constexpr, STAGES: tl.constexpr):
    """sums[p] = sum of src[p * per_program : (p + 1) * per_program] (int32 words as float bits,
    only to give the loads a use)."""
    p = tl.program_id(0)
    base = p.to(tl.int64) * per_program
    acc = tl.zeros((BLOCK,), dtype=tl.int32)
    for i in tl.range(0, per_program, BLOCK, num_stages=STAGES):
        offs = base + i + tl.arange(0, BLOCK)
        acc += tl.load(src_ptr + offs, mask=offs < n, other=0)
    tl.store(sums_ptr + p, tl.sum(acc))


def read_configs(sms: int, wide: bool = False):
    if wide:  # more and smaller programs, a middle tile
        return itertools.product((4 * sms, 8 * sms, 16 * sms, 32 * sms), (4, 8), (1024, 2048, 4096), (2, 3, 4))
    return itertools.product((sms, 2 * sms, 4 * sms, 8 * sms, 16 * sms), (4, 8), (1024, 4096), (2, 3, 4))


def describe(cfg) -> str:
    programs, warps, block, stages = cfg
    return f"{programs} programs x {warps} warps, tile {block * 4} B, {stages} stages"


def launch_read(buf, sums, cfg) -> None:
    """One streaming read of buf with cfg = (programs, warps, tile words, stages)."""
    programs, warps, block, stages = cfg
    per_program = triton.cdiv(triton.cdiv(buf.numel(), programs), block) * block
    _read_kernel[(programs,)](buf, sums, buf.numel(), per_program, BLOCK=block, STAGES=stages, num_warps=warps)


def best_read_us(bufs, sums, sms, wide: bool = False) -> tuple[float, tuple]:
    """-> (us, cfg) of the fastest read configuration over the rotated buffers."""
    best = (float("inf"), ())
    for cfg in read_configs(sms, wide):
        us = graph_time_us([lambda b=b, cfg=cfg: launch_read(b, sums, cfg) for b in bufs])
        if us < best[0]:
            best = (us, cfg)
    return best


def buffers(nbytes: float, count: int) -> list[torch.Tensor]:
    return [torch.randint(-2 ** 20, 2 ** 20, (int(nbytes) // 4,), device="cuda", dtype=torch.int32)
            for _ in range(count)]


def pct(nbytes: float, us: float) -> str:
    return f"{nbytes / us / 1e3:.0f} GB/s, {nbytes / us / 1e3 / COPY_CEILING_GBS:.0%} of copy"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--mb", default="16.8,33.6,52.9,138", help="sizes in MB (10^6 bytes), one kernel each")
    parser.add_argument("--pairs", default="35.3+17.6", help="A+B: two dependent reads of A and B MB")
    parser.add_argument("--wide", action="store_true", help="sweep up to 32 programs per SM and a 8 KB tile")
    args = parser.parse_args()
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    sums = torch.zeros(32 * sms, device="cuda", dtype=torch.int32)
    for mb in [float(s) for s in args.mb.split(",") if s]:
        nbytes = mb * 1e6
        bufs = buffers(nbytes, copies_out_of_l2(nbytes))
        us, cfg = best_read_us(bufs, sums, sms, args.wide)
        print(f"{mb:g} MB read kernel: {us:.1f} us ({pct(nbytes, us)}); floor at copy speed "
              f"{nbytes / COPY_CEILING_GBS / 1e3:.1f} us; best: {describe(cfg)}", flush=True)
        floats = [b.view(torch.float32) for b in bufs]
        out = torch.zeros((), device="cuda")
        us = graph_time_us([lambda f=f: torch.sum(f, dim=0, out=out) for f in floats])
        print(f"{mb:g} MB torch.sum: {us:.1f} us ({pct(nbytes, us)})", flush=True)
        dst = torch.empty_like(bufs[0])
        us = graph_time_us([lambda b=b, dst=dst: dst.copy_(b) for b in bufs])
        print(f"{mb:g} MB torch copy: {us:.1f} us (reads {pct(nbytes, us)}, writes as much again)", flush=True)
        del bufs, floats, dst  # free this size's buffers before the next
    for pair in [p for p in args.pairs.split(",") if p]:
        mb_a, mb_b = (float(s) for s in pair.split("+"))
        count = copies_out_of_l2((mb_a + mb_b) * 1e6)
        bufs_a, bufs_b = buffers(mb_a * 1e6, count), buffers(mb_b * 1e6, count)
        _, cfg_a = best_read_us(bufs_a, sums, sms, args.wide)
        _, cfg_b = best_read_us(bufs_b, sums, sms, args.wide)

        def both(a, b):
            launch_read(a, sums, cfg_a)
            launch_read(b, sums, cfg_b)
        us = graph_time_us([lambda a=a, b=b: both(a, b) for a, b in zip(bufs_a, bufs_b)])
        nbytes = (mb_a + mb_b) * 1e6
        print(f"{pair} MB as two dependent read kernels: {us:.1f} us ({pct(nbytes, us)})", flush=True)


if __name__ == "__main__":
    main()
