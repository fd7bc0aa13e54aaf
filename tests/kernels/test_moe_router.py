"""The one-launch MoE router (logits + top-k) against the linear + routing references."""
import pytest
import torch
import torch.nn.functional as F

from kernel_checks import cuda_time_us
from localchat.kernels.arrivals import arrival_counts
from localchat.kernels.moe_router import router_glm, router_glm_ref, router_gpt_oss, router_gpt_oss_ref
from localchat.kernels.moe_routing import route_glm, route_gpt_oss

DEV = "cuda" if torch.cuda.is_available() else "cpu"


def _gpt_oss_logits(x, w, b):
    """What the reference linear produces, up to its summation order: float32 sums plus the bias,
    rounded once to x's dtype."""
    return (F.linear(x.float(), w.float()) + b.float()).to(x.dtype).float()


def _check_gpt_oss(weights, ids, logits, k):
    """Ties in bf16 logits are common, and which of two equal experts a reference picks is
    unspecified: compare the logit values chosen (within one bf16 step, for a rounding the two
    summation orders may take differently) and the softmax over them."""
    t, e = logits.shape
    assert ids.shape == (t, k) and ids.dtype == torch.int32
    assert ((ids >= 0) & (ids < e)).all()
    assert all(len(set(row.tolist())) == k for row in ids)
    chosen = logits.gather(1, ids.long())
    torch.testing.assert_close(chosen.sort(-1).values, logits.topk(k, -1).values.sort(-1).values,
                               rtol=1e-2, atol=1e-3)
    assert (chosen[:, :-1] >= chosen[:, 1:] - 1e-2 * chosen.abs()[:, 1:]).all()  # best first
    torch.testing.assert_close(weights, torch.softmax(chosen, -1), rtol=2e-2, atol=2e-3)


@pytest.mark.parametrize("t,e,k_dim,block_t", [(1, 128, 200, 1), (5, 20, 70, 2), (3, 32, 64, 1)])
def test_router_gpt_oss(t, e, k_dim, block_t):
    dtype = torch.bfloat16 if DEV == "cuda" else torch.float16  # the interpreter truncates to bf16
    x = torch.randn(t, k_dim, device=DEV).to(dtype)
    w = (torch.randn(e, k_dim, device=DEV) / 8).to(torch.bfloat16)
    b = torch.randn(e, device=DEV).to(dtype)
    weights, ids = router_gpt_oss(x, w, b, 4, block_t=block_t)
    _check_gpt_oss(weights, ids, _gpt_oss_logits(x, w, b), 4)
    rw, rids = router_gpt_oss_ref(x, w, b, 4)
    _check_gpt_oss(rw, rids, _gpt_oss_logits(x, w, b), 4)


@pytest.mark.parametrize("t,e,k_dim,k,block_t", [(1, 128, 200, 8, 1), (6, 24, 100, 3, 4), (2, 64, 128, 8, 1)])
def test_router_glm(t, e, k_dim, k, block_t):
    x = torch.randn(t, k_dim, device=DEV).to(torch.bfloat16)
    w = (torch.randn(e, k_dim, device=DEV) / 8).to(torch.bfloat16)
    bias = torch.randn(e, device=DEV) * 0.5  # large enough to change the selection
    weights, ids = router_glm(x, w, bias, k, renormalize=True, routed_scaling_factor=2.5, block_t=block_t)
    rw, rids = router_glm_ref(x, w, bias, k, renormalize=True, routed_scaling_factor=2.5)
    # float32 logits: ties are as unlikely as in the reference's own tests
    assert torch.equal(ids, rids.to(ids.device))
    torch.testing.assert_close(weights, rw, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("t,block_t", [(1, 1), (5, 2)])
def test_router_glm_with_the_shared_expert_column(t, block_t):
    # the shared expert stacked behind the routed ones: one more column, expert E at weight 1
    e, k_dim, k = 24, 100, 3
    x = torch.randn(t, k_dim, device=DEV).to(torch.bfloat16)
    w = (torch.randn(e, k_dim, device=DEV) / 8).to(torch.bfloat16)
    bias = torch.randn(e, device=DEV) * 0.5
    weights, ids = router_glm(x, w, bias, k, routed_scaling_factor=2.5, block_t=block_t, shared_expert=e)
    rw, rids = router_glm_ref(x, w, bias, k, routed_scaling_factor=2.5, shared_expert=e)
    assert ids.shape == (t, k + 1) and torch.equal(ids, rids.to(ids.device))
    assert (ids[:, -1] == e).all() and (weights[:, -1] == 1).all()
    torch.testing.assert_close(weights, rw, rtol=1e-5, atol=1e-6)
    plain_w, plain_ids = router_glm(x, w, bias, k, routed_scaling_factor=2.5, block_t=block_t)
    assert torch.equal(ids[:, :k], plain_ids) and torch.equal(weights[:, :k], plain_w)


def test_router_counts_reset_and_rejects():
    """Each launch leaves its arrival counts at zero, so the next call (or graph replay) routes
    again; a second call with other activations gives their own routing."""
    w = (torch.randn(16, 96, device=DEV) / 8).to(torch.bfloat16)
    b = torch.zeros(16, device=DEV).to(torch.bfloat16)
    for _ in range(2):
        x = torch.randn(3, 96, device=DEV).to(torch.bfloat16)
        weights, ids = router_gpt_oss(x, w, b, 2, block_k=32, block_t=2)
        _check_gpt_oss(weights, ids, _gpt_oss_logits(x, w, b), 2)
        assert int(arrival_counts(x.device, 2)[:2].abs().sum()) == 0
    with pytest.raises(ValueError, match="top_k"):
        router_gpt_oss(x, w, b, 17)
    with pytest.raises(ValueError, match=r"\[T, K\]"):
        router_gpt_oss(x[:, :50], w, b, 2)
    with pytest.raises(NotImplementedError, match="n_group"):
        router_glm(x, w, None, 2, n_group=2)


@pytest.mark.gpu
@pytest.mark.parametrize("t", [1, 7, 32])
def test_router_gpu_real_shapes(t):
    """gpt-oss-120b (128 experts of 2880, top-4, biases) and GLM-4.5V (128 of 4096, top-8,
    correction bias) against the GEMM + routing launches they replace, also replayed from a CUDA
    graph, and timed against them."""
    torch.manual_seed(t)
    x = torch.randn(t, 2880, device="cuda").to(torch.bfloat16)
    w = (torch.randn(128, 2880, device="cuda") / 50).to(torch.bfloat16)
    b = (torch.randn(128, device="cuda") / 10).to(torch.bfloat16)
    weights, ids = router_gpt_oss(x, w, b, 4)
    _check_gpt_oss(weights, ids, _gpt_oss_logits(x, w, b), 4)
    old = lambda: route_gpt_oss(F.linear(x, w, b), 4)  # noqa: E731
    _check_gpt_oss(*old(), _gpt_oss_logits(x, w, b), 4)

    xg = torch.randn(t, 4096, device="cuda").to(torch.bfloat16)
    wg = (torch.randn(128, 4096, device="cuda") / 50).to(torch.bfloat16)
    bias = torch.randn(128, device="cuda") / 20
    gw, gids = router_glm(xg, wg, bias, 8)
    rw, rids = route_glm(F.linear(xg.float(), wg.float()), bias, 8)
    assert torch.equal(gids, rids)
    torch.testing.assert_close(gw, rw, rtol=1e-5, atol=1e-6)

    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = router_gpt_oss(x, w, b, 4)
    for _ in range(2):
        x.copy_(torch.randn_like(x))
        graph.replay()
        torch.cuda.synchronize()
        _check_gpt_oss(*out, _gpt_oss_logits(x, w, b), 4)
    fused_us = cuda_time_us(lambda: router_gpt_oss(x, w, b, 4))
    old_us = cuda_time_us(old)

    print(f"\n  router T={t}: one launch {fused_us:.1f} us, GEMM + routing {old_us:.1f} us")
