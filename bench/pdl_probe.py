"""Programmatic dependent launch (PDL) inside a CUDA graph: what a kernel that depends on the one
before it gains when it may start early and wait for its input only where it reads it.

    python bench/pdl_probe.py [--mb 32]

Two measurements, each with and without PDL (Triton's launch_pdl option plus griddepcontrol
wait / launch_dependents in the kernels), in a CUDA graph captured by torch:
- a chain of 40 tiny dependent kernels: the cost of one graph node after another;
- pairs of streaming kernels, "gate" (waits for the previous pair, then reads its own buffer)
  and "down" (reads its own buffer of weights first, then waits for gate's sums): the shape of
  a decode step whose second kernel's weights do not depend on the first kernel's output.
Buffers rotate so that L2 holds none of a pair's reads when its turn comes round again.
"""
from __future__ import annotations

import argparse
import os
import sys

import torch
import triton
import triton.language as tl

sys.path.insert(0, os.path.dirname(__file__))
from bench_moe_sweep import COPY_CEILING_GBS, copies_out_of_l2, graph_time_us  # noqa: E402


@triton.jit
def _tiny_kernel(src_ptr, dst_ptr, PDL: tl.constexpr):
    i = tl.program_id(0) * 128 + tl.arange(0, 128)
    if PDL:
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()
    tl.store(dst_ptr + i, tl.load(src_ptr + i) + 1.0)


@triton.jit
def _gate_kernel(x_ptr, buf_ptr, sums_ptr, per_program, PDL: tl.constexpr, BLOCK: tl.constexpr):
    """sums[p] = x[0] + the sum of program p's slice of buf (its input comes from the kernel
    before, so it waits first)."""
    p = tl.program_id(0)
    if PDL:
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()
    base = p.to(tl.int64) * per_program
    acc = tl.zeros((BLOCK,), dtype=tl.float32)
    for i in range(0, per_program, BLOCK):
        acc += tl.load(buf_ptr + base + i + tl.arange(0, BLOCK)).to(tl.float32)
    tl.store(sums_ptr + p, tl.sum(acc) + tl.load(x_ptr))


@triton.jit
def _down_kernel(sums_ptr, w_ptr, x_ptr, per_program, PDL: tl.constexpr, BLOCK: tl.constexpr):
    """x[0] += the sum of program p's slice of w times sums[p]: the weights are read before the
    wait, the gate kernel's sums after it."""
    p = tl.program_id(0)
    base = p.to(tl.int64) * per_program
    acc = tl.zeros((BLOCK,), dtype=tl.float32)
    for i in range(0, per_program, BLOCK):
        acc += tl.load(w_ptr + base + i + tl.arange(0, BLOCK)).to(tl.float32)
    if PDL:
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()
    tl.atomic_add(x_ptr, tl.sum(acc) * tl.load(sums_ptr + p) * 1e-9)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--mb", type=float, default=32.0, help="MB each streaming kernel reads")
    args = parser.parse_args()
    sms = torch.cuda.get_device_properties(0).multi_processor_count

    a = torch.zeros(sms * 128, device="cuda")
    b = torch.zeros_like(a)
    for pdl in (False, True):
        def chain(pdl=pdl):
            for i in range(40):
                src, dst = (a, b) if i % 2 == 0 else (b, a)
                _tiny_kernel[(sms,)](src, dst, PDL=pdl, launch_pdl=pdl, num_warps=4)
        print(f"tiny kernel chain, pdl={pdl}: {graph_time_us([chain]) / 40:.2f} us per kernel", flush=True)

    programs, block = 4 * sms, 2048
    per_program = triton.cdiv(int(args.mb * 2 ** 20) // 2, programs * block) * block
    nbytes = programs * per_program * 2
    copies = copies_out_of_l2(2 * nbytes)
    bufs = [(torch.randn(programs * per_program, device="cuda", dtype=torch.bfloat16),
             torch.randn(programs * per_program, device="cuda", dtype=torch.bfloat16)) for _ in range(copies)]
    x = torch.zeros(1, device="cuda")
    sums = torch.zeros(programs, device="cuda")
    for pdl in (False, True):
        def gate(buf, pdl=pdl):
            _gate_kernel[(programs,)](x, buf, sums, per_program, PDL=pdl, BLOCK=block, launch_pdl=pdl, num_warps=4)

        def down(w, pdl=pdl):
            _down_kernel[(programs,)](sums, w, x, per_program, PDL=pdl, BLOCK=block, launch_pdl=pdl, num_warps=4)

        gate_us = graph_time_us([lambda g=g: gate(g) for g, _ in bufs])
        down_us = graph_time_us([lambda w=w: down(w) for _, w in bufs])
        pair_us = graph_time_us([lambda g=g, w=w: (gate(g), down(w)) for g, w in bufs])
        floor_us = 2 * nbytes / (COPY_CEILING_GBS * 1e3)
        print(f"gate + down pair, {nbytes / 1e6:.1f} MB each, pdl={pdl}: gate alone {gate_us:.1f} us, "
              f"down alone {down_us:.1f} us, pair {pair_us:.1f} us ({floor_us / pair_us:.0%} of copy)", flush=True)


if __name__ == "__main__":
    main()
