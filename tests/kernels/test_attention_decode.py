"""Paged decode attention against the gathered float32 reference."""
import pytest
import torch

from kernel_checks import TOL, cuda_time_us, paged_cache, rel_err
from localchat.kernels.attention_decode import (default_num_splits, paged_decode_attention, paged_decode_attention_ref,
                                              rotary_decode_attention, rotary_decode_attention_ref)
from localchat.kernels.gpu_facts import sm_count

DEV = "cuda" if torch.cuda.is_available() else "cpu"


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("sinks,window", [(False, None), (True, None), (True, 20), (False, 5)])
@pytest.mark.parametrize("num_splits", [1, 3, 6])
def test_decode_matches_reference(dtype, sinks, window, num_splits):
    """1 split: the split kernel finishes the rows itself; 6: with 37 keys in tiles of 16 some
    splits have no keys."""
    lens = [1, 37, 70, 16]  # one key, across block boundaries, exactly one block
    hkv, group, d, block_size = 2, 3, 32, 16
    k, v, tables, ctx = paged_cache(lens, hkv, d, block_size, dtype)
    q = torch.randn(len(lens), hkv * group, d, device=DEV).to(dtype)
    s = torch.randn(hkv * group, device=DEV) * 2 if sinks else None
    out = paged_decode_attention(q, k, v, tables, ctx, d ** -0.5, s, window, num_splits=num_splits, block_n=16)
    ref = paged_decode_attention_ref(q, k, v, tables, ctx, d ** -0.5, s, window)
    assert out.shape == q.shape
    assert rel_err(out, ref) < TOL[dtype]


def new_token_inputs(lens, hq, hkv, d, r, block_size, dtype, tables):
    """The new token's unrotated q / k / v as views of one fused projection row (the layer's
    layout), its angles and its cache slots (position len - 1 of each sequence)."""
    b = len(lens)
    qkv = torch.randn(b, (hq + 2 * hkv) * d, device=DEV).to(dtype)
    q, k, v = (t.view(b, -1, d) for t in qkv.split([hq * d, hkv * d, hkv * d], dim=-1))
    angles = torch.rand(b, r // 2, device=DEV) * 6.3 * torch.tensor(lens, device=DEV)[:, None]
    cos, sin = torch.cat([angles.cos()] * 2, -1), torch.cat([angles.sin()] * 2, -1)
    pos = torch.tensor(lens, device=DEV) - 1
    slots = tables[torch.arange(b, device=DEV), pos // block_size].long() * block_size + pos % block_size
    return q, k, v, cos, sin, slots


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])  # the interpreter's bf16 dot is broken
@pytest.mark.parametrize("sinks,window,r", [(False, None, 16), (True, None, 32), (True, 20, 32), (False, 5, 16)])
@pytest.mark.parametrize("num_splits", [1, 3, 6])
def test_rotary_decode_matches_rotary_then_attention(dtype, sinks, window, r, num_splits):
    """The rotation and cache write inside the split kernel against apply_rotary then attention:
    partial (16 of 32 dims) and full rotation; the new token's cache slot poisoned first, so a
    program that read it instead of taking the key from registers would show; a padding row
    (slot -1) leaves the cache alone."""
    lens = [1, 37, 70, 16]
    hkv, group, d, block_size = 2, 3, 32, 16
    k_cache, v_cache, tables, ctx = paged_cache(lens, hkv, d, block_size, dtype)
    q, k, v, cos, sin, slots = new_token_inputs(lens, hkv * group, hkv, d, r, block_size, dtype, tables)
    s = torch.randn(hkv * group, device=DEV) * 2 if sinks else None
    slots[3] = -1
    flat_k, flat_v = k_cache.view(-1, hkv, d), v_cache.view(-1, hkv, d)
    flat_k[slots[:3]] = float("nan")
    flat_v[slots[:3]] = float("nan")
    kc_ref, vc_ref = k_cache.clone(), v_cache.clone()
    # a register cap (the launch's maxnreg) changes how the compiler allocates, never the result
    out = rotary_decode_attention(q, k, v, cos, sin, k_cache, v_cache, slots, tables, ctx, d ** -0.5, s, window,
                                  num_splits=num_splits, block_n=16, max_registers=128)
    ref = rotary_decode_attention_ref(q, k, v, cos, sin, kc_ref, vc_ref, slots, tables, ctx, d ** -0.5, s, window)
    assert rel_err(out[:3], ref[:3]) < TOL[dtype]
    assert torch.allclose(k_cache.float(), kc_ref.float(), atol=1e-6 if dtype == torch.float32 else 4e-3, rtol=0)
    assert torch.equal(v_cache, vc_ref)


def test_default_splits_fill_the_sms_without_an_extra_wave():
    # 8 KV heads on 132 SMs: at most 8 programs per SM, rounded down; at most 64 splits and one
    # per 64-key tile
    assert [default_num_splits(b, 8, 8192, 64) for b in (1, 8, 16, 32, 128, 512)] == [64, 16, 8, 4, 1, 1]
    assert default_num_splits(1, 8, 200, 64) == 4
    # a sliding window's two key tiles: split at batch 1, whole (no combine launch) from batch 8
    assert [default_num_splits(b, 8, 128, 64) for b in (1, 4, 8, 32)] == [2, 2, 1, 1]
    for b in (1, 3, 8, 20, 32):
        assert b * 8 * default_num_splits(b, 8, 1 << 20, 64) <= 8 * 132 or default_num_splits(b, 8, 1 << 20, 64) == 1
    assert default_num_splits(8, 8, 8192, 64, num_sms=114) == 14  # scales with the GPU (an H100 PCIe)
    # head_dim 128 (GLM-4.5V): about half as many programs per SM, still at most 64 splits
    assert [default_num_splits(b, 8, 8192, 64, head_dim=128) for b in (1, 4, 8, 16, 32)] == [64, 16, 8, 4, 2]
    assert sm_count(torch.device("cpu")) == 132  # off the GPU: the count the defaults were measured with


def test_sink_dominates_when_large():
    k, v, tables, ctx = paged_cache([9], 1, 16, 8, torch.float32)
    q = torch.randn(1, 2, 16, device=DEV)
    out = paged_decode_attention(q, k, v, tables, ctx, 0.25, torch.full((2,), 30.0, device=DEV), block_n=16)
    assert out.abs().max() < 1e-6  # exp(sink) swamps the denominator and the sink has no value


@pytest.mark.gpu
@pytest.mark.parametrize("name,hq,hkv,d,sinks,window", [
    ("gpt-oss full", 64, 8, 64, True, None),
    ("gpt-oss sliding", 64, 8, 64, True, 128),
    ("GLM-4.5V", 96, 8, 128, False, None),
])
@pytest.mark.parametrize("batch", [1, 8])
def test_decode_8k_gpu(name, hq, hkv, d, sinks, window, batch):
    ctx_len, block_size = 8192, 16
    k, v, tables, ctx = paged_cache([ctx_len] * batch, hkv, d, block_size, torch.bfloat16)
    q = torch.randn(batch, hq, d, device="cuda", dtype=torch.bfloat16)
    s = torch.randn(hq, device="cuda") if sinks else None
    out = paged_decode_attention(q, k, v, tables, ctx, d ** -0.5, s, window)
    ref = paged_decode_attention_ref(q, k, v, tables, ctx, d ** -0.5, s, window)
    assert rel_err(out, ref) < TOL[torch.bfloat16]
    us = cuda_time_us(lambda: paged_decode_attention(q, k, v, tables, ctx, d ** -0.5, s, window))
    # the same step with the new token's rotation and cache write inside the attention launches
    r = d if name.startswith("gpt-oss") else d // 2
    qn, kn, vn, cos, sin, slots = new_token_inputs([ctx_len] * batch, hq, hkv, d, r, block_size, torch.bfloat16,
                                                   tables)
    kc_ref, vc_ref = k.clone(), v.clone()
    fused = rotary_decode_attention(qn, kn, vn, cos, sin, k, v, slots, tables, ctx, d ** -0.5, s, window)
    ref = rotary_decode_attention_ref(qn, kn, vn, cos, sin, kc_ref, vc_ref, slots, tables, ctx, d ** -0.5, s, window)
    assert rel_err(fused, ref) < TOL[torch.bfloat16]
    assert torch.equal(v, vc_ref) and (k.float() - kc_ref.float()).abs().max() < 1e-2
    # one stage held to 128 registers a thread: four GLM-4.5V programs an SM instead of three
    capped = rotary_decode_attention(qn, kn, vn, cos, sin, k, v, slots, tables, ctx, d ** -0.5, s, window,
                                     num_stages=1, max_registers=128)
    assert rel_err(capped, ref) < TOL[torch.bfloat16]
    keys = min(ctx_len, window or ctx_len)
    nbytes = 2 * batch * keys * hkv * d * 2
    print(f"\ndecode attention {name} B={batch} ctx={ctx_len}: {us:.1f} us, {nbytes / us / 1e3:.0f} GB/s")
