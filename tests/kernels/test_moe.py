"""Fused MoE forward against the per-expert float32 reference, in every weight format."""
from dataclasses import replace

import pytest
import torch

from kernel_checks import (DEV, cuda_time_us, random_glm_weights, random_gpt_oss_experts,
                           random_mxfp4, random_routing, rel_err)
from localchat.engine.weights.formats import DenseWeight, Mxfp4Weight
from localchat.kernels.moe import MoeConfig, MoeExperts, fused_moe, fused_moe_ref, gpt_oss_experts, split_gate_up
from localchat.kernels.moe_routing import route_glm, route_gpt_oss

TOL = {torch.float32: 1e-4, torch.float16: 5e-3, torch.bfloat16: 2e-2}


def _glm_weights(fmt, e, i, h, dtype):
    return random_glm_weights(fmt, e, i, h, dtype=dtype, block=(16, 32))


@pytest.mark.parametrize("fmt,dtype,t", [
    ("dense", torch.float32, 5),
    ("dense", torch.float16, 17),
    ("fp8_channel", torch.float16, 3),
    ("fp8_block", torch.float32, 9),
])
def test_glm_experts(fmt, dtype, t):
    e, k, h, i = 6, 2, 80, 40  # K=80 leaves a partial K tile and partial FP8 scale blocks
    gate, up, down = _glm_weights(fmt, e, i, h, dtype)
    experts = MoeExperts(gate, up, down)
    x = torch.randn(t, h, device=DEV, dtype=dtype)
    w, ids = random_routing(t, e, k)
    out = fused_moe(x, experts, w, ids)
    ref = fused_moe_ref(x, experts, w, ids)
    assert out.shape == (t, h) and out.dtype == dtype
    assert rel_err(out, ref) < TOL[dtype]


def test_glm_fused_concat_layout_matches_separate():
    e, k, h, i, t = 4, 2, 64, 32, 6
    gate_up = torch.randn(e, 2 * i, h, device=DEV) / 8
    down = torch.randn(e, h, i, device=DEV) / 6
    gate, up = split_gate_up(DenseWeight(gate_up), interleaved=False)
    experts = MoeExperts(gate, up, DenseWeight(down))
    separate = MoeExperts(DenseWeight(gate_up[:, :i].contiguous()), DenseWeight(gate_up[:, i:].contiguous()),
                          DenseWeight(down))
    x = torch.randn(t, h, device=DEV)
    w, ids = route_glm(torch.randn(t, e, device=DEV), torch.zeros(e, device=DEV), k)
    out = fused_moe(x, experts, w, ids)
    assert rel_err(out, fused_moe_ref(x, separate, w, ids)) < 1e-4


@pytest.mark.parametrize("fmt", ["fp8_channel", "fp8_block"])
def test_fp8_tiles_on_e4m3_activations(fmt):
    # Both GEMMs' inputs quantised per row to e4m3 (FP8 x FP8 dots); the reference quantises the
    # same way when given the same config. 19 tokens: a partial pair block; K=80 a partial K tile.
    e, k, h, i, t = 6, 2, 80, 40, 19
    gate, up, down = _glm_weights(fmt, e, i, h, torch.float32)
    experts = MoeExperts(gate, up, down)
    x = torch.randn(t, h, device=DEV) * torch.rand(t, 1, device=DEV) * 4  # rows of unlike scales
    w, ids = random_routing(t, e, k)
    cfg = MoeConfig(16, 32, 16, 1, 1, fp8_act=True)
    out = fused_moe(x, experts, w, ids, config=cfg)
    ref = fused_moe_ref(x, experts, w, ids, config=cfg)
    exact = fused_moe_ref(x, experts, w, ids)  # activations unquantised
    assert rel_err(out, ref) < 1e-4
    # the quantisation did happen, and costs what e4m3's 3 mantissa bits cost
    assert 2e-3 < rel_err(out, exact) < 8e-2
    unscaled = fused_moe(x, experts, w, ids, config=MoeConfig(16, 32, 16, 1, 1))
    assert rel_err(unscaled, exact) < 1e-4


@pytest.mark.parametrize("fmt,dtype,fp8_act,bias", [
    ("dense", torch.float32, False, True),
    ("dense", torch.float16, False, False),
    ("fp8_channel", torch.float32, False, False),
    ("fp8_channel", torch.float32, True, False),
    ("fp8_block", torch.float16, False, True),
    ("fp8_block", torch.float32, True, False),
])
def test_pairs_major_tiles_match_the_weight_major_ones(fmt, dtype, fp8_act, bias):
    # The same tiles turned round (pairs as the MMA's M): same products, other summation order.
    # 19 tokens: a partial pair block; K=80 a partial K tile and partial FP8 scale blocks; biases
    # and gpt-oss's clamped SwiGLU on some, so every epilogue term is laid along the right axis.
    e, k, h, i, t = 6, 2, 80, 40, 19
    gate, up, down = _glm_weights(fmt, e, i, h, dtype if fmt == "dense" else torch.float32)
    biases = (torch.randn(e, i, device=DEV), torch.randn(e, i, device=DEV), torch.randn(e, h, device=DEV)) \
        if bias else (None, None, None)
    experts = MoeExperts(gate, up, down, *biases, activation="swiglu_clamped" if bias else "silu_glu")
    x = torch.randn(t, h, device=DEV).to(dtype) * torch.rand(t, 1, device=DEV).to(dtype) * 4
    w, ids = random_routing(t, e, k)
    ids[3, 1] = -1  # a pair another rank holds adds nothing
    cfg = MoeConfig(16, 32, 16, 1, 1, fp8_act=fp8_act)
    turned = MoeConfig(16, 32, 16, 1, 1, fp8_act=fp8_act, pairs_major=True)
    out = fused_moe(x, experts, w, ids, config=turned)
    assert out.dtype == dtype
    assert rel_err(out, fused_moe(x, experts, w, ids, config=cfg)) < TOL[dtype]
    assert rel_err(out, fused_moe_ref(x, experts, w, ids, config=cfg)) < TOL[dtype]
    # down on a tile of its own: 64 rows leave a partial block of H=80, K steps of 32 a partial one of I=40
    own_down = fused_moe(x, experts, w, ids, config=replace(turned, down_tile=(64, 32, 1, 1)))
    assert rel_err(own_down, out) < TOL[dtype]


def test_pairs_major_refuses_what_it_does_not_cover():
    e, k, h, i, t = 4, 2, 64, 32, 5
    experts = random_gpt_oss_experts(e, i, h)
    x = torch.randn(t, h, device=DEV, dtype=torch.bfloat16)
    w, ids = random_routing(t, e, k)
    with pytest.raises(ValueError, match="pairs_major"):
        fused_moe(x, experts, w, ids, config=MoeConfig(16, 32, 64, 1, 1, pairs_major=True))


@pytest.mark.parametrize("dot_scaled", [True, False])
def test_gpt_oss_mxfp4_experts(dot_scaled):
    e, k, h, i, t = 5, 2, 64, 64, 7
    blocks, scales = random_mxfp4(e, 2 * i, h, device=DEV)
    dblocks, dscales = random_mxfp4(e, h, i, device=DEV)
    experts = gpt_oss_experts(Mxfp4Weight(blocks, scales), torch.randn(e, 2 * i, device=DEV),
                              Mxfp4Weight(dblocks, dscales), torch.randn(e, h, device=DEV))
    x = torch.randn(t, h, device=DEV, dtype=torch.float16)
    w, ids = route_gpt_oss(torch.randn(t, e, device=DEV), k)
    cfg = MoeConfig(16, 32, 64, 1, 1, mx_dot_scaled=dot_scaled)
    out = fused_moe(x, experts, w, ids, config=cfg)
    ref = fused_moe_ref(x, experts, w, ids)
    assert rel_err(out, ref) < TOL[torch.float16]


def test_gpt_oss_swiglu_clamps():
    # large activations exercise both clamps (gate from above only, up on both sides)
    e, k, h, i, t = 3, 1, 32, 16, 4
    gate_up = DenseWeight(torch.randn(e, 2 * i, h, device=DEV) * 2)
    experts = gpt_oss_experts(gate_up, torch.randn(e, 2 * i, device=DEV), DenseWeight(torch.randn(e, h, i, device=DEV)),
                              torch.zeros(e, h, device=DEV))
    x = torch.randn(t, h, device=DEV) * 3
    w, ids = route_gpt_oss(torch.randn(t, e, device=DEV), k)
    assert rel_err(fused_moe(x, experts, w, ids), fused_moe_ref(x, experts, w, ids)) < 1e-4


@pytest.mark.parametrize("cfg", [MoeConfig(16, 32, 32, 1, 1), MoeConfig(1, 16, 32, 1, 1, gemv=True)])
def test_pairs_of_expert_minus_one_add_nothing(cfg):
    # Expert parallelism hands the kernels -1 for experts another rank holds.
    e, k, h, i, t = 4, 2, 48, 32, 6
    gate, up, down = _glm_weights("dense", e, i, h, torch.float32)
    experts = MoeExperts(gate, up, down)
    x = torch.randn(t, h, device=DEV)
    w, ids = random_routing(t, e, k)
    remote = ids >= 2  # experts 2 and 3 live elsewhere
    out = fused_moe(x, experts, w, torch.where(remote, -1, ids), config=cfg)
    want = fused_moe_ref(x, experts, torch.where(remote, 0.0, w), ids)
    assert remote.any() and not remote.all()
    assert rel_err(out, want) < 1e-4
    assert rel_err(fused_moe_ref(x, experts, w, torch.where(remote, -1, ids)), want) < 1e-6


# ---- real shapes on a GPU -------------------------------------------------------------------

def _expert_bytes(experts, ids):
    per = sum(sum(t[0].numel() * t.element_size() for t in _tensors(w)) for w in (experts.gate, experts.up, experts.down))
    return per * ids.unique().numel()


def _tensors(w):
    if isinstance(w, DenseWeight):
        return [w.weight]
    if isinstance(w, Mxfp4Weight):
        return [w.blocks, w.scales]
    return [w.weight, w.scale]


@pytest.mark.gpu
@pytest.mark.parametrize("fmt", ["fp8_channel", "fp8_block"])
@pytest.mark.parametrize("t", [1, 32, 256, 1024, 8192])  # row kernels, the tiles of 2, 16, 64 pairs per expert, a chunk
def test_glm45v_moe_gpu(fmt, t):
    e, k, h, i = 128, 8, 4096, 1408
    experts = MoeExperts(*random_glm_weights(fmt, e, i, h, device="cuda"))
    x = torch.randn(t, h, device="cuda", dtype=torch.bfloat16)
    w, ids = route_glm(torch.randn(t, e, device="cuda"), torch.randn(e, device="cuda") * 0.1, k)
    out = fused_moe(x, experts, w, ids)
    assert rel_err(out, fused_moe_ref(x, experts, w, ids)) < TOL[torch.bfloat16]
    us = cuda_time_us(lambda: fused_moe(x, experts, w, ids))
    gbs = _expert_bytes(experts, ids) / us / 1e3
    print(f"\nGLM-4.5V MoE {fmt} T={t}: {us:.1f} us, {gbs:.0f} GB/s ({gbs / 4270:.0%} of copy)")


@pytest.mark.gpu
@pytest.mark.parametrize("fmt", ["fp8_channel", "fp8_block"])
@pytest.mark.parametrize("t", [256, 2048])
def test_glm45v_pairs_major_tiles_gpu(fmt, t):
    """The turned tiles at GLM-4.5V's shapes, e4m3 activations, against the reference quantised alike."""
    e, k, h, i = 128, 8, 4096, 1408
    experts = MoeExperts(*random_glm_weights(fmt, e, i, h, device="cuda"))
    x = torch.randn(t, h, device="cuda", dtype=torch.bfloat16)
    w, ids = route_glm(torch.randn(t, e, device="cuda"), torch.randn(e, device="cuda") * 0.1, k)
    for cfg in (MoeConfig(64, 128, 128, 4, 3, fp8_act=True, pairs_major=True),
                MoeConfig(128, 128, 128, 8, 3, fp8_act=True, pairs_major=True)):
        out = fused_moe(x, experts, w, ids, config=cfg)
        assert rel_err(out, fused_moe_ref(x, experts, w, ids, config=cfg)) < TOL[torch.bfloat16], cfg


@pytest.mark.gpu
@pytest.mark.parametrize("e", [32, 128])
@pytest.mark.parametrize("t", [1, 32, 64, 256, 1024, 8192])  # row kernels, the tensor-core tiles of each bracket
def test_gpt_oss_moe_gpu(e, t):
    k, h, i = 4, 2880, 2880
    experts = random_gpt_oss_experts(e, i, h, bias_dtype=torch.bfloat16, device="cuda")
    x = torch.randn(t, h, device="cuda", dtype=torch.bfloat16)
    w, ids = route_gpt_oss(torch.randn(t, e, device="cuda"), k)
    out = fused_moe(x, experts, w, ids)
    assert rel_err(out, fused_moe_ref(x, experts, w, ids)) < TOL[torch.bfloat16]
    us = cuda_time_us(lambda: fused_moe(x, experts, w, ids))
    gbs = _expert_bytes(experts, ids) / us / 1e3
    print(f"\ngpt-oss E={e} MoE mxfp4 T={t}: {us:.1f} us, {gbs:.0f} GB/s ({gbs / 4270:.0%} of copy)")
