"""The FP8 MoE at prefill sizes (GLM-4.5V: E=128, k=8, H=4096, I=1408, random weights): the
default configuration against the tensor-core tiles on e4m3 activations (MoeConfig.fp8_act) in a
few tile shapes, per token count and scale layout; time per fused_moe call (median of 10 after two
warm-ups, one routing per case), TFLOP/s of its matmuls and GB/s over the distinct experts' bytes.
The first tile on e4m3 activations is also checked against the reference at each size.
    python bench/bench_moe_prefill.py [--ts 64,256,1024,4096] [--only fp8_channel,fp8_block]
        [--tiles 64:128:128:8:3,...]   (block_m:block_n:block_k:num_warps:num_stages)
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
from localchat.kernels.moe_gemm import FMT_FP8_BLK, FMT_FP8_ROW  # noqa: E402
from localchat.kernels.moe_routing import route_glm  # noqa: E402

E, K, H, I = 128, 8, 4096, 1408


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--ts", default="64,256,1024,4096")
    p.add_argument("--only", default="fp8_channel,fp8_block")
    p.add_argument("--tiles", default="64:128:128:8:3,64:128:128:4:4,128:128:128:8:3,64:256:128:8:3,32:128:128:4:4")
    args = p.parse_args()
    tiles = [MoeConfig(*(int(v) for v in s.split(":")), fp8_act=True) for s in args.tiles.split(",")]
    arch = gpu_arch(torch.device("cuda"))
    for fmt in args.only.split(","):
        experts = make_case(fmt, E, H, I)
        per_expert = expert_bytes(experts)
        code = FMT_FP8_ROW if fmt == "fp8_channel" else FMT_FP8_BLK
        for t in (int(v) for v in args.ts.split(",")):
            x = torch.randn(t, H, device="cuda", dtype=torch.bfloat16)
            w, ids = route_glm(torch.randn(t, E, device="cuda"), torch.randn(E, device="cuda") * 0.1, K)
            flops = 2 * t * K * 3 * I * H
            nbytes = per_expert * ids.unique().numel()
            base = default_config(t * K, E, code, True, 2, bf16=False, arch=arch)
            variants = [("default", None, base)]
            if not base.fp8_act:
                variants.append(("default tile, e4m3 activations", replace(base, fp8_act=True), None))
            variants += [(f"{c.block_m}x{c.block_n}x{c.block_k} w{c.num_warps} s{c.num_stages}, e4m3", c, None)
                         for c in tiles]
            print(f"{fmt} T={t} ({t * K} pairs, {ids.unique().numel()} experts, {flops / 1e9:.0f} GFLOP, "
                  f"{nbytes / 1e9:.2f} GB):", flush=True)
            for i, (label, cfg, shown) in enumerate(variants):
                try:
                    ms = eager_time_ms(lambda: fused_moe(x, experts, w, ids, config=cfg))
                except Exception as e:  # a tile that does not fit this GPU's shared memory, say
                    print(f"  {label}: failed ({type(e).__name__}: {str(e)[:120]})")
                    continue
                note = ""
                if cfg is not None and cfg.fp8_act and i == len(variants) - len(tiles) and t <= 1024:
                    out = fused_moe(x, experts, w, ids, config=cfg)
                    alike = rel_err(out, fused_moe_ref(x, experts, w, ids, config=cfg))
                    exact = rel_err(out, fused_moe_ref(x, experts, w, ids, config=replace(base, fp8_act=False)))
                    note = f"; rel err {alike:.1e} against the reference quantised alike, {exact:.1e} unquantised"
                cfg_text = f" {shown}" if shown is not None else ""
                print(f"  {label}: {ms * 1e3:9.1f} us  {flops / ms / 1e9:6.0f} TFLOP/s  "
                      f"{nbytes / ms / 1e6:6.0f} GB/s ({nbytes / ms / 1e6 / COPY_CEILING_GBS:.0%} of copy){note}{cfg_text}",
                      flush=True)


if __name__ == "__main__":
    main()
