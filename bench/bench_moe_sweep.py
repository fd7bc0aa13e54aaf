"""Sweep MoE kernel configs at decode sizes on one GPU and print GB/s against the copy ceiling.

    python bench/bench_moe_sweep.py [--ts 1,8,32]

Cases: gpt-oss-120b MXFP4 (E=128, k=4, H=I=2880), GLM-4.5V FP8 channel and 128x128-block
(E=128, k=8, H=4096, I=1408), random weights. Each timing is a CUDA graph of 20 fused_moe calls,
each with its own routing (so consecutive calls read different experts and the 50 MB L2 does
not serve the next call's weights), median of 10 replays. Bytes: the selected experts' weights
and scales, averaged over the 20 routings. Every candidate's output is checked against the
default config's output before it is timed.
"""
from __future__ import annotations

import argparse
import os
import sys
import time

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "tests", "kernels"))
from kernel_checks import quantize_fp8_blocks, quantize_fp8_rows, random_mxfp4, rel_err  # noqa: E402

from localchat.engine.weights.formats import Fp8Weight, Mxfp4Weight  # noqa: E402
from localchat.kernels.moe import MoeConfig, MoeExperts, default_config, fused_moe, gpt_oss_experts  # noqa: E402
from localchat.kernels.moe_routing import route_glm, route_gpt_oss  # noqa: E402

COPY_CEILING_GBS = 4270.0  # measured device-to-device copy on one H200 (DESIGN.md)
CALLS = 20

# (block_n, block_k, num_warps, num_stages) of the row-streaming kernels tried at T=1
GEMV_MXFP4 = [(8, 512, 4, 1), (16, 256, 4, 1), (16, 512, 4, 1), (16, 512, 4, 3), (16, 1024, 8, 1),
              (32, 512, 8, 1), (8, 1024, 4, 1), (32, 256, 4, 1)]
GEMV_FP8 = GEMV_MXFP4
QUICK_MXFP4 = [(8, 512, 4, 1), (16, 256, 4, 1), (8, 1024, 4, 1), (4, 512, 4, 1), (8, 256, 2, 1)]
GEMV_FP8_BLOCK = [(8, 128, 4, 1), (16, 128, 4, 1), (32, 128, 4, 1), (16, 128, 4, 3)]


def make_case(fmt, e, h, i):
    if fmt == "mxfp4":
        return gpt_oss_experts(Mxfp4Weight(*random_mxfp4(e, 2 * i, h, device="cuda")),
                               torch.randn(e, 2 * i, device="cuda", dtype=torch.bfloat16),
                               Mxfp4Weight(*random_mxfp4(e, h, i, device="cuda")),
                               torch.randn(e, h, device="cuda", dtype=torch.bfloat16))
    ws = [torch.randn(e, *s, device="cuda") / s[1] ** 0.5 for s in ((i, h), (i, h), (h, i))]
    if fmt == "fp8_channel":
        return MoeExperts(*[Fp8Weight(*quantize_fp8_rows(w)) for w in ws])
    return MoeExperts(*[Fp8Weight(*quantize_fp8_blocks(w), block=(128, 128)) for w in ws])


def expert_bytes(experts) -> int:
    total = 0
    for w in (experts.gate, experts.up, experts.down):
        parts = (w.blocks, w.scales) if isinstance(w, Mxfp4Weight) else (w.weight, w.scale)
        total += sum(p[0].numel() * p.element_size() for p in parts)
    return total


def graph_time_us(fn_list) -> float:
    """Median us per call over a CUDA graph that replays every fn in fn_list once."""
    for fn in fn_list:
        fn()
    torch.cuda.synchronize()
    stream = torch.cuda.Stream()
    with torch.cuda.stream(stream):
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, stream=stream):
            for fn in fn_list:
                fn()
    torch.cuda.synchronize()
    graph.replay()
    times = []
    for _ in range(10):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end) * 1000 / len(fn_list))
    return sorted(times)[len(times) // 2]


def time_config(x, experts, routings, cfg, ref):
    """-> (us per call, rel err vs ref) or None when the config does not compile."""
    try:
        out = fused_moe(x, experts, *routings[0], config=cfg)
        err = rel_err(out, ref)
        us = graph_time_us([lambda w=w, ids=ids: fused_moe(x, experts, w, ids, config=cfg) for w, ids in routings])
    except Exception as exc:  # e.g. shared memory or register limits
        print(f"    {cfg}: failed {type(exc).__name__}: {str(exc)[:160]}", flush=True)
        return None
    return us, err


def line(name, t, label, us, nbytes, err):
    gbs = nbytes / us / 1e3
    text = (f"| {name:<22} | {t:>3} | {label:<40} | {us:8.1f} | {nbytes / 1e6:8.2f} | {gbs:6.0f} | "
            f"{gbs / COPY_CEILING_GBS:5.1%} | {err:.1e} |")
    print(text, flush=True)
    return text


def sweep_case(name, fmt, e, k, h, i, ts, rows, quick):
    experts = make_case(fmt, e, h, i)
    per_expert = expert_bytes(experts)
    fmt_code = {"mxfp4": 3, "fp8_channel": 1, "fp8_block": 2}[fmt]
    grid = {"mxfp4": GEMV_MXFP4, "fp8_channel": GEMV_FP8, "fp8_block": GEMV_FP8_BLOCK}[fmt]
    if quick:  # the defaults' neighbourhood only: MXFP4 candidates, FP8 defaults
        grid = QUICK_MXFP4 if fmt == "mxfp4" else []
    ranked: list[tuple[float, tuple]] = []
    for t in ts:
        x = torch.randn(t, h, device="cuda", dtype=torch.bfloat16)
        routings = []
        for _ in range(CALLS):
            logits = torch.randn(t, e, device="cuda")
            routings.append(route_gpt_oss(logits, k) if fmt == "mxfp4" else route_glm(logits, None, k))
        nbytes = per_expert * sum(ids.unique().numel() for _, ids in routings) / CALLS
        # the tensor-core tile default these sizes had before the row-streaming kernels
        old = MoeConfig(16, 32, 256 if fmt == "mxfp4" else 128, 4, 4)
        ref = fused_moe(x, experts, *routings[0], config=old)
        results = []
        res = time_config(x, experts, routings, old, ref)
        if res:
            rows.append(line(name, t, f"tile {old.block_m}x{old.block_n}x{old.block_k} w{old.num_warps} s{old.num_stages}",
                             res[0], nbytes, res[1]))
        cur = default_config(t * k, e, fmt_code, True, 2)
        if cur.gemv:
            res = time_config(x, experts, routings, cur, ref)
            if res:
                rows.append(line(name, t, "current default: " + _label(cur), res[0], nbytes, res[1]))
        if t == ts[0]:
            cands = [MoeConfig(1, bn, bk, nw, ns, gemv=True) for bn, bk, nw, ns in grid]
        else:
            top = [c for _, c in sorted(ranked, key=lambda r: r[0])[:2 if quick else 3]]
            cands = [MoeConfig(bm, c.block_n, c.block_k, c.num_warps, c.num_stages, gemv=True)
                     for c in top for bm in ((1,) if quick else (1, 2, 4))]
        for cfg in cands:
            res = time_config(x, experts, routings, cfg, ref)
            if res is None:
                continue
            results.append((res[0], cfg))
            rows.append(line(name, t, _label(cfg), res[0], nbytes, res[1]))
        if t == ts[0]:
            ranked = results
        if not results:
            continue
        best = min(results, key=lambda r: r[0])
        print(f"    best {name} T={t}: {_label(best[1])} {best[0]:.1f} us", flush=True)
    del experts
    torch.cuda.empty_cache()


def _label(cfg):
    return (f"gemv m{cfg.block_m} n{cfg.block_n} k{cfg.block_k} w{cfg.num_warps} s{cfg.num_stages}"
            if cfg.gemv else f"tile {cfg.block_m}x{cfg.block_n}x{cfg.block_k} w{cfg.num_warps} s{cfg.num_stages}")


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ts", default="1,8,32")
    parser.add_argument("--only", default="mxfp4,fp8_channel,fp8_block")
    parser.add_argument("--quick", action="store_true", help="time the defaults and a few MXFP4 neighbours")
    args = parser.parse_args()
    torch.manual_seed(0)
    ts = [int(v) for v in args.ts.split(",")]
    dev = torch.cuda.get_device_properties(0)
    print(f"# {dev.name}, {dev.multi_processor_count} SMs, torch {torch.__version__}, {time.strftime('%Y-%m-%d')}")
    header = ("| case | T | config | us | MB | GB/s | % copy | rel err vs tile |\n"
              "|---|---|---|---|---|---|---|---|")
    print(header)
    rows: list[str] = []
    cases = [("gpt-oss-120b MXFP4", "mxfp4", 128, 4, 2880, 2880),
             ("GLM-4.5V FP8 channel", "fp8_channel", 128, 8, 4096, 1408),
             ("GLM-4.5V FP8 block", "fp8_block", 128, 8, 4096, 1408)]
    for case in cases:
        if case[1] in args.only.split(","):
            sweep_case(*case, ts, rows, args.quick)
    out = os.environ.get("OUT")
    if out:
        with open(os.path.join(out, "moe_sweep.md"), "w") as f:
            f.write(header + "\n" + "\n".join(rows) + "\n")


if __name__ == "__main__":
    main()
