"""The fused SiLU-gated product against torch's two ops."""
import pytest
import torch

from kernel_checks import DEV, TOL, rel_err
from localchat.kernels.glu import silu_mul, silu_mul_ref


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("m,i", [(1, 8), (3, 1100), (5, 2048)])
def test_silu_mul_matches_torch(dtype, m, i, monkeypatch):
    # 1100 columns: a second, partial block of 1024; a view with a row stride wider than 2I
    gate_up = (torch.randn(m, 2 * i + 6, device=DEV) * 3).to(dtype)[:, : 2 * i]
    real_empty = torch.empty
    monkeypatch.setattr(torch, "empty", lambda *a, **k: real_empty(*a, **k).fill_(float("nan")))
    out = silu_mul(gate_up)
    monkeypatch.undo()
    assert out.shape == (m, i) and out.dtype == dtype
    assert rel_err(out, silu_mul_ref(gate_up.float())) < TOL[dtype]


def test_silu_mul_refuses_an_odd_width():
    with pytest.raises(ValueError, match="2I"):
        silu_mul(torch.randn(2, 7, device=DEV))


@pytest.mark.gpu
@pytest.mark.parametrize("m,i", [(1, 1408), (32, 1408), (4096, 4096)])
def test_silu_mul_real_shapes_gpu(m, i):
    # GLM-4.5V's shared expert at decode sizes, a vision block's MLP over an image's patches
    gate_up = torch.randn(m, 2 * i, device="cuda", dtype=torch.bfloat16) * 3
    assert rel_err(silu_mul(gate_up), silu_mul_ref(gate_up.float())) < TOL[torch.bfloat16]
