"""Sweep MoE kernel configs at decode sizes on one GPU and print GB/s against the copy ceiling.

    python bench/bench_moe_sweep.py [--ts 1,8,32] [--only mxfp4,fp8_channel,fp8_block,mxfp4_20b] [--tile] [--tiles] [--half2]

Cases: gpt-oss-120b MXFP4 (E=128, k=4, H=I=2880), GLM-4.5V FP8 channel and 128x128-block
(E=128, k=8, H=4096, I=1408), gpt-oss-20b (E=32, defaults only), random weights. Each timing is a CUDA graph of 20 fused_moe calls,
each with its own routing (so consecutive calls read different experts and the 50 MB L2 does
not serve the next call's weights), median of 10 replays. Bytes: the selected experts' weights
and scales, averaged over the 20 routings. Every candidate's output is checked against the
previous default's (the per-chunk-reduction row kernel) before it is timed, and the table is
rewritten to $OUT/moe_sweep.md after every row. Candidates: NEW_CANDIDATES below.
"""
from __future__ import annotations

import argparse
import os
import sys
import time

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "tests", "kernels"))
from kernel_checks import random_glm_weights, random_gpt_oss_experts, rel_err  # noqa: E402

from localchat.engine.weights.formats import Mxfp4Weight  # noqa: E402
from localchat.kernels.gpu_facts import gpu_arch  # noqa: E402
from localchat.kernels.moe import MoeConfig, MoeExperts, default_config, fused_moe  # noqa: E402
from localchat.kernels.moe_routing import route_glm, route_gpt_oss  # noqa: E402

COPY_CEILING_GBS = 4270.0  # measured device-to-device copy on one H200 (DESIGN.md)
CALLS = 20
L2_ROTATION_BYTES = 160e6  # more than 3x the H200's 50 MB L2


def copies_out_of_l2(nbytes: float) -> int:
    """How many buffers of nbytes to rotate through so that none is still in L2 when its turn
    comes round again."""
    return max(2, int(L2_ROTATION_BYTES // nbytes) + 1)

# (block_m, block_n, block_k, num_warps) of the row kernels tried per token count: MXFP4 word
# decode (mx_words + prefetch) and the dense/FP8 row kernels pipelined 3 deep; block_m > 1
# groups each expert's pairs through moe_align so its weights are decoded/read once.
NEW_CANDIDATES = {
    "mxfp4": {
        1: [(1, 8, 256, 1), (1, 16, 256, 2), (1, 16, 512, 4), (1, 32, 256, 4), (1, 8, 512, 1)],
        8: [(1, 8, 256, 1), (1, 16, 256, 2), (1, 16, 512, 4), (1, 32, 256, 4)],
        32: [(1, 16, 256, 2), (1, 32, 256, 4), (2, 16, 256, 4), (4, 16, 256, 4), (2, 8, 256, 2)],
    },
    "fp8_channel": {
        1: [(1, 16, 256, 4), (1, 16, 128, 4), (1, 32, 128, 4), (1, 8, 256, 2), (1, 16, 512, 4)],
        8: [(1, 16, 256, 4), (1, 16, 128, 4), (1, 32, 128, 4)],
        32: [(1, 16, 256, 4), (1, 16, 128, 4), (2, 16, 128, 4), (2, 8, 256, 2)],
    },
}
NEW_CANDIDATES["fp8_block"] = NEW_CANDIDATES["fp8_channel"]

# (block_m, block_n, block_k, num_warps, num_stages, mx_dot_scaled) of the tensor-core tile
# kernels (--tiles): each expert's pairs grouped by moe_align, the weight tile the left operand.
TILE_CANDIDATES = {
    "mxfp4": [(16, 32, 256, 4, 4, True), (16, 64, 256, 4, 3, True), (16, 64, 128, 4, 4, True),
              (16, 128, 128, 4, 3, True), (16, 128, 128, 8, 3, True), (16, 64, 256, 4, 3, False),
              (16, 128, 128, 8, 3, False), (16, 32, 512, 4, 2, True)],
    "fp8_channel": [(16, 32, 128, 4, 4, True), (16, 64, 128, 4, 4, True), (16, 128, 128, 4, 3, True),
                    (16, 128, 128, 8, 3, True), (16, 64, 256, 4, 3, True)],
}
TILE_CANDIDATES["fp8_block"] = [c for c in TILE_CANDIDATES["fp8_channel"] if c[2] <= 128]
# (block_m, block_n, block_k, num_warps, num_stages) of row kernels timed with --tiles: whether
# the compiler's software pipeliner keeps more K chunks in flight for loads that feed no dot
STAGED_ROW_CANDIDATES = {"mxfp4": [(1, 8, 256, 1, 3), (1, 16, 256, 2, 3), (1, 8, 512, 4, 3)],
                         "fp8_channel": [(1, 16, 256, 4, 3), (1, 16, 512, 4, 3)],
                         "fp8_block": [(1, 16, 256, 4, 3), (1, 32, 128, 4, 3)]}


# (block_n, block_k, num_warps, num_stages) of the MXFP4 packed-f16 row kernels (--half2)
HALF2_CANDIDATES = [(8, 256, 1, 3), (16, 256, 2, 3), (32, 256, 4, 3), (16, 512, 4, 3), (8, 512, 2, 3),
                    (32, 512, 8, 3)]

# (block_m, block_n, block_k, num_warps, num_stages) of the MXFP4 tensor-core tiles (--mma-tiles)
MMA_CANDIDATES: list[tuple[int, ...]] = []  # optionally (+ down n, k, warps, stages)


def make_case(fmt, e, h, i):
    """Random experts: gpt-oss MXFP4, or GLM-shaped "fp8_channel" / "fp8_block" / "dense" (bf16)."""
    if fmt == "mxfp4":
        return random_gpt_oss_experts(e, i, h, bias_dtype=torch.bfloat16, device="cuda")
    return MoeExperts(*random_glm_weights(fmt, e, i, h, dtype=torch.bfloat16, device="cuda"))


def expert_bytes(experts) -> int:
    """Bytes of one expert's three weights with their scales."""
    total = 0
    for w in (experts.gate, experts.up, experts.down):
        parts = [w.blocks, w.scales] if isinstance(w, Mxfp4Weight) else [t for t in vars(w).values()
                                                                          if isinstance(t, torch.Tensor)]
        total += sum(p[0].numel() * p.element_size() for p in parts)
    return total


def random_routings(fmt, t, e, k) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """CALLS routings (weights, ids) of t tokens from random logits, by the format's model family."""
    out = []
    for _ in range(CALLS):
        logits = torch.randn(t, e, device="cuda")
        out.append(route_gpt_oss(logits, k) if fmt == "mxfp4" else route_glm(logits, None, k))
    return out


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
    # The GPU lowers its clock while idle (compilation, capture): without ~50 ms of load first,
    # whichever variant was timed first in a group measured ~3 us slower per call at one token.
    warm_until = time.perf_counter() + 0.05
    while time.perf_counter() < warm_until:
        graph.replay()
        torch.cuda.synchronize()
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


def new_config(fmt, bm, bn, bk, nw):
    if fmt == "mxfp4":
        return MoeConfig(bm, bn, bk, nw, 1, gemv=True, mx_words=True, prefetch=True)
    return MoeConfig(bm, bn, bk, nw, 3, gemv=True)


def sweep_case(name, fmt, e, k, h, i, ts, rows, with_tile, candidates=True, tiles=False, half2=False):
    experts = make_case(fmt, e, h, i)
    per_expert = expert_bytes(experts)
    fmt_code = {"mxfp4": 3, "fp8_channel": 1, "fp8_block": 2}[fmt]
    for t in ts:
        x = torch.randn(t, h, device="cuda", dtype=torch.bfloat16)
        routings = random_routings(fmt, t, e, k)
        nbytes = per_expert * sum(ids.unique().numel() for _, ids in routings) / CALLS
        # errors are against the per-chunk-reduction gemv default (the previous default)
        cur = default_config(t * k, e, fmt_code, True, 2, arch=gpu_arch(x.device))
        prev = MoeConfig(1, {"mxfp4": 8, "fp8_channel": 16, "fp8_block": 32}[fmt],
                         {"mxfp4": 512, "fp8_channel": 256, "fp8_block": 128}[fmt], 4, 1, gemv=True)
        ref = fused_moe(x, experts, *routings[0], config=prev)
        cands = [("previous default: " + _label(prev), prev)]
        if cur != prev:
            cands.append(("current default: " + _label(cur), cur))
        if with_tile:
            tile = MoeConfig(16, 32, 256 if fmt == "mxfp4" else 128, 4, 4)
            cands.append((_label(tile), tile))
        for spec in NEW_CANDIDATES[fmt].get(t, NEW_CANDIDATES[fmt][32]) if candidates and not tiles else []:
            cfg = new_config(fmt, *spec)
            cands.append((_label(cfg), cfg))
        for bn, bk, nw, ns in HALF2_CANDIDATES if half2 and fmt == "mxfp4" else []:
            cfg = MoeConfig(1, bn, bk, nw, ns, gemv=True, mx_half2=True)
            cands.append((_label(cfg) + f" s{ns}", cfg))
        for bm, bn, bk, nw, ns, *down in MMA_CANDIDATES if fmt == "mxfp4" else []:
            cfg = MoeConfig(bm, bn, bk, nw, ns, mx_mma=True, down_tile=tuple(down) or None)
            cands.append((_label(cfg), cfg))
        for bm, bn, bk, nw, ns in STAGED_ROW_CANDIDATES[fmt] if tiles else []:
            cfg = MoeConfig(bm, bn, bk, nw, ns, gemv=True, mx_words=fmt == "mxfp4" and bk <= 256)
            cands.append((_label(cfg) + f" s{ns}", cfg))
        for bm, bn, bk, nw, ns, dot_scaled in TILE_CANDIDATES[fmt] if tiles else []:
            cfg = MoeConfig(bm, bn, bk, nw, ns, mx_dot_scaled=dot_scaled)
            cands.append((_label(cfg), cfg))
        results = []
        for label, cfg in cands:
            res = time_config(x, experts, routings, cfg, ref)
            if res is None:
                continue
            results.append((res[0], label))
            rows.append(line(name, t, label, res[0], nbytes, res[1]))
            _flush(rows)
        if results:
            best = min(results)
            print(f"    best {name} T={t}: {best[1]} {best[0]:.1f} us", flush=True)
    del experts
    torch.cuda.empty_cache()


HEADER = ("| case | T | config | us | MB | GB/s | % copy | rel err vs previous default |\n"
          "|---|---|---|---|---|---|---|---|")


def _flush(rows):
    """Rewrite $OUT/moe_sweep.md after every row, so a run stopped at its time limit keeps its rows."""
    out = os.environ.get("OUT")
    if out:
        with open(os.path.join(out, "moe_sweep.md"), "w") as f:
            f.write(HEADER + "\n" + "\n".join(rows) + "\n")


def _label(cfg):
    if not cfg.gemv:
        decode = " mma" if cfg.mx_mma else "" if cfg.mx_dot_scaled else " bit-decode"
        if cfg.down_tile:
            decode += " down n{}k{}w{}s{}".format(*cfg.down_tile)
        return f"tile {cfg.block_m}x{cfg.block_n}x{cfg.block_k} w{cfg.num_warps} s{cfg.num_stages}{decode}"
    kind = ("half2" if cfg.mx_half2 else "words" if cfg.mx_words else "gemv") + (" pf" if cfg.prefetch else "")
    regs = (f" r{cfg.max_registers}" if cfg.max_registers else "") + (
        f" down r{cfg.down_max_registers}" if cfg.down_max_registers else "")
    return f"{kind} m{cfg.block_m} n{cfg.block_n} k{cfg.block_k} w{cfg.num_warps}{regs}"


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ts", default="1,8,32")
    parser.add_argument("--only", default="mxfp4,fp8_channel,fp8_block,mxfp4_20b")
    parser.add_argument("--tile", action="store_true", help="also time the tensor-core tile kernel")
    parser.add_argument("--half2", action="store_true", help="time the MXFP4 packed-f16 kernels (HALF2_CANDIDATES) "
                        "instead")
    parser.add_argument("--half2-tiles", default="", help="with --half2: these tiles instead of HALF2_CANDIDATES, "
                        "n:k:warps:stages,..., e.g. 8:256:1:3,16:256:1:2")
    parser.add_argument("--mma-tiles", default="", help="MXFP4 tensor-core tiles of kernels/moe_mx_mma.py "
                        "instead of the row candidates, m:n:k:warps:stages[/n:k:warps:stages of down],..., "
                        "e.g. 16:128:128:4:3,8:16:128:1:3/32:128:1:3")
    parser.add_argument("--tiles", action="store_true", help="sweep tensor-core tiles (TILE_CANDIDATES) "
                        "instead of the row-kernel candidates")
    args = parser.parse_args()
    torch.manual_seed(0)
    ts = [int(v) for v in args.ts.split(",")]
    if args.mma_tiles:
        MMA_CANDIDATES[:] = [tuple(int(v) for v in spec.replace("/", ":").split(":"))
                             for spec in args.mma_tiles.split(",")]
    if args.half2_tiles:
        HALF2_CANDIDATES[:] = [tuple(int(v) for v in spec.split(":")) for spec in args.half2_tiles.split(",")]
    dev = torch.cuda.get_device_properties(0)
    print(f"# {dev.name}, {dev.multi_processor_count} SMs, torch {torch.__version__}, {time.strftime('%Y-%m-%d')}")
    print(HEADER)
    rows: list[str] = []
    cases = [("mxfp4", "gpt-oss-120b MXFP4", "mxfp4", 128, 4, 2880, 2880),
             ("fp8_channel", "GLM-4.5V FP8 channel", "fp8_channel", 128, 8, 4096, 1408),
             ("fp8_block", "GLM-4.5V FP8 block", "fp8_block", 128, 8, 4096, 1408),
             ("mxfp4_20b", "gpt-oss-20b MXFP4", "mxfp4", 32, 4, 2880, 2880)]
    for key, *case in cases:
        if key in args.only.split(","):
            # gpt-oss-20b: the defaults only, against the previous default
            sweep_case(*case, ts, rows, args.tile,
                       candidates=key != "mxfp4_20b" and not args.half2 and not args.mma_tiles,
                       tiles=args.tiles, half2=args.half2)
    _flush(rows)


if __name__ == "__main__":
    main()
