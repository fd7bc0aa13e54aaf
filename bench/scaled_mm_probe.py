"""Probe: does torch._scaled_mm take 128x128 weight block scales with 1x128 activation scales here,
in which scale layouts, and how fast against the Triton tile and bf16 cuBLAS (activations
quantised by torch ops here, not by kernels/fp8_linear.py's kernel).

    python bench/scaled_mm_probe.py

On the H200 (torch 2.11, CUDA 13.0, 2026-12-04) the weight scales went in as W.scale.t() ([K/128,
N/128], stride (1, K/128)) and the activation scales outer-dim-major ([M, K/128], stride (1, M));
with K/128 = 11 (K = 1408) the call ran and returned wrong sums (relative error 9.7e-2), and the
padded layouts were refused, hence kernels/fp8_linear.py takes the path only for K a multiple of
512."""
import os
import sys

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "tests", "kernels"))
from kernel_checks import cuda_time_us, quantize_fp8_blocks, rel_err  # noqa: E402

from localchat.engine.weights.formats import Fp8Weight  # noqa: E402
from localchat.kernels.fp8_linear import _triton_fp8_linear, quant_groups_ref  # noqa: E402

print(torch.__version__, torch.version.cuda, torch.cuda.get_device_name())


def quant_1x128(x):
    """-> (q [M, K] e4m3, scales [M, K / 128], outer-dim-major as cuBLAS wants them): x ~ q * s."""
    q, scales = quant_groups_ref(x, x.shape[0])
    return q, scales.t()


def ref_deq(q, s, w, ws):
    m, k = q.shape
    xf = (q.float().view(m, k // 128, 128) * s[..., None]).view(m, k)
    return xf @ Fp8Weight(w, ws, (128, 128)).dequantize(torch.float32).T


for n, k in ((12288, 4096), (4096, 12288), (2816, 4096), (4096, 1408), (4096, 1536)):
    wf = torch.randn(n, k, device="cuda") / 64
    w, ws = quantize_fp8_blocks(wf)
    fw = Fp8Weight(w, ws, (128, 128))
    for m in (64, 512, 2048, 8192):
        x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
        q, sa = quant_1x128(x)
        ref = ref_deq(q, sa, w, ws)
        kb = ws.shape[1]
        l4 = -(-kb // 4) * 4
        wsp = torch.zeros(ws.shape[0], l4, device="cuda")
        wsp[:, :kb] = ws
        variants = {
            "sb=ws.t()": ws.t(),
            "sb=ws": ws,
            "sb=pad.t()": wsp.t(),
            "sb=pad.t()[:kb]": wsp.t()[:kb],
        }
        line = f"N={n} K={k} M={m}:"
        for name, sb in variants.items():
            try:
                out = torch._scaled_mm(q, w.t(), scale_a=sa, scale_b=sb, out_dtype=torch.bfloat16)
                err = rel_err(out, ref)
                us = cuda_time_us(lambda: torch._scaled_mm(q, w.t(), scale_a=sa, scale_b=sb, out_dtype=torch.bfloat16))
                line += f" [{name}: err {err:.1e}, {us:.1f} us, {2 * m * n * k / us / 1e6:.0f} TF/s]"
            except Exception as exc:
                line += f" [{name}: {type(exc).__name__} {str(exc)[:90]}]"
        us_q = cuda_time_us(lambda: quant_1x128(x))
        us_t = cuda_time_us(lambda: _triton_fp8_linear(x, fw, None, True))
        wb = fw.dequantize(torch.bfloat16)
        us_b = cuda_time_us(lambda: x @ wb.T)
        line += f" | torch quant 1x128 {us_q:.1f} us | triton tile {us_t:.1f} us | bf16 cuBLAS {us_b:.1f} us"
        print(line, flush=True)
