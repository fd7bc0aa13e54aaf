"""FP8 dense linears at decode batch sizes, weights rotated out of L2 (a CUDA graph over one call
per weight copy), GLM-4.5V-like shapes.

    python bench/bench_fp8_linear.py [--ms 3,4,8,16,32,48,64]
        the Triton path (row kernel up to 2 tokens, else the tile) against torch._scaled_mm with
        the activations quantised per token (channel scales) or per token and 128 columns
        (block scales)
    python bench/bench_fp8_linear.py --tiles n:k:warps:stages[:splits],... [--ms 4,8,16,32] [--block]
        the tile kernel's configurations against its current choice (channel scales, or block);
        splits > 1 divides K over that many programs, the partials added by a second launch
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
from localchat.kernels import fp8_linear as fl  # noqa: E402

SHAPES = [(12288, 4096), (4096, 12288), (2816, 4096), (4096, 1408)]  # q/k/v, o_proj, shared expert


def weight_copies(n: int, k: int, block) -> list[Fp8Weight]:
    out = []
    for _ in range(copies_out_of_l2(n * k)):
        w = torch.randn(n, k, device="cuda") / 64
        out.append(Fp8Weight(*quantize_fp8_blocks(w), block=block) if block else Fp8Weight(*quantize_fp8_rows(w)))
    return out


def pct(n: int, k: int, us: float) -> str:
    return f"{us:.1f} ({n * k / us / 1e3 / COPY_CEILING_GBS:.0%})"


def against_scaled_mm(ms: list[int]) -> None:
    print("| scales | N x K | M | Triton us (% copy) | _scaled_mm us (% copy) | rel err Triton / _scaled_mm |")
    print("|---|---|---|---|---|---|")
    for block in (None, (128, 128)):
        for n, k in SHAPES:
            if block and k % 512:
                continue
            ws = weight_copies(n, k, block)
            fast = fl._scaled_mm_block_linear if block else fl._scaled_mm_linear
            for m in ms:
                x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
                ref = fl.fp8_linear_ref(x, ws[0])
                errs = (rel_err(fl._triton_fp8_linear(x, ws[0], None, True), ref), rel_err(fast(x, ws[0], None), ref))
                cur = graph_time_us([lambda w=w: fl._triton_fp8_linear(x, w, None, True) for w in ws])
                new = graph_time_us([lambda w=w: fast(x, w, None) for w in ws])
                print(f"| {'block' if block else 'channel'} | {n} x {k} | {m} | {pct(n, k, cur)} | {pct(n, k, new)} | "
                      f"{errs[0]:.1e} / {errs[1]:.1e} |", flush=True)


def tile_sweep(ms: list[int], tiles: list[tuple[int, ...]], block) -> None:
    print("| N x K | M | current us (% copy) | best tile | best us (% copy) | all (n:k:w:s us) |")
    print("|---|---|---|---|---|---|")
    for n, k in SHAPES:
        ws = weight_copies(n, k, block)
        for m in ms:
            x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
            ref = fl.fp8_linear_ref(x, ws[0])
            cur = graph_time_us([lambda w=w: fl._triton_fp8_linear(x, w, None, True) for w in ws])
            results = []
            for bn, bk, nw, ns, *split in tiles:
                tile = (16 if m <= 16 else 32, bn, bk, nw, ns, *split)
                try:
                    err = rel_err(fl._triton_fp8_linear(x, ws[0], None, True, tile=tile), ref)
                    assert err < 2e-2, err
                    us = graph_time_us([lambda w=w: fl._triton_fp8_linear(x, w, None, True, tile=tile) for w in ws])
                except Exception as exc:  # shared memory or register limits
                    print(f"    {tile}: {type(exc).__name__} {str(exc)[:80]}", flush=True)
                    continue
                results.append((us, ":".join(str(v) for v in tile[1:])))
            best = min(results)
            print(f"| {n} x {k} | {m} | {pct(n, k, cur)} | {best[1]} | {pct(n, k, best[0])} | "
                  + ", ".join(f"{t} {u:.1f}" for u, t in results) + " |", flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ms", default="")
    parser.add_argument("--tiles", default="", help="n:k:warps:stages[:splits],... of the tile kernel to sweep")
    parser.add_argument("--block", action="store_true", help="--tiles: 128x128 block scales instead of channel")
    args = parser.parse_args()
    torch.manual_seed(0)
    if args.tiles:
        ms = [int(v) for v in (args.ms or "4,8,16,32").split(",")]
        tile_sweep(ms, [tuple(int(v) for v in t.split(":")) for t in args.tiles.split(",")],
                   (128, 128) if args.block else None)
    else:
        against_scaled_mm([int(v) for v in (args.ms or "3,4,8,16,32,48,64").split(",")])


if __name__ == "__main__":
    main()
