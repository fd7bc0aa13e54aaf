"""FP8 linear (channel and block scales) against the exactly dequantised reference."""
import pytest
import torch

from kernel_checks import cuda_time_us, quantize_fp8_blocks, quantize_fp8_rows, rel_err
from localchat.engine.weights.formats import Fp8Weight
from localchat.kernels.fp8_linear import fp8_linear, fp8_linear_ref

DEV = "cuda" if torch.cuda.is_available() else "cpu"


@pytest.mark.parametrize("block", [None, (32, 32), (16, 16)])
@pytest.mark.parametrize("m,dtype", [(1, torch.float32), (2, torch.float16), (8, torch.float32), (19, torch.float16)])
def test_fp8_linear(block, m, dtype):
    # partial N and K tiles and scale blocks; 16x16 blocks: one or two tokens step K over two
    # scale blocks at a time (the second one past K in the last step)
    n, k = 72, 80
    w = torch.randn(n, k, device=DEV) / 9
    fw = Fp8Weight(*quantize_fp8_blocks(w, *block), block=block) if block else Fp8Weight(*quantize_fp8_rows(w))
    x = torch.randn(2, m, k, device=DEV).to(dtype)
    b = torch.randn(n, device=DEV)
    out = fp8_linear(x, fw, b)
    assert out.shape == (2, m, n)
    assert rel_err(out, fp8_linear_ref(x, fw, b)) < (1e-5 if dtype == torch.float32 else 3e-3)


@pytest.mark.gpu
@pytest.mark.parametrize("block", [None, (128, 128)])
@pytest.mark.parametrize("m", [1, 4, 8, 32, 2048])
def test_fp8_linear_gpu(block, m):
    n, k = 12288, 4096  # GLM-4.5V q_proj
    w = torch.randn(n, k, device="cuda") / 64
    fw = Fp8Weight(*quantize_fp8_blocks(w), block=block) if block else Fp8Weight(*quantize_fp8_rows(w))
    x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
    out = fp8_linear(x, fw)
    # per-token FP8 activations (large M, channel scales) cost about one e4m3 rounding
    assert rel_err(out, fp8_linear_ref(x, fw)) < (5e-2 if m >= 64 and block is None else 2e-2)
    us = cuda_time_us(lambda: fp8_linear(x, fw))
    print(f"\nfp8_linear M={m} block={block}: {us:.1f} us, {n * k / us / 1e3:.0f} GB/s (weights), "
          f"{2 * m * n * k / us / 1e6:.0f} TFLOP/s")
