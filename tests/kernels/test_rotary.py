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


@pytest.mark.parametrize("hq,hkv", [(4, 2), (20, 10)])  # 20 and 10: several head blocks, the last partial
def test_rotary_writes_paged_cache(hq, hkv):
    t, d, r, block_size = 6, 32, 16, 4
    q = torch.randn(t, hq, d, device=DEV)
    k = torch.randn(t, hkv, d, device=DEV)
    v = torch.randn(t, hkv, d, device=DEV)
    cos, sin = _angles(t, r)
    slots = torch.tensor([9, 10, 11, 0, -1, 5], dtype=torch.int32, device=DEV)  # -1: padding token
    k_cache = torch.full((4, block_size, hkv, d), float("nan"), device=DEV)
    v_cache = torch.full_like(k_cache, float("nan"))
    ref_k, ref_v = k_cache.clone(), v_cache.clone()
    qo, ko = apply_rotary(q, k, cos, sin, v, k_cache, v_cache, slots)
    apply_rotary_ref(q, k, cos, sin, v, ref_k, ref_v, slots)
    assert torch.equal(k_cache.isnan(), ref_k.isnan())  # the same slots written, no others
    written = ~ref_k.isnan()
    assert rel_err(k_cache[written], ref_k[written]) < 1e-6
    qr, kr = apply_rotary_ref(q, k, cos, sin)
    assert rel_err(qo, qr) < 1e-6 and rel_err(ko, kr) < 1e-6
    assert torch.equal(v_cache[written], ref_v[written])
    assert torch.equal(k_cache[2, 1], ko[0])


@pytest.mark.gpu
@pytest.mark.parametrize("hq,hkv,d,r", [(96, 8, 128, 64), (64, 8, 64, 64)])  # GLM-4.5V, gpt-oss
@pytest.mark.parametrize("t", [1, 32, 4096])
def test_rotary_gpu_real_shapes(hq, hkv, d, r, t):
    """bf16 q/k/v with the paged cache write at the real head counts, against the reference,
    timed (at one token the kernel is a latency-bound part of every decode layer)."""
    from kernel_checks import cuda_time_us

    q = torch.randn(t, hq, d, device="cuda", dtype=torch.bfloat16)
    k, v = (torch.randn(t, hkv, d, device="cuda", dtype=torch.bfloat16) for _ in range(2))
    cos, sin = (a.cuda() for a in _angles(t, r))
    blocks = -(-t // 16) + 1
    slots = torch.randperm(blocks * 16, device="cuda")[:t].to(torch.int32)
    k_cache = torch.zeros(blocks, 16, hkv, d, device="cuda", dtype=torch.bfloat16)
    v_cache = torch.zeros_like(k_cache)
    ref_k, ref_v = k_cache.clone(), v_cache.clone()
    qo, ko = apply_rotary(q, k, cos, sin, v, k_cache, v_cache, slots)
    qr, kr = apply_rotary_ref(q, k, cos, sin, v, ref_k, ref_v, slots)
    assert rel_err(qo, qr) < 1e-2 and rel_err(ko, kr) < 1e-2
    assert rel_err(k_cache, ref_k) < 1e-2 and torch.equal(v_cache, ref_v)
    us = cuda_time_us(lambda: apply_rotary(q, k, cos, sin, v, k_cache, v_cache, slots))
    print(f"\n  rotary + cache write, {hq}/{hkv} heads of {d}, T={t}: {us:.1f} us")
