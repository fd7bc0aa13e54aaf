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
