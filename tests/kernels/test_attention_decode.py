"""Paged decode attention against the gathered float32 reference."""
import pytest
import torch

from kernel_checks import TOL, cuda_time_us, paged_cache, rel_err
from localchat.kernels.attention_decode import default_num_splits, paged_decode_attention, paged_decode_attention_ref
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
    assert rel_err(out, paged_decode_attention_ref(q, k, v, tables, ctx, d ** -0.5, s, window)) < TOL[torch.bfloat16]
    us = cuda_time_us(lambda: paged_decode_attention(q, k, v, tables, ctx, d ** -0.5, s, window))
    keys = min(ctx_len, window or ctx_len)
    nbytes = 2 * batch * keys * hkv * d * 2
    print(f"\ndecode attention {name} B={batch} ctx={ctx_len}: {us:.1f} us, {nbytes / us / 1e3:.0f} GB/s")
