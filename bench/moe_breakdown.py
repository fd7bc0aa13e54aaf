"""Where one fused_moe call's time goes at decode sizes: each kernel's device time (profiler,
mean over 20 calls with different routings) beside the CUDA-graph time per call, whose
difference is the time between kernels (launch gaps, ramp-up and tails).

    python bench/moe_breakdown.py [--ts 1,8] [--only mxfp4,mxfp4_20b,fp8_channel,fp8_block,dense] [--words] [--rows ...]

Cases as in bench/bench_moe_sweep.py; --words also times MXFP4's word-decode kernels (n8 k256 w1);
--shared adds one expert that every token takes with weight 1, as GLM-4.5V's shared expert is run
once folded into the routed stacks (engine/weights/shared_expert.py): E + 1 experts, k + 1 pairs a token.
"""
from __future__ import annotations

import argparse
import os
import re
import sys
from collections import defaultdict
from dataclasses import replace

import torch
from torch.profiler import ProfilerActivity, profile

sys.path.insert(0, os.path.dirname(__file__))
sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "tests", "kernels"))
from bench_moe_sweep import (CALLS, COPY_CEILING_GBS, expert_bytes, graph_time_us, make_case,  # noqa: E402
                             random_routings)
from kernel_checks import rel_err, with_aligned_scale_rows  # noqa: E402

from localchat.kernels.gpu_facts import gpu_arch  # noqa: E402
from localchat.kernels.moe import MoeConfig, default_config, fused_moe  # noqa: E402
from localchat.kernels.moe_routing import with_shared_expert  # noqa: E402

CASES = {"mxfp4": ("gpt-oss-120b MXFP4", 128, 4, 2880, 2880, 3),
         "mxfp4_20b": ("gpt-oss-20b MXFP4", 32, 4, 2880, 2880, 3),
         "fp8_channel": ("GLM-4.5V FP8 channel", 128, 8, 4096, 1408, 1),
         "fp8_block": ("GLM-4.5V FP8 block", 128, 8, 4096, 1408, 2),
         "dense": ("GLM-4.5V bf16", 128, 8, 4096, 1408, 0)}


def kernel_times_us(calls) -> dict[str, float]:
    """name -> mean device us per call of the kernels launched by the calls (eager)."""
    for fn in calls:
        fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for fn in calls:
            fn()
        torch.cuda.synchronize()
    totals: dict[str, float] = defaultdict(float)
    for ev in prof.events():
        if ev.device_type == torch.autograd.DeviceType.CUDA:
            totals[ev.name[:48]] += ev.device_time / len(calls)
    return dict(totals)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ts", default="1,8")
    parser.add_argument("--only", default="mxfp4,fp8_channel,fp8_block")
    parser.add_argument("--words", action="store_true", help="MXFP4: also time the word-decode kernels "
                        "(the default before the packed-f16 kernels)")
    parser.add_argument("--rows", "--fp8-rows", default="",
                        help="also time these tiles, kind:n:k:warps:stages with kind gemv or gemvM (M pairs of an "
                        "expert per program; FP8 and dense), tileM (tensor-core tiles of M rows; FP8 and dense), "
                        "half2 (MXFP4 packed f16) or mmaM (MXFP4 tensor-core tiles of M pairs, moe_mx_mma.py; "
                        "option dN:K:W:S), e.g. gemv:32:256:4:3,gemv4:32:256:4:3,tile16:64:128:4:4; options of gemv "
                        "after slashes: c sums each token's rows in the down kernel, dN:K:W:S is the down "
                        "kernel's tile (gemv:16:256:2:3/d64:256:4:3/c); of half2: tK, the K step after the last "
                        "whole one (half2:8:256:1:3/t256: one masked step), w: 16-byte activation loads in gate/up, "
                        "dN:K:W:S the down kernel's tile, T / Tg: the TMA kernels for both / gate/up (K steps of 512; "
                        "t0: the last step past K on zeros), P: two pairs of one expert per program (with T and "
                        "t0; e.g. half2:16:512:1:3/T/t0/w/d32:512:1:3/P), rN: down held to N registers a thread, "
                        "RN: gate/up (and down, without rN)")
    parser.add_argument("--shared", action="store_true",
                        help="FP8 and bf16 cases: one more expert taken by every token with weight 1")
    args = parser.parse_args()
    torch.manual_seed(0)
    for key in args.only.split(","):
        name, e, k, h, i, fmt_code = CASES[key]
        mx = key.startswith("mxfp4")
        family = "mxfp4" if mx else key  # make_case / random_routings know one MXFP4 case
        shared = args.shared and not mx
        if shared:
            name += " + shared expert"
        experts = make_case(family, e + shared, h, i)
        # MXFP4: scale rows 16-byte aligned, as the loader stores them (the TMA kernels need it);
        # the default also on the checkpoint's unpadded rows, where it takes the pointer kernels
        raw = experts
        if mx:
            experts = with_aligned_scale_rows(experts)
        per_expert = expert_bytes(experts)
        for t in (int(v) for v in args.ts.split(",")):
            x = torch.randn(t, h, device="cuda", dtype=torch.bfloat16)
            routings = random_routings(family, t, e, k)
            if shared:
                routings = [with_shared_expert(w, ids, e) for w, ids in routings]
            nbytes = per_expert * sum(ids.unique().numel() for _, ids in routings) / CALLS
            base = default_config(t * (k + shared), e + shared, fmt_code, True, 2, tma=mx, arch=gpu_arch(x.device))
            variants = [("default", base)] + ([("default, unpadded scale rows", None)] if mx else [])
            if mx and args.words:
                variants.append(("words", MoeConfig(1, 8, 256, 1, 3, gemv=True, mx_words=True)))
            for spec in filter(None, args.rows.split(",")):
                tile, *options = spec.split("/")
                kind, bn, bk, nw, ns = tile.split(":")
                mx_kind = kind == "half2" or kind.startswith("mma")
                if mx_kind != mx:
                    continue  # half2 and mma tiles are for MXFP4 only, the others for FP8 and bf16
                # gemvM: M pairs of one expert per program (grouped by moe_align); tileM / mmaM:
                # tensor-core tiles of M rows
                bm = 1 if kind == "half2" else int(re.sub(r"^[a-z]+", "", kind) or 1)
                cfg = MoeConfig(bm, int(bn), int(bk), int(nw), int(ns), gemv=kind.startswith("gemv") or kind == "half2",
                                mx_half2=kind == "half2", mx_mma=kind.startswith("mma"))
                # gemv with one pair per program: c, dN:K:W:S; half2: tK, w, dN:K:W:S, T, Tg, P, rN, RN
                for opt in options:
                    if opt == "P":
                        cfg = replace(cfg, block_m=2)
                    elif opt == "c":
                        cfg = replace(cfg, fused_combine=True)
                    elif opt == "w":
                        cfg = replace(cfg, wide_x=True)
                    elif opt == "T":
                        cfg = replace(cfg, tma=True, tma_down=True)
                    elif opt == "Tg":
                        cfg = replace(cfg, tma=True)
                    elif opt.startswith("t"):
                        cfg = replace(cfg, tail_k=int(opt[1:]))
                    elif opt.startswith("r"):
                        cfg = replace(cfg, down_max_registers=int(opt[1:]))
                    elif opt.startswith("R"):
                        cfg = replace(cfg, max_registers=int(opt[1:]))
                    elif opt.startswith("d"):
                        cfg = replace(cfg, down_tile=tuple(int(v) for v in opt[1:].split(":")))
                variants.append((spec, cfg))
            w0, ids0 = routings[0]
            expected = fused_moe(x, experts, w0, ids0, config=base).float()
            for label, cfg in variants:
                ex = raw if cfg is None else experts  # None: fused_moe's own choice on the unpadded rows
                try:
                    err = rel_err(fused_moe(x, ex, w0, ids0, config=cfg), expected)
                except Exception as e:  # a tile that does not compile or fit: report it, go on
                    print(f"{name} T={t} {label}: failed, {type(e).__name__}: {str(e)[:200]}", flush=True)
                    continue
                calls = [lambda w=w, ids=ids, cfg=cfg, ex=ex: fused_moe(x, ex, w, ids, config=cfg)
                         for w, ids in routings]
                graph_us = graph_time_us(calls)
                kernels = kernel_times_us(calls)
                busy = sum(kernels.values())
                print(f"{name} T={t} {label}: graph {graph_us:.1f} us per call "
                      f"({nbytes / graph_us / 1e3 / COPY_CEILING_GBS:.1%} of copy), kernels {busy:.1f} us, "
                      f"between kernels {graph_us - busy:.1f} us, rel err to the default {err:.1e}", flush=True)
                for kname, us in sorted(kernels.items(), key=lambda kv: -kv[1]):
                    print(f"    {us:7.1f} us  {kname}", flush=True)
        del experts
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
