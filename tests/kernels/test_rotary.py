"""Partial NeoX rotary with the fused paged-cache write, against the torch reference."""
import pytest
import torch

from kernel_checks import rel_err
from localchat.kernels.rotary import apply_rotary, apply_rotary_ref

DEV = "cuda" if torch.cuda.is_available() else "cpu"


def _angles(t, r):
    freqs = torch.arange(t, device=DEV, dtype=torch.float32)[:, None] * torch.rand(r // 2, device=DEV)
    emb = torch.cat((freqs, freqs), -1)
    return emb.cos(), emb.sin()


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("d,r", [(32, 16), (16, 16)])  # GLM-style half rotary, gpt-oss-style full
def test_rotary_matches_reference(dtype, d, r):
    t, hq, hkv = 5, 6, 2
    q = torch.randn(t, hq, d, device=DEV).to(dtype)
    k = torch.randn(t, hkv, d, device=DEV).to(dtype)
    cos, sin = _angles(t, r)
    qo, ko = apply_rotary(q, k, cos, sin)
    qr, kr = apply_rotary_ref(q, k, cos, sin)
    tol = 1e-6 if dtype == torch.float32 else 1e-3
    assert rel_err(qo, qr) < tol and rel_err(ko, kr) < tol
    assert torch.equal(qo[..., r:], q[..., r:])


def test_rotary_writes_paged_cache():
    t, hq, hkv, d, r, block_size = 6, 4, 2, 32, 16, 4
    q = torch.randn(t, hq, d, device=DEV)
    k = torch.randn(t, hkv, d, device=DEV)
    v = torch.randn(t, hkv, d, device=DEV)
    cos, sin = _angles(t, r)
    slots = torch.tensor([9, 10, 11, 0, -1, 5], dtype=torch.int32, device=DEV)  # -1: padding token
    k_cache = torch.full((4, block_size, hkv, d), float("nan"), device=DEV)
    v_cache = torch.full_like(k_cache, float("nan"))
    ref_k, ref_v = k_cache.clone(), v_cache.clone()
    _, ko = apply_rotary(q, k, cos, sin, v, k_cache, v_cache, slots)
    apply_rotary_ref(q, k, cos, sin, v, ref_k, ref_v, slots)
    assert torch.equal(k_cache.isnan(), ref_k.isnan())  # the same slots written, no others
    written = ~ref_k.isnan()
    assert rel_err(k_cache[written], ref_k[written]) < 1e-6
    assert torch.equal(v_cache[written], ref_v[written])
    assert torch.equal(k_cache[2, 1], ko[0])
