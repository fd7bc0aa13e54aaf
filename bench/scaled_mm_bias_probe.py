"""Probe: does torch._scaled_mm add a bias in its epilogue for the two recipes the FP8 linears use
(per-token x per-channel scales; 1x128 x 128x128 block scales), right and faster than a separate
add over the output? GLM-4.5V's q/k/v projection has a bias: 2048 tokens x 4096 -> 14336.
    python bench/scaled_mm_bias_probe.py
"""
import os
import sys

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "tests", "kernels"))
from kernel_checks import cuda_time_us, quantize_fp8_blocks, quantize_fp8_rows, rel_err  # noqa: E402

from localchat.kernels.fp8_linear import quant_groups, quant_rows  # noqa: E402

print(torch.__version__, torch.version.cuda, torch.cuda.get_device_name())
m, k, n = 2048, 4096, 14336
x = torch.randn(m, k, device="cuda").to(torch.bfloat16)
wf = torch.randn(n, k, device="cuda") * 0.02
bias = (torch.randn(n, device="cuda") * 0.5).to(torch.bfloat16)

wq, ws = quantize_fp8_rows(wf)
xq, xs = quant_rows(x)
row_args = dict(scale_a=xs, scale_b=ws.reshape(1, -1).contiguous(), out_dtype=torch.bfloat16, use_fast_accum=True)
wbq, wbs = quantize_fp8_blocks(wf)
xbq, xbs = quant_groups(x, m)
block_args = dict(scale_a=xbs.t(), scale_b=wbs.contiguous().t(), out_dtype=torch.bfloat16)

for name, a, b, args in (("rows x channels", xq, wq, row_args), ("1x128 x 128x128 blocks", xbq, wbq, block_args)):
    apart = lambda: torch._scaled_mm(a, b.t(), **args) + bias  # noqa: E731
    ref = apart()
    try:
        fused = torch._scaled_mm(a, b.t(), bias=bias, **args)
    except Exception as e:
        print(f"{name}: bias refused ({type(e).__name__}: {str(e)[:200]})")
        continue
    err = rel_err(fused, ref)
    t_apart = cuda_time_us(apart, iters=5)
    t_fused = cuda_time_us(lambda: torch._scaled_mm(a, b.t(), bias=bias, **args), iters=5)
    t_plain = cuda_time_us(lambda: torch._scaled_mm(a, b.t(), **args), iters=5)
    print(f"{name}: fused bias rel diff {err:.1e} from the separate add; GEMM + add {t_apart:.1f} us, "
          f"GEMM with the bias {t_fused:.1f} us, GEMM alone {t_plain:.1f} us")
