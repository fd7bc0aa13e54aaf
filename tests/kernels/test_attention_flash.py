"""Prefill attention through FlashAttention-2 on gathered keys: the gather, the window's
conversion and the sinks' share from the log-sum-exp, against the paged reference."""
import pytest
import torch

from kernel_checks import TOL, cuda_time_us, paged_cache, rel_err
from localchat.kernels.attention_flash import (flash_varlen, flash_varlen_ref, flash_works, gather_keys, gather_slots,
                                               gathered_prefill_attention)
from localchat.kernels.attention_prefill import paged_prefill_attention, paged_prefill_attention_ref

DEV = "cuda" if torch.cuda.is_available() else "cpu"


def _case(ctx_lens, q_lens, hkv, group, d, dtype, sinks, block_size=8):
    k, v, tables, ctx = paged_cache(ctx_lens, hkv, d, block_size, dtype)
    cu = torch.tensor([0, *torch.tensor(q_lens).cumsum(0).tolist()], dtype=torch.int32, device=DEV)
    q = torch.randn(sum(q_lens), hkv * group, d, device=DEV).to(dtype)
    s = (torch.randn(hkv * group, device=DEV) * 2) if sinks else None
    return q, k, v, tables, ctx, cu, max(q_lens), d ** -0.5, s


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("sinks,window", [(False, None), (True, None), (True, 7), (False, 12)])
def test_gathered_matches_paged_reference(dtype, sinks, window):
    # a cached prefix of 16; none; one token after 4; a prefix of 61 over a page boundary
    args = _case([37, 20, 5, 100], [21, 20, 1, 39], hkv=2, group=3, d=32, dtype=dtype, sinks=sinks)
    lens_host = args[4].tolist()
    out = gathered_prefill_attention(*args, window, context_lens_host=lens_host, attend=flash_varlen_ref)
    assert rel_err(out, paged_prefill_attention_ref(*args, window)) < TOL[dtype]


def test_gather_slots_follow_each_table():
    tables = torch.tensor([[5, 2, 9], [7, 1, 0]], dtype=torch.int32)
    slots = gather_slots(tables, [10, 3], 4)
    assert slots.tolist() == [20, 21, 22, 23, 8, 9, 10, 11, 36, 37, 28, 29, 30]


def test_reference_log_sum_exp():
    q = torch.randn(5, 2, 16)
    k, v = torch.randn(9, 1, 16), torch.randn(9, 1, 16)
    cu_q, cu_k = torch.tensor([0, 5], dtype=torch.int32), torch.tensor([0, 9], dtype=torch.int32)
    _, lse = flash_varlen_ref(q, k, v, cu_q, cu_k, 5, 9, 0.25, window=3)
    # the last query (position 8) sees keys 6, 7, 8
    expect = torch.logsumexp(q[4, 1] @ k[6:9, 0].T * 0.25, dim=0)
    assert torch.allclose(lse[1, 4], expect, atol=1e-5)


@pytest.mark.gpu
@pytest.mark.parametrize("hq,hkv,d,sinks", [(64, 8, 64, True), (96, 8, 128, False)])
def test_gathered_flash_real_shapes_gpu(hq, hkv, d, sinks):
    # two sequences: a 2048-token chunk after 2048 cached keys, and a fresh 700-token prompt
    ctx_lens, q_lens = [4096, 700], [2048, 700]
    assert flash_works(torch.cuda.current_device(), d, torch.bfloat16)
    k, v, tables, ctx = paged_cache(ctx_lens, hkv, d, 16, torch.bfloat16)
    cu = torch.tensor([0, 2048, 2748], dtype=torch.int32, device="cuda")
    q = torch.randn(sum(q_lens), hq, d, device="cuda", dtype=torch.bfloat16)
    s = torch.randn(hq, device="cuda") * 2 if sinks else None
    args = (q, k, v, tables, ctx, cu, 2048, d ** -0.5, s, None)
    ref = paged_prefill_attention_ref(*args)
    out = gathered_prefill_attention(*args, context_lens_host=ctx_lens)
    assert rel_err(out, ref) < TOL[torch.bfloat16]
    assert rel_err(paged_prefill_attention(*args), ref) < TOL[torch.bfloat16]
    ours = cuda_time_us(lambda: paged_prefill_attention(*args), iters=3)
    flash = cuda_time_us(lambda: gathered_prefill_attention(*args, context_lens_host=ctx_lens), iters=3)
    print(f"\nprefill hq={hq} d={d}: paged kernel {ours:.0f} us, gathered flash {flash:.0f} us")


@pytest.mark.gpu
def test_flash_varlen_window_and_lse_gpu():
    q = torch.randn(300, 8, 64, device="cuda", dtype=torch.bfloat16)
    k = torch.randn(500, 2, 64, device="cuda", dtype=torch.bfloat16)
    v = torch.randn(500, 2, 64, device="cuda", dtype=torch.bfloat16)
    cu_q = torch.tensor([0, 100, 300], dtype=torch.int32, device="cuda")
    cu_k = torch.tensor([0, 100, 500], dtype=torch.int32, device="cuda")
    for window in (None, 128):
        out, lse = flash_varlen(q, k, v, cu_q, cu_k, 200, 400, 0.125, window)
        ref, ref_lse = flash_varlen_ref(q, k, v, cu_q, cu_k, 200, 400, 0.125, window)
        assert rel_err(out, ref) < TOL[torch.bfloat16]
        assert (lse - ref_lse).abs().max() < 1e-2


def test_gather_keys_reads_strided_caches():
    # a layer's cache may be a view into a larger allocation: the gather must follow its strides
    whole = torch.randn(6, 2, 4, 3, 8)
    cache = whole[:, 1]
    assert not cache.is_contiguous()
    slots = torch.tensor([0, 5, 4, 23, 9])
    got = gather_keys(cache, slots)
    assert torch.equal(got, torch.stack([cache[s // 4, s % 4] for s in slots.tolist()]))
