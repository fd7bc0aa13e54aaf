"""Probe: a decode-size MXFP4 MoE call as two halves of each token's experts on two streams
inside the CUDA graph (the ramp and tail of one half's kernels under the other's), against one
call. Method as bench/bench_moe_sweep.py (graph of 20 calls with 20 routings, weights out of L2).

    python bench/moe_streams_probe.py [--ts 1,2,4,8,32] [--only mxfp4,mxfp4_20b]
"""
from __future__ import annotations

import argparse
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(__file__))
sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "tests", "kernels"))
from bench_moe_sweep import COPY_CEILING_GBS, expert_bytes, graph_time_us, make_case, random_routings  # noqa: E402
from kernel_checks import rel_err  # noqa: E402

from localchat.kernels.moe import fused_moe  # noqa: E402

CASES = {"mxfp4": ("gpt-oss-120b MXFP4", 128, 4, 2880, 2880), "mxfp4_20b": ("gpt-oss-20b MXFP4", 32, 4, 2880, 2880)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ts", default="1,2,4,8,32")
    parser.add_argument("--only", default="mxfp4,mxfp4_20b")
    args = parser.parse_args()
    torch.manual_seed(0)
    side = [torch.cuda.Stream(), torch.cuda.Stream()]
    print("| case | T | one call us | two halves, one stream us | two halves, two streams us | % copy (one / two streams) | rel err |")
    print("|---|---|---|---|---|---|---|")
    for key in args.only.split(","):
        name, e, k, h, i = CASES[key]
        experts = make_case("mxfp4", e, h, i)
        per_expert = expert_bytes(experts)
        half = k // 2
        for t in (int(v) for v in args.ts.split(",")):
            x = torch.randn(t, h, device="cuda", dtype=torch.bfloat16)
            routings = random_routings("mxfp4", t, e, k)
            nbytes = sum(per_expert * ids.unique().numel() for _, ids in routings) / len(routings)

            def one(w, ids):
                return fused_moe(x, experts, w, ids)

            def halves_serial(w, ids):
                return fused_moe(x, experts, w[:, :half], ids[:, :half]) + fused_moe(x, experts, w[:, half:], ids[:, half:])

            def halves_streams(w, ids):
                cur = torch.cuda.current_stream()
                outs = []
                for s, cols in zip(side, (slice(0, half), slice(half, k))):
                    s.wait_stream(cur)
                    with torch.cuda.stream(s):
                        outs.append(fused_moe(x, experts, w[:, cols], ids[:, cols]))
                for s in side:
                    cur.wait_stream(s)
                return outs[0] + outs[1]

            ref = one(*routings[0])
            err = rel_err(halves_streams(*routings[0]), ref)
            us = [graph_time_us([lambda w=w, ids=ids, f=f: f(w, ids) for w, ids in routings])
                  for f in (one, halves_serial, halves_streams)]
            pct = [nbytes / u / 1e3 / COPY_CEILING_GBS for u in (us[0], us[2])]
            print(f"| {name} | {t} | {us[0]:.1f} | {us[1]:.1f} | {us[2]:.1f} | {pct[0]:.1%} / {pct[1]:.1%} | {err:.1e} |",
                  flush=True)
        experts = None  # noqa: F841 (free the stack before the next case)
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
