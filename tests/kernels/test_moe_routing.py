"""Routing and expert grouping against their torch references (interpreter on CPU)."""
import pytest
import torch

from localchat.kernels.moe_align import ALIGN_SORT_MIN_PAIRS, _align_by_sort, moe_align, moe_align_ref, padded_sizes
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


@pytest.mark.parametrize("t,k,e,block_m,dropped", [(1, 8, 128, 16, 0.0), (13, 4, 32, 16, 0.3), (40, 2, 5, 8, 0.0),
                                                   (3, 2, 64, 32, 0.5), (300, 4, 32, 64, 0.2),
                                                   (2048, 4, 32, 64, 0.2)])
def test_align_by_sort_matches_the_kernel_and_reference(t, k, e, block_m, dropped):
    # the prefill-size path against the one-program kernel at sizes both take, pairs of id -1
    # included; the last case (8192 pairs) is one moe_align sends to the sort
    ids = _skewed_ids(t, k, e, dropped)
    p_max, b_max = padded_sizes(ids.numel(), e, block_m)
    by_sort = _align_by_sort(ids, e, block_m, p_max, b_max)
    ref = moe_align_ref(ids, e, block_m)
    assert torch.equal(by_sort[0].cpu(), ref[0].cpu()) and torch.equal(by_sort[1].cpu(), ref[1].cpu())
    if ids.numel() < ALIGN_SORT_MIN_PAIRS:
        kernel = moe_align(ids, e, block_m)
        assert torch.equal(by_sort[0], kernel[0]) and torch.equal(by_sort[1], kernel[1])
    else:
        assert torch.equal(moe_align(ids, e, block_m)[0], by_sort[0])
