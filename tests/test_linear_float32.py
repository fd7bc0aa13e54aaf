"""The float32-output linear GLM's router runs at prefill sizes: on CUDA a 16-bit GEMM that writes
float32, against the float32 linear of the same operands."""
import pytest
import torch
import torch.nn.functional as F

from localchat.engine.layers.linear import linear_float32, mm_float32_out_works
from localchat.engine.weights.formats import DenseWeight


def test_linear_float32_off_the_gpu_is_the_float32_linear():
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(37, 96, generator=gen).to(torch.bfloat16)
    w = torch.randn(20, 96, generator=gen).to(torch.bfloat16)
    out = linear_float32(x, DenseWeight(w))
    assert out.dtype == torch.float32
    assert torch.equal(out, F.linear(x.float(), w.float()))


@pytest.mark.gpu
@pytest.mark.parametrize("tokens", [33, 2048])
def test_linear_float32_on_cuda_sums_exact_products_in_float32(tokens):
    """GLM-4.5V's router shape (128 experts of 4096 inputs): within float32 summation error of
    the float64 product, where a bf16 output (8 bits) would be ~1e-3 off."""
    assert mm_float32_out_works(torch.cuda.current_device()), "torch.mm(out_dtype=float32) refused on this GPU"
    gen = torch.Generator(device="cuda").manual_seed(tokens)
    x = torch.randn(tokens, 4096, device="cuda", generator=gen).to(torch.bfloat16)
    w = (torch.randn(128, 4096, device="cuda", generator=gen) * 0.02).to(torch.bfloat16)
    out = linear_float32(x, DenseWeight(w))
    ref = x.double() @ w.double().T
    assert out.dtype == torch.float32 and out.shape == (tokens, 128)
    err = ((out.double() - ref).abs().max() / ref.abs().max()).item()
    float32_path = F.linear(x.float(), w.float()).double()
    err_f32 = ((float32_path - ref).abs().max() / ref.abs().max()).item()
    assert err < 1e-5, f"{err:.2e} from float64 (the float32 linear: {err_f32:.2e})"
