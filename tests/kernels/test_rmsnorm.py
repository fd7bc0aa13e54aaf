"""Fused residual add + RMSNorm against the torch reference, both rounding conventions."""
import pytest
import torch

from kernel_checks import cuda_time_us, rel_err
from localchat.kernels.rmsnorm import add_rms_norm, add_rms_norm_ref

DEV = "cuda" if torch.cuda.is_available() else "cpu"


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("weight_first", [False, True])
@pytest.mark.parametrize("with_residual", [False, True])
def test_add_rms_norm(dtype, weight_first, with_residual):
    t, d = 7, 200  # D not a power of two
    x = torch.randn(t, d, device=DEV).to(dtype)
    res = torch.randn(t, d, device=DEV).to(dtype) if with_residual else None
    w = (torch.rand(d, device=DEV) + 0.5).to(dtype)
    out, new_res = add_rms_norm(x, res, w, 1e-5, weight_first)
    ref, ref_res = add_rms_norm_ref(x, res, w, 1e-5, weight_first)
    assert rel_err(out, ref) < (1e-6 if dtype == torch.float32 else 1e-3)
    assert rel_err(new_res, ref_res) < 1e-6


def test_flavours_differ_in_rounding():
    # the two conventions are different functions in half precision; the flag must matter
    x = torch.randn(64, 256, device=DEV).half() * 10
    w = (torch.rand(256, device=DEV) * 3).half()
    a, _ = add_rms_norm(x, None, w, 1e-5, weight_first=False)
    b, _ = add_rms_norm(x, None, w, 1e-5, weight_first=True)
    ref_a, ref_b = add_rms_norm_ref(x, None, w, 1e-5, False)[0], add_rms_norm_ref(x, None, w, 1e-5, True)[0]
    # each matches its own convention (up to the odd last-bit flip from the sum order) ...
    assert (a == ref_a).float().mean() > 0.98 and (b == ref_b).float().mean() > 0.98
    # ... and the conventions round a good share of elements differently
    assert (ref_a != ref_b).float().mean() > 0.1


@pytest.mark.gpu
@pytest.mark.parametrize("t,d", [(1, 4096), (32, 2880), (4096, 4096)])
def test_add_rms_norm_gpu(t, d):
    x, res = (torch.randn(t, d, device="cuda", dtype=torch.bfloat16) for _ in range(2))
    w = torch.rand(d, device="cuda", dtype=torch.bfloat16)
    out, _ = add_rms_norm(x, res, w, 1e-5)
    assert rel_err(out, add_rms_norm_ref(x, res, w, 1e-5)[0]) < 1e-2
    us = cuda_time_us(lambda: add_rms_norm(x, res, w, 1e-5))
    print(f"\nadd_rms_norm T={t} D={d}: {us:.1f} us, {4 * t * d * 2 / us / 1e3:.0f} GB/s")


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_normed_rows_in_the_packed_f16_moe_input_form(dtype):
    # The third output is exactly what the MoE's own conversion kernel makes of the normed rows:
    # rows of very different magnitudes (each its own power of two), one all zero, D = 200 with a
    # partial last 8-value word group past a power of two.
    from localchat.kernels.moe_gemv_half2 import half2_input_ref
    t, d = 5, 200
    x = torch.randn(t, d, device=DEV) * torch.tensor([[1e-3], [1.0], [50.0], [0.0], [3.0]], device=DEV)
    w = torch.rand(d, device=DEV) + 0.5
    w[:8] = 40.0  # normed values far above 1
    res = torch.zeros(t, d, device=DEV)
    out, new_res, (xq, inv) = add_rms_norm(x.to(dtype), res.to(dtype), w, 1e-5, True, half2=True)
    plain, plain_res = add_rms_norm(x.to(dtype), res.to(dtype), w, 1e-5, True)
    assert torch.equal(out, plain) and torch.equal(new_res, plain_res)
    ref_q, ref_inv = half2_input_ref(out)
    assert xq.dtype == torch.float16 and torch.equal(xq, ref_q) and torch.equal(inv, ref_inv)
    assert torch.isfinite(xq.float()).all() and xq.float().abs().max() < 2 ** 14
    ref = add_rms_norm_ref(x.to(dtype), res.to(dtype), w, 1e-5, True, half2=True)
    assert len(ref) == 3 and torch.equal(ref[2][0], half2_input_ref(ref[0])[0])


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32])
def test_normed_rows_as_e4m3(dtype):
    # The third output is exactly what quant_rows (the FP8 GEMMs' own quantisation launch) makes of
    # the stored normed rows: rows of very different magnitudes, one all zero, D = 200 past a power
    # of two; the first two outputs are those of the plain call.
    from localchat.kernels.fp8_linear import quant_rows, quant_rows_ref
    t, d = 5, 200
    x = torch.randn(t, d, device=DEV) * torch.tensor([[1e-3], [1.0], [50.0], [0.0], [3.0]], device=DEV)
    w = torch.rand(d, device=DEV) + 0.5
    w[:8] = 40.0
    res = torch.randn(t, d, device=DEV) * 0.1
    res[3] = 0.0
    out, new_res, (q, scale) = add_rms_norm(x.to(dtype), res.to(dtype), w, 1e-5, e4m3=True)
    plain, plain_res = add_rms_norm(x.to(dtype), res.to(dtype), w, 1e-5)
    assert torch.equal(out, plain) and torch.equal(new_res, plain_res)
    ref_q, ref_scale = (quant_rows if DEV == "cuda" else quant_rows_ref)(out)
    assert q.dtype == torch.float8_e4m3fn and q.shape == (t, d) and scale.shape == (t, 1)
    assert torch.equal(q.view(torch.uint8), ref_q.view(torch.uint8)) and torch.equal(scale, ref_scale)
    ref = add_rms_norm_ref(x.to(dtype), res.to(dtype), w, 1e-5, e4m3=True)
    assert len(ref) == 3 and torch.equal(ref[2][0].view(torch.uint8), quant_rows_ref(ref[0])[0].view(torch.uint8))
    with pytest.raises(ValueError, match="half2 or e4m3"):
        add_rms_norm(x.to(dtype), None, w, 1e-5, half2=True, e4m3=True)
