"""The decode-size (row-streaming) MoE kernels against the per-expert float32 reference."""
import pytest
import torch

from kernel_checks import DEV, random_routing, quantize_fp8_blocks, quantize_fp8_rows, random_mxfp4, rel_err
from localchat.engine.weights.formats import DenseWeight, Fp8Weight, Mxfp4Weight
from localchat.kernels.moe import MoeConfig, MoeExperts, fused_moe, fused_moe_ref, gpt_oss_experts
from localchat.kernels.moe_routing import route_gpt_oss

TOL = {torch.float32: 1e-4, torch.float16: 5e-3, torch.bfloat16: 2e-2}


@pytest.mark.parametrize("fmt,dtype,block_m", [
    ("dense", torch.float32, 1),
    ("fp8_channel", torch.float16, 1),
    ("fp8_channel", torch.float32, 4),
    ("fp8_block", torch.float32, 2),
])
def test_glm_experts_gemv(fmt, dtype, block_m):
    # K=80 leaves a partial K chunk and partial FP8 scale blocks; N=40 a partial row slab
    e, k, h, i, t = 3, 2, 80, 40, 5  # 3 experts, 10 pairs: several pairs share an expert
    gate, up, down = (torch.randn(e, *s, device=DEV) / s[1] ** 0.5 for s in ((i, h), (i, h), (h, i)))
    if fmt == "dense":
        weights = [DenseWeight(w.to(dtype)) for w in (gate, up, down)]
    elif fmt == "fp8_channel":
        weights = [Fp8Weight(*quantize_fp8_rows(w)) for w in (gate, up, down)]
    else:
        weights = [Fp8Weight(*quantize_fp8_blocks(w, 16, 32), block=(16, 32)) for w in (gate, up, down)]
    experts = MoeExperts(*weights)
    x = torch.randn(t, h, device=DEV, dtype=dtype)
    w, ids = random_routing(t, e, k)
    cfg = MoeConfig(block_m, 16, 32, 1, 1, gemv=True)
    out = fused_moe(x, experts, w, ids, config=cfg)
    assert out.shape == (t, h) and out.dtype == dtype
    assert rel_err(out, fused_moe_ref(x, experts, w, ids)) < TOL[dtype]


@pytest.mark.parametrize("block_m", [1, 2])
def test_gpt_oss_mxfp4_gemv(block_m):
    # H=I=96: three 32-element scale groups, so the second 64-wide K chunk is half masked
    e, k, h, i, t = 4, 2, 96, 96, 5
    blocks, scales = random_mxfp4(e, 2 * i, h, device=DEV)
    dblocks, dscales = random_mxfp4(e, h, i, device=DEV)
    experts = gpt_oss_experts(Mxfp4Weight(blocks, scales), torch.randn(e, 2 * i, device=DEV),
                              Mxfp4Weight(dblocks, dscales), torch.randn(e, h, device=DEV))
    x = torch.randn(t, h, device=DEV, dtype=torch.float16)
    w, ids = route_gpt_oss(torch.randn(t, e, device=DEV), k)
    cfg = MoeConfig(block_m, 32, 64, 1, 1, gemv=True)
    out = fused_moe(x, experts, w, ids, config=cfg)
    assert rel_err(out, fused_moe_ref(x, experts, w, ids)) < TOL[torch.float16]


def test_gemv_rejects_mxfp4_block_k_off_groups():
    blocks, scales = random_mxfp4(2, 64, 64, device=DEV)
    dblocks, dscales = random_mxfp4(2, 64, 32, device=DEV)
    experts = gpt_oss_experts(Mxfp4Weight(blocks, scales), torch.zeros(2, 64, device=DEV),
                              Mxfp4Weight(dblocks, dscales), torch.zeros(2, 64, device=DEV))
    x = torch.randn(1, 64, device=DEV, dtype=torch.float16)
    w, ids = route_gpt_oss(torch.randn(1, 2, device=DEV), 1)
    with pytest.raises(ValueError, match="multiple of 32"):
        fused_moe(x, experts, w, ids, config=MoeConfig(1, 16, 48, 1, 1, gemv=True))
