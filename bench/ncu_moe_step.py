"""One fused_moe call at a decode size, between cudaProfilerStart/Stop, for Nsight Compute:

    ncu --clock-control none --profile-from-start off --set full python bench/ncu_moe_step.py mxfp4 1 [n:k:w:s]

Cases as in bench/bench_moe_sweep.py (mxfp4, mxfp4_20b, fp8_channel, fp8_block); the default
config for that size, the row-kernel tile n:k:warps:stages (packed-f16 for MXFP4), or
mma:m:n:k:warps:stages, a tile of the MXFP4 tensor-core kernels. The call runs twice before the profiled one (compilation, warm-up).
"""
from __future__ import annotations

import os
import sys

import torch

sys.path.insert(0, os.path.dirname(__file__))
from bench_moe_sweep import make_case, random_routings  # noqa: E402

from localchat.kernels.moe import MoeConfig, fused_moe  # noqa: E402

CASES = {"mxfp4": (128, 4, 2880, 2880), "mxfp4_20b": (32, 4, 2880, 2880), "fp8_channel": (128, 8, 4096, 1408),
         "fp8_block": (128, 8, 4096, 1408)}


def main() -> None:
    key, t = sys.argv[1], int(sys.argv[2])
    e, k, h, i = CASES[key]
    torch.manual_seed(0)
    experts = make_case("mxfp4" if key.startswith("mxfp4") else key, e, h, i)
    x = torch.randn(t, h, device="cuda", dtype=torch.bfloat16)
    w, ids = random_routings("mxfp4" if key.startswith("mxfp4") else key, t, e, k)[0]
    cfg = None
    if len(sys.argv) > 3 and sys.argv[3].startswith("mma:"):
        cfg = MoeConfig(*(int(v) for v in sys.argv[3].split(":")[1:]), mx_mma=True)
    elif len(sys.argv) > 3:
        bn, bk, nw, ns = (int(v) for v in sys.argv[3].split(":"))
        cfg = MoeConfig(1, bn, bk, nw, ns, gemv=True, mx_half2=key.startswith("mxfp4"))
    for _ in range(2):
        fused_moe(x, experts, w, ids, config=cfg)
    torch.cuda.synchronize()
    torch.cuda.cudart().cudaProfilerStart()
    fused_moe(x, experts, w, ids, config=cfg)
    torch.cuda.synchronize()
    torch.cuda.cudart().cudaProfilerStop()


if __name__ == "__main__":
    main()
