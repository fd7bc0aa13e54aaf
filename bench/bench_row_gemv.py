"""One-token dense and FP8 linears: the row GEMV at several pipeline depths (dense: against
cuBLAS, F.linear on the bf16 weight), with enough weight copies in rotation that the 50 MB L2
serves none of a call's reads.

    python bench/bench_row_gemv.py [--stages 1,2,3,4] [--scales block,channel] [--only-fp8]
"""
from __future__ import annotations

import argparse
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(__file__))
sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "tests", "kernels"))
from bench_moe_sweep import COPY_CEILING_GBS, copies_out_of_l2, graph_time_us  # noqa: E402

from kernel_checks import quantize_fp8_blocks, quantize_fp8_rows, rel_err  # noqa: E402
from localchat.engine.weights.formats import Fp8Weight  # noqa: E402
from localchat.kernels.fp8_linear import fp8_linear  # noqa: E402
from localchat.kernels.row_gemv import dense_gemv  # noqa: E402

SHAPES = [("gpt-oss q/k/v", 5120, 2880), ("gpt-oss o_proj", 2880, 4096), ("GLM q/k/v", 14336, 4096),
          ("GLM o_proj", 4096, 12288)]
FP8_SHAPES = [("GLM-4.5V-FP8 q/k/v", 14336, 4096), ("GLM-4.5V-FP8 o_proj", 4096, 12288),
              ("GLM-4.5V-FP8 shared gate/up", 2816, 4096), ("GLM-4.5V-FP8 shared down", 4096, 1408)]
# FP8 row-GEMV tiles (block_n, block_k, stages); None: the default. 128: one scale block a step
FP8_TILES = [(None, 128, None), (None, None, None), (None, None, 3), (None, 1024, None), (8, None, None),
             (16, None, None), (8, 1024, None)]
# channel scales (GLM-4.5V-FP8's checkpoint): rows per program against K step and depth
FP8_CHANNEL_TILES = [(None, None, None)] + [(bn, bk, st) for bn in (4, 8, 16, 32) for bk in (None, 1024)
                                            for st in (None, 3)]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--stages", default="1,2,3,4")
    parser.add_argument("--scales", default="block", help="FP8 scale kinds: block (128x128), channel")
    parser.add_argument("--only-fp8", action="store_true")
    parser.add_argument("--dense-rows", default="0", help="bf16 rows per program to try (0: the default)")
    args = parser.parse_args()
    torch.manual_seed(0)
    for name, n, k in [] if args.only_fp8 else SHAPES:
        nbytes = n * k * 2
        copies = copies_out_of_l2(nbytes)
        ws = [torch.randn(n, k, device="cuda", dtype=torch.bfloat16) / k ** 0.5 for _ in range(copies)]
        x = torch.randn(1, k, device="cuda", dtype=torch.bfloat16)
        ref = torch.nn.functional.linear(x, ws[0]).float()
        rows = [("cuBLAS", graph_time_us([lambda w=w: torch.nn.functional.linear(x, w) for w in ws]), 0.0)]
        for st in (int(v) for v in args.stages.split(",")):
            for bn in (int(v) or None for v in args.dense_rows.split(",")):
                err = rel_err(dense_gemv(x, ws[0], block_n=bn, stages=st), ref)
                us = graph_time_us([lambda w=w, st=st, bn=bn: dense_gemv(x, w, block_n=bn, stages=st) for w in ws])
                rows.append((f"row GEMV n{bn or 'default'} {st} stages", us, err))
        for label, us, err in rows:
            gbs = nbytes / us / 1e3
            print(f"{name} {n}x{k} M=1 {label}: {us:.1f} us, {gbs / COPY_CEILING_GBS:.0%} of copy, rel err {err:.1e}",
                  flush=True)
        del ws
        torch.cuda.empty_cache()
    for kind in args.scales.split(","):
        for name, n, k in FP8_SHAPES:
            fp8_shape(name, n, k, kind)


def fp8_shape(name: str, n: int, k: int, kind: str) -> None:
    """Every tile of the FP8 row GEMV at one shape, with 128x128 block or per-row (channel) scales."""
    nbytes = n * k + (4 * (n // 128) * (k // 128) if kind == "block" else 4 * n)
    copies = copies_out_of_l2(nbytes)
    if kind == "block":
        ws = [Fp8Weight(*quantize_fp8_blocks(torch.randn(n, k, device="cuda") / k ** 0.5), block=(128, 128))
              for _ in range(copies)]
    else:
        ws = [Fp8Weight(*quantize_fp8_rows(torch.randn(n, k, device="cuda") / k ** 0.5)) for _ in range(copies)]
    x = torch.randn(1, k, device="cuda", dtype=torch.bfloat16)
    ref = (x.float() @ ws[0].dequantize().T)
    for bn, bk, st in FP8_TILES if kind == "block" else FP8_CHANNEL_TILES:
        err = rel_err(fp8_linear(x, ws[0], block_n=bn, block_k=bk, stages=st), ref)
        us = graph_time_us([lambda w=w, bn=bn, bk=bk, st=st: fp8_linear(x, w, block_n=bn, block_k=bk, stages=st)
                            for w in ws])
        gbs = nbytes / us / 1e3
        print(f"{name} {kind} {n}x{k} M=1 row GEMV n{bn or 'default'} k{bk or 'default'} {st or 'default'} stages: "
              f"{us:.1f} us, {gbs / COPY_CEILING_GBS:.0%} of copy, rel err {err:.1e}", flush=True)
    del ws
    torch.cuda.empty_cache()

if __name__ == "__main__":
    main()
