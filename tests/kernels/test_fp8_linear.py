"""FP8 linear (channel and block scales) against the exactly dequantised reference."""
import pytest
import torch

from kernel_checks import cuda_time_us, quantize_fp8_blocks, quantize_fp8_rows, rel_err
from localchat.engine.weights.formats import Fp8Weight
from localchat.kernels.fp8_linear import (SCALED_MM_MIN_M, fp8_linear, fp8_linear_ref, quant_groups,
                                         quant_groups_ref, quant_rows, quant_rows_ref, scaled_mm_works)

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


@pytest.mark.parametrize("block", [None, (32, 32)])
@pytest.mark.parametrize("split", [2, 3, 7])
def test_fp8_linear_tile_split_k(block, split):
    # the tile with K split over programs, the float32 partials added by a second launch: K = 208
    # in steps of 32 is 7 steps, so 3 splits take 3 + 3 + 1 and 7 one each; bias added once;
    # the output poisoned first
    from localchat.kernels.fp8_linear import _triton_fp8_linear
    m, n, k = 5, 72, 208
    w = torch.randn(n, k, device=DEV) / 9
    fw = Fp8Weight(*quantize_fp8_blocks(w, *block), block=block) if block else Fp8Weight(*quantize_fp8_rows(w))
    x = torch.randn(m, k, device=DEV)
    b = torch.randn(n, device=DEV)
    ref = fp8_linear_ref(x, fw, b)
    for tile in ((16, 32, 32, 1, 1, split), (16, 16, 32, 1, 1, split)):
        torch.empty(m * n * split * 4, device=DEV).fill_(float("nan"))  # poison what the allocator hands out next
        out = _triton_fp8_linear(x, fw, b, on_gpu=False, tile=tile)
        assert rel_err(out, ref) < (1e-5 if DEV == "cpu" else 1e-3)  # the GPU's float32 dot is tf32


def test_tile_k_splits():
    from localchat.kernels.fp8_linear import tile_k_splits
    assert tile_k_splits(128, 48, 132) == 4  # GLM-4.5V o_proj at up to 32 tokens
    assert tile_k_splits(88, 16, 132) == 4  # its shared expert's gate/up shape
    assert tile_k_splits(200, 32, 132) == 2
    assert tile_k_splits(384, 16, 132) == 1  # q/k/v: enough programs
    assert tile_k_splits(128, 6, 132) == 1  # short K
    assert tile_k_splits(8, 20, 132) == 4 and tile_k_splits(8, 17, 132) == 4 and tile_k_splits(100, 16, 16) == 1


@pytest.mark.gpu
@pytest.mark.parametrize("block", [None, (128, 128)])
@pytest.mark.parametrize("m", [1, 4, 8, 32, 40, 2048])
@pytest.mark.parametrize("n,k", [(12288, 4096), (4096, 12288)])  # GLM-4.5V q_proj, o_proj (K split at 3-32 tokens)
@pytest.mark.parametrize("with_bias", [False, True])
def test_fp8_linear_gpu(block, m, n, k, with_bias):
    w = torch.randn(n, k, device="cuda") / 64
    fw = Fp8Weight(*quantize_fp8_blocks(w), block=block) if block else Fp8Weight(*quantize_fp8_rows(w))
    x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(n, device="cuda", dtype=torch.bfloat16) if with_bias else None
    out = fp8_linear(x, fw, b)
    # FP8 activations at large M (per token with channel scales, per token and 128 columns with
    # block scales) cost about one e4m3 rounding
    assert rel_err(out, fp8_linear_ref(x, fw, b)) < (5e-2 if m >= SCALED_MM_MIN_M else 2e-2)
    us = cuda_time_us(lambda: fp8_linear(x, fw, b))
    print(f"\nfp8_linear M={m} block={block}: {us:.1f} us, {n * k / us / 1e3:.0f} GB/s (weights), "
          f"{2 * m * n * k / us / 1e6:.0f} TFLOP/s")


@pytest.mark.parametrize("m,k", [(3, 4096), (2, 1000)])
def test_quant_rows(m, k):
    x = (torch.randn(m, k, device=DEV) * torch.logspace(-3, 3, k, device=DEV)).to(torch.bfloat16)
    x[1] = 0  # an all-zero row keeps a finite scale
    q, s = quant_rows(x)
    q_ref, s_ref = quant_rows_ref(x)
    assert torch.equal(s, s_ref)
    assert torch.equal(q.to(torch.float32), q_ref.to(torch.float32))  # a zero's sign may differ


@pytest.mark.parametrize("m,rows,k", [(5, 8, 512), (8, 8, 384), (3, 4, 1152)])
def test_quant_groups(m, rows, k):
    # per token and 128 columns; rows past m are cuBLAS's padding; k = 1152 leaves a partial
    # program of groups (9 groups, 8 a program)
    x = (torch.randn(m, k, device=DEV) * torch.logspace(-3, 3, k, device=DEV)).to(torch.bfloat16)
    x[1, :128] = 0  # an all-zero group keeps a finite scale
    q, s = quant_groups(x, rows)
    q_ref, s_ref = quant_groups_ref(x, rows)
    assert q.shape == (rows, k) and s.shape == (k // 128, rows)
    assert torch.equal(s, s_ref)
    assert torch.equal(q.to(torch.float32), q_ref.to(torch.float32))  # a zero's sign may differ
    back = q.to(torch.float32).view(rows, k // 128, 128) * s.t()[..., None]
    xf = x.to(torch.float32)
    assert rel_err(back[:m].reshape(m, k), xf) < 4e-2  # one e4m3 rounding
    assert not back[m:].any()


@pytest.mark.gpu
@pytest.mark.parametrize("m,n,k", [(2048, 12288, 4096), (517, 2816, 4096), (64, 4096, 1536), (600, 4096, 1408)])
def test_fp8_linear_block_large_m_gpu(m, n, k):
    # cuBLAS's blockwise recipe where it fits (K a multiple of 512), the Triton tile where not
    # (K = 1408: 11 scale blocks); M not a multiple of 4 pads
    w = torch.randn(n, k, device="cuda") / 64
    fw = Fp8Weight(*quantize_fp8_blocks(w), block=(128, 128))
    x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(n, device="cuda")
    out = fp8_linear(x, fw, b)
    assert out.shape == (m, n)
    # FP8 activations per 128 columns cost about one e4m3 rounding
    assert rel_err(out, fp8_linear_ref(x, fw, b)) < 5e-2
    us = cuda_time_us(lambda: fp8_linear(x, fw, b))
    print(f"\nfp8_linear block M={m} N={n} K={k}: {us:.1f} us, {2 * m * n * k / us / 1e6:.0f} TFLOP/s, "
          f"blockwise _scaled_mm {scaled_mm_works(torch.cuda.current_device(), block=True) and k % 512 == 0}")


@pytest.mark.gpu
def test_scaled_mm_recipes_on_hopper_gpu():
    # the prefill paths the H200 figures come from: cuBLAS for per-token x per-channel scales and
    # the blockwise recipe; elsewhere a refusal of either only sends those sizes to the tiles
    index = torch.cuda.current_device()
    if torch.cuda.get_device_capability(index)[0] != 9:
        pytest.skip("the recipes are a Hopper expectation")
    assert scaled_mm_works(index, block=False) and scaled_mm_works(index, block=True)
    # and both with the bias in the epilogue (GLM-4.5V's q/k/v)
    assert scaled_mm_works(index, block=False, bias=True) and scaled_mm_works(index, block=True, bias=True)
