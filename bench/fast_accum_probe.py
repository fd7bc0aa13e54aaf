"""Probe: the dense FP8 linears' torch._scaled_mm (per-token x per-channel scales, the prefill path of
kernels/fp8_linear.py from 33 tokens) with and without use_fast_accum, which lets the FP8 tensor
cores sum the whole K in their own accumulation as the MoE tiles on e4m3 activations now do (bench/
NOTES-moe.md, "The FP8 prefill tiles summed each K step outside the dot"). GLM-4.5V's shapes;
median CUDA time of each call, and each result's error against the product of the dequantised
operands.

    python bench/fast_accum_probe.py [--ms 256,1024,2048]
"""
import argparse
import os
import sys

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "tests", "kernels"))
from kernel_checks import cuda_time_us, quantize_fp8_rows, rel_err  # noqa: E402

from localchat.kernels.fp8_linear import quant_rows  # noqa: E402

SHAPES = [(12288, 4096), (4096, 12288), (2816, 4096), (4096, 1408)]  # q/k/v, o_proj, shared expert


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--ms", default="256,1024,2048")
    args = p.parse_args()
    print(torch.__version__, torch.version.cuda, torch.cuda.get_device_name())
    print("| N x K | M | fast_accum off us (TFLOP/s) | on us (TFLOP/s) | rel err off / on |")
    print("|---|---|---|---|---|")
    for n, k in SHAPES:
        w, ws = quantize_fp8_rows(torch.randn(n, k, device="cuda") / 64)
        w_scale = ws.to(torch.float32).reshape(1, -1).contiguous()
        for m in (int(v) for v in args.ms.split(",")):
            x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
            xq, xs = quant_rows(x)
            ref = (xq.float() * xs) @ (w.float() * ws.reshape(-1, 1).float()).T
            row = []
            for fast in (False, True):
                def call(fast=fast):
                    return torch._scaled_mm(xq, w.t(), scale_a=xs, scale_b=w_scale, out_dtype=torch.bfloat16,
                                            use_fast_accum=fast)
                try:
                    out = call()
                    us = cuda_time_us(call)
                    row.append((us, 2 * m * n * k / us / 1e6, rel_err(out, ref)))
                except RuntimeError as e:
                    row.append(None)
                    print(f"  {n}x{k} M={m} use_fast_accum={fast}: refused ({str(e)[:100]})")
            if all(row):
                (a, ta, ea), (b, tb, eb) = row
                print(f"| {n}x{k} | {m} | {a:.1f} ({ta:.0f}) | {b:.1f} ({tb:.0f}) | {ea:.1e} / {eb:.1e} |", flush=True)


if __name__ == "__main__":
    main()
