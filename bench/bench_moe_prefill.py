"""The MoE at prefill sizes, random weights: GLM-4.5V's FP8 experts (E=128, k=8, H=4096, I=1408;
channel or block scales) and gpt-oss-120b's MXFP4 ones (E=128, k=4, H=I=2880; mxfp4_20b: gpt-oss-20b's
32 experts). The default
configuration against other tiles: for FP8 the tensor-core tiles on e4m3 activations
(MoeConfig.fp8_act), for MXFP4 the tensor-core tiles that decode each expert once (mx_mma). Per
token count: time per fused_moe call (median of 10 after two warm-ups, one routing per case),
TFLOP/s of its matmuls and GB/s over the distinct experts' bytes; with --kernels, the default's
kernels one by one (torch profiler). The first FP8 tile on e4m3 activations is checked against
the reference at each size, every MXFP4 tile against the default.
    python bench/bench_moe_prefill.py [--ts 64,256,1024,4096] [--only fp8_channel,fp8_block,mxfp4,mxfp4_20b]
        [--tiles 64:128:128:8:3,...] [--mma-tiles 32:64:128:4:3,...] [--kernels]
    (tiles block_m:block_n:block_k:num_warps:num_stages, FP8 ones with ":p" after them turned
    pairs-major (MoeConfig.pairs_major); either may add /block_n:block_k:num_warps:num_stages of the
    down kernel). With --kernels every variant's kernels are listed.
"""
from __future__ import annotations

import argparse
import os
import sys
from dataclasses import replace

import torch

sys.path.insert(0, os.path.dirname(__file__))
sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "tests", "kernels"))
from bench_moe_sweep import COPY_CEILING_GBS, expert_bytes, make_case  # noqa: E402
from kernel_checks import eager_time_ms, rel_err  # noqa: E402

from localchat.kernels.gpu_facts import gpu_arch  # noqa: E402
from localchat.kernels.moe import MoeConfig, default_config, fused_moe, fused_moe_ref  # noqa: E402
from localchat.kernels.moe_gemm import FMT_FP8_BLK, FMT_FP8_ROW, FMT_MXFP4  # noqa: E402
from localchat.kernels.moe_routing import route_glm, route_gpt_oss  # noqa: E402

# name -> (experts, top-k, hidden, intermediate, format code)
CASES = {"fp8_channel": (128, 8, 4096, 1408, FMT_FP8_ROW), "fp8_block": (128, 8, 4096, 1408, FMT_FP8_BLK),
         "mxfp4": (128, 4, 2880, 2880, FMT_MXFP4), "mxfp4_20b": (32, 4, 2880, 2880, FMT_MXFP4)}


def _mma_tile(spec: str) -> MoeConfig:
    main_tile, _, down = spec.partition("/")
    return MoeConfig(*(int(v) for v in main_tile.split(":")), mx_mma=True,
                     down_tile=tuple(int(v) for v in down.split(":")) if down else None)


def _fp8_tile(spec: str) -> MoeConfig:
    main_tile, _, down = spec.partition("/")
    parts = main_tile.split(":")
    return MoeConfig(*(int(v) for v in parts[:5]), fp8_act=True, pairs_major=parts[-1] == "p",
                     down_tile=tuple(int(v) for v in down.split(":")) if down else None)


def kernel_times_us(fn) -> list[tuple[str, float]]:
    """(kernel name, us) of one call of fn, in launch order, from the torch profiler."""
    fn()
    torch.cuda.synchronize()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    events = [e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
    return [(e.name[:60], e.device_time_total) for e in events]


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--ts", default="64,256,1024,4096")
    p.add_argument("--only", default="fp8_channel,fp8_block")
    p.add_argument("--tiles", default="64:128:128:8:3,64:128:128:4:4,128:128:128:8:3,64:256:128:8:3,32:128:128:4:4")
    p.add_argument("--mma-tiles", default="64:64:128:4:3,128:64:128:4:3,32:64:128:4:3,64:128:128:8:3")
    p.add_argument("--kernels", action="store_true", help="also list the default's kernels with their times")
    args = p.parse_args()
    fp8_tiles = [_fp8_tile(s) for s in args.tiles.split(",") if s]
    mma_tiles = [_mma_tile(s) for s in args.mma_tiles.split(",") if s]
    arch = gpu_arch(torch.device("cuda"))
    for fmt in args.only.split(","):
        e, k, h, i, code = CASES[fmt]
        experts = make_case("mxfp4" if code == FMT_MXFP4 else fmt, e, h, i)
        per_expert = expert_bytes(experts)
        mxfp4 = code == FMT_MXFP4
        tiles = mma_tiles if mxfp4 else fp8_tiles
        for t in (int(v) for v in args.ts.split(",")):
            x = torch.randn(t, h, device="cuda", dtype=torch.bfloat16)
            logits = torch.randn(t, e, device="cuda")
            w, ids = route_gpt_oss(logits, k) if mxfp4 else route_glm(logits, torch.randn(e, device="cuda") * 0.1, k)
            flops = 2 * t * k * 3 * i * h
            nbytes = per_expert * ids.unique().numel()
            base = default_config(t * k, e, code, True, 2, bf16=True if mxfp4 else False, tma=mxfp4, arch=arch)
            variants = [("default", None, base)]
            if not mxfp4 and not base.fp8_act:
                variants.append(("default tile, e4m3 activations", replace(base, fp8_act=True), None))
            variants += [(f"{c.block_m}x{c.block_n}x{c.block_k} w{c.num_warps} s{c.num_stages}"
                          + (" down {}x{} w{} s{}".format(*c.down_tile) if c.down_tile else "")
                          + (", e4m3" if c.fp8_act else "") + (", pairs-major" if c.pairs_major else ""), c, None)
                         for c in tiles]
            print(f"{fmt} T={t} ({t * k} pairs, {ids.unique().numel()} experts, {flops / 1e9:.0f} GFLOP, "
                  f"{nbytes / 1e9:.2f} GB):", flush=True)
            expected = fused_moe(x, experts, w, ids)
            for n, (label, cfg, shown) in enumerate(variants):
                try:
                    ms = eager_time_ms(lambda: fused_moe(x, experts, w, ids, config=cfg))
                except Exception as ex:  # a tile that does not fit this GPU's shared memory, say
                    print(f"  {label}: failed ({type(ex).__name__}: {str(ex)[:120]})")
                    continue
                note = ""
                if cfg is not None and (mxfp4 or cfg.fp8_act == base.fp8_act):
                    note = f"; rel err {rel_err(fused_moe(x, experts, w, ids, config=cfg), expected):.1e} against the default"
                if not mxfp4 and cfg is not None and cfg.fp8_act and n == len(variants) - len(tiles) and t <= 1024:
                    out = fused_moe(x, experts, w, ids, config=cfg)
                    alike = rel_err(out, fused_moe_ref(x, experts, w, ids, config=cfg))
                    exact = rel_err(out, fused_moe_ref(x, experts, w, ids, config=replace(base, fp8_act=False)))
                    note += f"; rel err {alike:.1e} against the reference quantised alike, {exact:.1e} unquantised"
                cfg_text = f" {shown}" if shown is not None else ""
                print(f"  {label}: {ms * 1e3:9.1f} us  {flops / ms / 1e9:6.0f} TFLOP/s  "
                      f"{nbytes / ms / 1e6:6.0f} GB/s ({nbytes / ms / 1e6 / COPY_CEILING_GBS:.0%} of copy){note}{cfg_text}",
                      flush=True)
                if args.kernels:
                    for name, us in kernel_times_us(lambda: fused_moe(x, experts, w, ids, config=cfg)):
                        print(f"    {us:9.1f} us  {name}")


if __name__ == "__main__":
    main()
