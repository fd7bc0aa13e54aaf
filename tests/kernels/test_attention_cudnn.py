"""Prefill attention through cuDNN on gathered keys: the split into the cached prefix and the
chunk's own keys, their merge through the log-sum-exps and the sinks' share, against the paged
reference; the real call's masks and log-sum-exp on the GPU; where the engine takes it, and its
fall-back to the paged kernel when a call fails."""
import logging
from types import SimpleNamespace

import pytest
import torch

from kernel_checks import TOL, cuda_time_us, paged_cache, rel_err
from localchat.kernels.attention_cudnn import (attend_in_two_parts, cudnn_prefill_attention, cudnn_prefill_pays,
                                               cudnn_shapes_fit, cudnn_works, gather_keys, matches_reference, sdpa_with_lse,
                                               sdpa_with_lse_ref)
from localchat.kernels.attention_decode import gather_paged
from localchat.kernels.attention_merge import merge_attention_parts, merge_attention_parts_ref
from localchat.kernels.attention_prefill import paged_prefill_attention, paged_prefill_attention_ref

DEV = "cuda" if torch.cuda.is_available() else "cpu"


def _case(ctx_lens, q_lens, hkv, group, d, dtype, sinks, block_size=8):
    k, v, tables, ctx = paged_cache(ctx_lens, hkv, d, block_size, dtype)
    starts = [0, *torch.tensor(q_lens).cumsum(0).tolist()]
    cu = torch.tensor(starts, dtype=torch.int32, device=DEV)
    q = torch.randn(sum(q_lens), hkv * group, d, device=DEV).to(dtype)
    s = (torch.randn(hkv * group, device=DEV) * 2) if sinks else None
    return (q, k, v, tables, ctx, cu, max(q_lens), d ** -0.5, s), starts


def _new_keys(args, starts):
    """The chunk's keys and values [Tq, Hkv, D] as the layer holds them after the cache write:
    each sequence's last query-count positions, as slices of wider rows (the fused projection)."""
    k_cache, v_cache, tables, lens = args[1], args[2], args[3], args[4].tolist()
    rows = []
    for b, n in enumerate(lens):
        new = starts[b + 1] - starts[b]
        rows.append(torch.cat([gather_paged(c, tables[b], n)[n - new:] for c in (k_cache, v_cache)], dim=1))
    wide = torch.cat(rows)  # [Tq, 2 Hkv, D]
    hkv = k_cache.shape[2]
    return wide[:, :hkv], wide[:, hkv:]


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("sinks", [False, True])
@pytest.mark.parametrize("merge", [merge_attention_parts, merge_attention_parts_ref], ids=["kernel", "ref"])
@pytest.mark.parametrize("own_keys", [False, True], ids=["gathered", "own-keys"])
def test_two_part_matches_paged_reference(dtype, sinks, merge, own_keys):
    # a cached prefix of 16; none; one token after 4; a prefix of 61 over a page boundary; an idle slot
    args, starts = _case([37, 20, 5, 100, 9], [21, 20, 1, 39, 0], hkv=2, group=3, d=32, dtype=dtype, sinks=sinks)
    extra = dict(zip(("new_keys", "new_values"), _new_keys(args, starts))) if own_keys else {}
    out = cudnn_prefill_attention(*args, None, context_lens_host=args[4].tolist(), query_start_host=starts,
                                  attend=sdpa_with_lse_ref, merge=merge, **extra)
    assert rel_err(out, paged_prefill_attention_ref(*args, None)) < TOL[dtype]


def test_the_chunk_reads_its_own_keys_and_only_the_prefix_from_the_pages():
    # the chunk's keys are taken where the layer holds them: keys in its pages past the prefix
    # (here overwritten) must not change the output
    args, starts = _case([20, 30], [20, 9], hkv=2, group=2, d=16, dtype=torch.float32, sinks=False)
    own_k, own_v = _new_keys(args, starts)
    run = dict(context_lens_host=[20, 30], query_start_host=starts, attend=sdpa_with_lse_ref,
               merge=merge_attention_parts_ref)
    expect = cudnn_prefill_attention(*args, None, **run)
    k_cache, v_cache, tables = args[1], args[2], args[3]
    for b, first in ((0, 0), (1, 21)):  # every position of the chunks: 0-19, and 21-29 after a prefix of 21
        for j in range(first, [20, 30][b]):
            block, row = tables[b, j // 8], j % 8
            k_cache[block, row].normal_(), v_cache[block, row].normal_()
    got = cudnn_prefill_attention(*args, None, new_keys=own_k, new_values=own_v, **run)
    assert torch.equal(got, expect)


def test_prefix_part_is_unmasked_and_chunk_part_square():
    # the merge must weigh each part by its softmax mass: one query after 3 keys sees all 4
    q = torch.randn(1, 2, 8)
    k, v = torch.randn(1, 1, 4, 8), torch.randn(1, 1, 4, 8)
    own, cached = attend_in_two_parts(q, k[:, :, 3:], v[:, :, 3:], k[:, :, :3], v[:, :, :3], 0.5,
                                      attend=sdpa_with_lse_ref)
    assert own[0].shape == cached[0].shape == (1, 2, 8) and own[1].shape == cached[1].shape == (2, 1)
    out = merge_attention_parts_ref(torch.empty(1, 2, 8), *own, *cached)
    scores = torch.einsum("hd,sd->hs", q[0], k[0, 0]) * 0.5
    assert torch.allclose(out[0], torch.softmax(scores, -1) @ v[0, 0], atol=1e-5)
    assert torch.allclose(torch.logaddexp(own[1], cached[1])[:, 0], torch.logsumexp(scores, -1), atol=1e-5)


def test_reference_causal_mask_is_aligned_to_the_first_key():
    q, k, v = torch.randn(1, 1, 3, 4), torch.randn(1, 1, 3, 4), torch.randn(1, 1, 3, 4)
    out, _ = sdpa_with_lse_ref(q, k, v, True, 1.0)
    assert torch.allclose(out[0, 0, 0], v[0, 0, 0])  # the first query sees the first key only


def test_gather_keys_follows_each_table():
    cache = torch.randn(10, 4, 3, 8)
    for table, length in (([5, 2, 9], 10), ([7, 1, 0], 3), ([3, 8], 8)):
        got = gather_keys(cache, torch.tensor(table, dtype=torch.int32), length)
        assert torch.equal(got[0].transpose(0, 1), gather_paged(cache, torch.tensor(table), length))


def test_gather_keys_follows_strides():
    whole = torch.randn(6, 2, 4, 3, 8)
    cache = whole[:, 1]  # one layer's view into a larger allocation
    table = torch.tensor([0, 5, 4, 2])
    got = gather_keys(cache, table, 13)
    # heads strided over the copied rows, each key's D contiguous: the layout cuDNN takes for q too
    assert got.shape == (1, 3, 13, 8) and got.stride()[1:] == (8, 24, 1)
    expect = torch.stack([cache[table[j // 4], j % 4] for j in range(13)])
    assert torch.equal(got[0].transpose(0, 1), expect)


def test_window_is_refused():
    args, starts = _case([10], [10], hkv=1, group=2, d=16, dtype=torch.float32, sinks=False)
    with pytest.raises(ValueError, match="window"):
        cudnn_prefill_attention(*args, 4, context_lens_host=[10], query_start_host=starts)


@pytest.mark.gpu
@pytest.mark.parametrize("hq,hkv,d,sinks", [(64, 8, 64, True), (96, 8, 128, False)])
def test_cudnn_real_shapes_gpu(hq, hkv, d, sinks):
    # two sequences: a 2048-token chunk after 2048 cached keys, and a fresh 700-token prompt
    ctx_lens, q_lens = [4096, 700], [2048, 700]
    assert cudnn_works(torch.cuda.current_device(), d, torch.bfloat16)
    k, v, tables, ctx = paged_cache(ctx_lens, hkv, d, 16, torch.bfloat16)
    starts = [0, 2048, 2748]
    cu = torch.tensor(starts, dtype=torch.int32, device="cuda")
    q = torch.randn(sum(q_lens), hq, d, device="cuda", dtype=torch.bfloat16)
    s = torch.randn(hq, device="cuda") * 2 if sinks else None
    args = (q, k, v, tables, ctx, cu, 2048, d ** -0.5, s, None)
    ref = paged_prefill_attention_ref(*args)
    out = cudnn_prefill_attention(*args, context_lens_host=ctx_lens, query_start_host=starts)
    assert rel_err(out, ref) < TOL[torch.bfloat16]
    ours = cuda_time_us(lambda: paged_prefill_attention(*args), iters=3)
    cudnn = cuda_time_us(lambda: cudnn_prefill_attention(*args, context_lens_host=ctx_lens,
                                                         query_start_host=starts), iters=3)
    print(f"\nprefill hq={hq} d={d}: paged kernel {ours:.0f} us, gathered cuDNN {cudnn:.0f} us")


@pytest.mark.gpu
def test_sdpa_with_lse_masks_gpu():
    q = torch.randn(300, 8, 64, device="cuda", dtype=torch.bfloat16).transpose(0, 1)[None]
    kv = torch.randn(2, 1, 2, 500, 64, device="cuda", dtype=torch.bfloat16)
    for keys, causal in ((500, False), (300, True)):
        k, v = kv[0, :, :, :keys], kv[1, :, :, :keys]
        out, lse = sdpa_with_lse(q, k, v, causal, 0.125)
        ref, ref_lse = sdpa_with_lse_ref(q, k, v, causal, 0.125)
        assert rel_err(out, ref) < TOL[torch.bfloat16]
        assert (lse - ref_lse).abs().max() < 1e-2


def test_probe_check_tells_layouts_apart():
    out, lse = torch.randn(1, 4, 40, 16), torch.randn(4, 40)
    assert matches_reference(out, lse, out.clone(), lse.clone())
    assert not matches_reference(out, lse.t().contiguous(), out, lse)  # the log-sum-exp transposed
    assert not matches_reference(out.flip(2), lse, out, lse)  # rows of another query order


def test_cudnn_taken_only_where_measured_faster():
    hopper, ampere = (9, 0), (8, 0)
    # GLM-4.5V: heads of 128, 8 KV heads, bf16; a 2048-token chunk after 8K / 6K cached keys
    assert cudnn_prefill_pays(hopper, 128, 8, 2, [8192 + 2048], [2048])
    assert not cudnn_prefill_pays(hopper, 128, 8, 2, [6144 + 2048], [2048])
    # a whole 8192-token step, even with no prefix (a long prompt's first chunk); one token short of it not
    assert cudnn_prefill_pays(hopper, 128, 8, 2, [8192], [8192])
    assert not cudnn_prefill_pays(hopper, 128, 8, 2, [8191], [8191])
    assert not cudnn_prefill_pays(ampere, 128, 8, 2, [8192 + 2048], [2048])  # not measured there
    # a short chunk after a long prefix (a chat's next turn) saves less than its graph's build
    assert not cudnn_prefill_pays(hopper, 128, 8, 2, [30000 + 300], [300])
    # gpt-oss: heads of 64 never save a build's worth
    assert not cudnn_prefill_pays(hopper, 64, 8, 2, [32768], [2048])
    # every sequence must have its long prefix, and not too many of them
    assert not cudnn_prefill_pays(hopper, 128, 8, 2, [10240, 4096], [2048, 2048])
    assert not cudnn_prefill_pays(hopper, 128, 8, 2, [12000] * 5, [2048] * 5)
    # a gather over the transient's bound (GLM-4.5V past 64K keys) stays paged
    assert not cudnn_prefill_pays(hopper, 128, 8, 2, [70000], [2048])
    assert not cudnn_prefill_pays(hopper, 96, 8, 2, [32768], [2048])  # a head size never timed


def test_graph_shapes_are_bounded(monkeypatch):
    import localchat.kernels.attention_cudnn as module

    monkeypatch.setattr(module, "_shapes_built", set())
    monkeypatch.setattr(module, "CUDNN_MAX_SHAPES", 5)
    layout = (0, 96, 8, 128, torch.bfloat16)
    assert cudnn_shapes_fit(layout, [10240], [2048])  # the prefix part and the chunk's own square
    assert cudnn_shapes_fit(layout, [10240], [2048])  # built: every layer after the first
    assert cudnn_shapes_fit(layout, [12288], [2048])  # one more prefix; the square is shared
    assert cudnn_shapes_fit(layout, [14336, 16384], [2048, 2048])
    assert not cudnn_shapes_fit(layout, [18432], [2048])  # a sixth shape: past the bound
    assert cudnn_shapes_fit(layout, [12288], [2048])  # the built ones still go
    assert not cudnn_shapes_fit((0, 96, 8, 128, torch.float16), [10240], [2048])  # another dtype is another graph


def test_a_cudnn_error_sends_prefill_to_the_paged_kernel_from_then_on(monkeypatch, caplog):
    from localchat.engine.layers import attention as layer

    calls = []

    def failing(*args, **kwargs):
        calls.append(kwargs["context_lens_host"])
        raise RuntimeError("cuDNN Frontend error: No valid execution plans built.")

    monkeypatch.setattr(layer, "_takes_cudnn", lambda *a: True)
    monkeypatch.setattr(layer, "cudnn_prefill_attention", failing)
    monkeypatch.setattr(layer, "_cudnn_failed", set())
    q = torch.zeros(4, 2, 8)
    batch = SimpleNamespace(context_lens=None, query_start=None, context_lens_host=[4], query_start_host=[0, 4])
    args = (q, None, None, None, batch, [4], 1.0, None, None, None)
    with caplog.at_level(logging.WARNING, logger=layer.__name__):
        assert layer._through_cudnn(*args) is None  # the caller then runs the paged kernel
        assert layer._through_cudnn(*args) is None
    assert calls == [[4]]  # tried once: the device is off cuDNN from then on
    assert q.device in layer._cudnn_failed
    assert "RuntimeError: cuDNN Frontend error" in caplog.text and "paged kernel" in caplog.text
    # where the call works, its output is the attention's
    monkeypatch.setattr(layer, "_cudnn_failed", set())
    monkeypatch.setattr(layer, "cudnn_prefill_attention", lambda *a, **k: q + 1)
    assert torch.equal(layer._through_cudnn(*args), q + 1)
