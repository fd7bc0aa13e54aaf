"""Routing and expert grouping against their torch references (interpreter on CPU)."""
import pytest
import torch

from localchat.kernels import moe_align as align_mod
from localchat.kernels.moe_align import (ALIGN_CHUNKS_MIN_PAIRS, ALIGN_CHUNKS_MIN_PAIRS_IN_GRAPH, _align_by_chunks,
                                         _align_by_kernel, moe_align, moe_align_ref, padded_sizes)
from localchat.kernels.moe_routing import route_glm, route_glm_ref, route_gpt_oss, route_gpt_oss_ref

DEV = "cuda" if torch.cuda.is_available() else "cpu"


def _sorted_by_id(w, ids):
    order = ids.argsort(dim=-1)
    return w.gather(1, order), ids.gather(1, order)


@pytest.mark.parametrize("t,e,k", [(1, 128, 8), (7, 20, 3), (33, 128, 8)])
def test_route_glm_matches_reference(t, e, k):
    logits = torch.randn(t, e, device=DEV) * 2
    bias = torch.randn(e, device=DEV) * 0.5  # large enough to change the selection
    w, ids = route_glm(logits, bias, k, renormalize=True, routed_scaling_factor=2.5)
    rw, rids = route_glm_ref(logits, bias, k, renormalize=True, routed_scaling_factor=2.5)
    w, ids = _sorted_by_id(w, ids)
    rw, rids = _sorted_by_id(rw, rids)
    assert torch.equal(ids, rids)
    torch.testing.assert_close(w, rw, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(w.sum(-1), torch.full((t,), 2.5, device=DEV), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("t", [1, 37])
def test_route_glm_writes_the_shared_expert_column(t):
    # GLM's shared expert stacked behind the 20 routed ones: every row ends with it at weight 1,
    # the routed columns as without it
    e, k = 20, 4
    logits, bias = torch.randn(t, e, device=DEV) * 2, torch.randn(e, device=DEV) * 0.5
    w, ids = route_glm(logits, bias, k, renormalize=True, routed_scaling_factor=2.5, shared_expert=e)
    rw, rids = route_glm_ref(logits, bias, k, renormalize=True, routed_scaling_factor=2.5, shared_expert=e)
    assert w.shape == ids.shape == (t, k + 1)
    assert (ids[:, -1] == e).all() and (w[:, -1] == 1.0).all()
    assert torch.equal(rids[:, -1], ids[:, -1]) and torch.equal(rw[:, -1], w[:, -1])
    plain_w, plain_ids = route_glm(logits, bias, k, renormalize=True, routed_scaling_factor=2.5)
    assert torch.equal(ids[:, :k], plain_ids) and torch.equal(w[:, :k], plain_w)
    sw, sids = _sorted_by_id(w[:, :k], ids[:, :k])
    srw, srids = _sorted_by_id(rw[:, :k], rids[:, :k])
    assert torch.equal(sids, srids)
    torch.testing.assert_close(sw, srw, rtol=1e-5, atol=1e-6)


def test_route_glm_bias_only_selects():
    logits = torch.randn(4, 16, device=DEV)
    bias = torch.zeros(16, device=DEV)
    bias[3] = 100.0  # always chosen, but its weight stays its own sigmoid score
    w, ids = route_glm(logits, bias, 2, renormalize=False)
    assert (ids[:, 0] == 3).all()
    torch.testing.assert_close(w[:, 0], logits[:, 3].sigmoid())


@pytest.mark.parametrize("t,e,k", [(1, 32, 4), (5, 128, 4), (9, 6, 6)])
def test_route_gpt_oss_matches_reference(t, e, k):
    # Distinct logits (a random order of evenly spaced values): fp16 randn values tie often
    # enough over 128 experts that the order of equal picks would decide the test.
    logits = (torch.stack([torch.randperm(e, device=DEV) for _ in range(t)]).float() * (6.0 / e) - 3.0)
    logits = logits.to(torch.float16)
    w, ids = route_gpt_oss(logits, k)
    rw, rids = route_gpt_oss_ref(logits, k)
    assert torch.equal(ids, rids)
    torch.testing.assert_close(w, rw, rtol=1e-5, atol=1e-6)


def _skewed_ids(t, k, e, dropped=0.0):
    """Routing skewed so that some experts get no pair and some several blocks; a share of the
    pairs -1 (held by another rank)."""
    ids = torch.stack([torch.randperm(e, device=DEV)[:k] for _ in range(t)])
    ids = torch.where(torch.rand(t, k, device=DEV) < 0.4, ids % 3, ids).to(torch.int32)
    ids = torch.stack([row.unique()[:k] if len(row.unique()) == k else torch.randperm(e, device=DEV)[:k].int()
                       for row in ids]).to(torch.int32)
    return torch.where(torch.rand(t, k, device=DEV) < dropped, -1, ids).to(torch.int32)


@pytest.mark.parametrize("t,k,e,block_m", [(1, 8, 128, 16), (13, 4, 32, 16), (40, 2, 5, 8), (3, 2, 64, 32)])
def test_moe_align_groups_pairs_by_expert(t, k, e, block_m):
    ids = _skewed_ids(t, k, e)
    sorted_ids, block_expert = moe_align(ids, e, block_m)
    ref_sorted, ref_blocks = moe_align_ref(ids, e, block_m)
    assert torch.equal(block_expert.cpu(), ref_blocks.cpu())
    assert torch.equal(sorted_ids.cpu(), ref_sorted.cpu())


@pytest.mark.parametrize("t,k,e,block_m,dropped", [(13, 4, 32, 16, 0.3), (40, 2, 5, 8, 0.0), (300, 4, 32, 64, 0.2)])
def test_align_by_chunks_matches_the_one_program_kernel(t, k, e, block_m, dropped):
    # the two paths at sizes both could take, pairs of id -1 included
    ids = _skewed_ids(t, k, e, dropped)
    p_max, b_max = padded_sizes(ids.numel(), e, block_m)
    chunks = _align_by_chunks(ids, e, block_m, p_max, b_max)
    kernel = _align_by_kernel(ids, e, block_m, p_max, b_max)
    assert torch.equal(chunks[0], kernel[0]) and torch.equal(chunks[1], kernel[1])


def _poisoned_empty(real_empty):
    """torch.empty whose int32 tensors come filled with a value no result holds, so that a slot
    the launcher leaves unwritten shows."""
    def empty(*args, **kwargs):
        out = real_empty(*args, **kwargs)
        return out.fill_(-7) if out.dtype == torch.int32 else out
    return empty


@pytest.mark.parametrize("t,k,e,block_m,dropped,max_chunks", [
    (1, 8, 128, 16, 0.0, None),  # one chunk, mostly empty, most experts without a pair
    (3, 2, 5, 8, 0.0, None),  # E not a power of two, 6 pairs
    (8, 8, 128, 16, 0.0, None),  # exactly one full chunk; block_expert in two steps
    (16, 4, 32, 64, 0.2, None),  # one chunk whose tail slots take three steps
    (300, 4, 32, 16, 0.2, None),  # several chunks, the last one partial, pairs dropped
    (700, 2, 5, 8, 0.1, None),
    (257, 8, 128, 64, 0.3, None),  # 33 chunks (counts read in two steps), 8 pairs in the last
    (40, 8, 256, 16, 0.0, None),  # 256 experts: each chunk in two steps of pairs
    (257, 8, 128, 64, 0.0, 4),  # chunks grown to 1024 pairs by the cap on their number
    (1024, 4, 32, 16, 0.1, None),  # 4096 pairs, 64 chunks
])
def test_align_by_chunks_matches_reference(t, k, e, block_m, dropped, max_chunks, monkeypatch):
    ids = _skewed_ids(t, k, e, dropped)
    p_max, b_max = padded_sizes(ids.numel(), e, block_m)
    if max_chunks:
        monkeypatch.setattr(align_mod, "ALIGN_MAX_CHUNKS", max_chunks)
    monkeypatch.setattr(torch, "empty", _poisoned_empty(torch.empty))
    got = _align_by_chunks(ids, e, block_m, p_max, b_max)
    monkeypatch.undo()
    ref = moe_align_ref(ids, e, block_m)
    assert torch.equal(got[0].cpu(), ref[0].cpu()) and torch.equal(got[1].cpu(), ref[1].cpu())


@pytest.mark.parametrize("t,k,e,block_m,expert", [(300, 4, 128, 64, 7), (40, 8, 5, 8, 4), (300, 4, 32, 16, -1)])
def test_align_by_chunks_one_expert_or_none(t, k, e, block_m, expert, monkeypatch):
    # every pair on one expert (the last one, or one in the middle), or every pair dropped
    ids = torch.full((t, k), expert, dtype=torch.int32, device=DEV)
    p_max, b_max = padded_sizes(ids.numel(), e, block_m)
    monkeypatch.setattr(torch, "empty", _poisoned_empty(torch.empty))
    got = _align_by_chunks(ids, e, block_m, p_max, b_max)
    monkeypatch.undo()
    ref = moe_align_ref(ids, e, block_m)
    assert torch.equal(got[0].cpu(), ref[0].cpu()) and torch.equal(got[1].cpu(), ref[1].cpu())


def test_moe_align_picks_the_path_by_size(monkeypatch):
    picked = []
    for name in ("_align_by_kernel", "_align_by_chunks"):
        monkeypatch.setattr(align_mod, name, lambda *args, name=name: picked.append(name))
    for pairs in (ALIGN_CHUNKS_MIN_PAIRS - 1, ALIGN_CHUNKS_MIN_PAIRS, 1 << 17):
        moe_align(torch.zeros(pairs, 1, dtype=torch.int32), 8, 16)
    assert picked == ["_align_by_kernel", "_align_by_chunks", "_align_by_chunks"]


@pytest.mark.gpu
def test_moe_align_in_a_cuda_graph_takes_the_chunks_earlier():
    # captured: the chunked path from ALIGN_CHUNKS_MIN_PAIRS_IN_GRAPH pairs, replayed on new ids
    # written into the captured input
    e, block_m, t, k = 128, 16, 64, 8
    assert ALIGN_CHUNKS_MIN_PAIRS_IN_GRAPH <= t * k < ALIGN_CHUNKS_MIN_PAIRS
    ids = _skewed_ids(t, k, e, 0.1).cuda()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        sorted_ids, block_expert = moe_align(ids, e, block_m)
    for _ in range(3):
        ids.copy_(_skewed_ids(t, k, e, 0.1).cuda())
        graph.replay()
        ref = moe_align_ref(ids, e, block_m)
        assert torch.equal(sorted_ids, ref[0]) and torch.equal(block_expert, ref[1])
