"""The MXFP4 MoE kernels on FP8 tensor cores (kernels/moe_mx_fp8.py) against the per-expert float32
reference, and their activation planes against the torch reference."""
import pytest
import torch

from kernel_checks import DEV, random_gpt_oss_experts, rel_err
from localchat.kernels.moe import MoeConfig, fused_moe, fused_moe_ref
from localchat.kernels.moe_mx_fp8 import act_exp, fp8_order, mx_fp8_x_kernel, mx_fp8_x_ref
from localchat.kernels.moe_routing import route_gpt_oss
from test_moe_mx_mma import _case, _check_rows


def test_fp8_order_is_a_permutation_keeping_groups():
    h = 96
    pos = [fp8_order(k, h) for k in range(h)]
    assert sorted(pos) == list(range(h))
    assert all(p // 32 == k // 32 for k, p in enumerate(pos))
    # a thread's two A registers (positions 4q..4q+3 and 16+4q..16+4q+3) are one word's codes
    for q in range(4):
        lo = {k for k in range(32) if 4 * q <= fp8_order(k, 32) < 4 * q + 4}
        hi = {k for k in range(32) if 16 + 4 * q <= fp8_order(k, 32) < 20 + 4 * q}
        assert lo | hi == set(range(8 * q, 8 * q + 8))


def test_activation_planes_match_the_reference():
    t, h = 5, 2880
    x = (torch.randn(t, h, device=DEV) * torch.logspace(-4, 3, t, device=DEV)[:, None]).to(torch.bfloat16)
    x[3] = 0  # an all-zero row keeps a finite scale
    xq = torch.full((t, 2, h), float("nan"), device=DEV).to(torch.float8_e4m3fn)
    inv = torch.full((t,), float("nan"), device=DEV)
    mx_fp8_x_kernel[(t,)](x, x.stride(0), xq, inv, h, BLOCK_H=4096)
    ref_q, ref_inv = mx_fp8_x_ref(x)
    assert torch.equal(inv, ref_inv)
    assert torch.equal(xq.to(torch.float32), ref_q.to(torch.float32))  # a zero's sign may differ
    # two e4m3 terms carry each value to about bf16's precision
    order = torch.tensor([fp8_order(k, h) for k in range(h)], device=DEV)
    back = (xq[:, 0, order].to(torch.float32) + xq[:, 1, order].to(torch.float32)) * inv[:, None]
    xf = x.to(torch.float32)
    big = xf.abs() > xf.abs().amax(dim=1, keepdim=True) * 2 ** -6
    assert ((back - xf).abs() <= xf.abs() * 2 ** -8)[big].all()


def test_act_exp_keeps_the_clamped_glu_in_e4m3():
    assert act_exp(7.0) == 2  # 56 * 4 = 224 < 256
    assert 256 / 2 <= 7.0 * 8.0 * 2 ** act_exp(7.0) < 256


@pytest.mark.parametrize("block_m,block_n,down_tile", [(4, 32, None), (2, 16, (64, 128, 1, 1))])
def test_gpt_oss_mxfp4_fp8(block_m, block_n, down_tile):
    # H=96 / I=160: partial 128-wide K chunks (three and five 32-value groups) and a partial row
    # block; 6 experts for 10 pairs: some share an expert, some get none, one pair is dropped
    experts, x, w, ids = _case(5, 6, 2, 96, 160)
    cfg = MoeConfig(block_m, block_n, 128, 1, 1, mx_fp8=True, down_tile=down_tile)
    out = fused_moe(x, experts, w, ids, config=cfg)
    _check_rows(out, fused_moe_ref(x, experts, w, ids))


def test_fp8_rejects_what_it_cannot_run():
    experts, x, w, ids = _case(2, 4, 2, 64, 64, drop=False)
    with pytest.raises(ValueError, match="block_k 128"):
        fused_moe(x, experts, w, ids, config=MoeConfig(4, 32, 64, 1, 1, mx_fp8=True))
    with pytest.raises(ValueError, match="tile kernels"):
        fused_moe(x, experts, w, ids, config=MoeConfig(1, 32, 128, 1, 1, gemv=True, mx_fp8=True))


# ---- on a GPU: the assembly path and the warp-group MMAs --------------------------------------

@pytest.mark.gpu
@pytest.mark.parametrize("codes,scales", [(None, (100, 150)), ((0, 1, 8, 9), (110, 131))])
def test_fp8_small_shapes_gpu(codes, scales):
    experts, x, w, ids = _case(5, 6, 2, 96, 160, scales=scales, codes=codes)
    ref = fused_moe_ref(x, experts, w, ids)
    assert ref.abs().max() > 0
    for cfg in (MoeConfig(4, 64, 128, 4, 3, mx_fp8=True), MoeConfig(8, 128, 128, 4, 3, mx_fp8=True),
                MoeConfig(4, 128, 128, 4, 2, mx_fp8=True, down_tile=(64, 128, 4, 3))):
        _check_rows(fused_moe(x, experts, w, ids, config=cfg), ref)


@pytest.mark.gpu
@pytest.mark.parametrize("e,t,cfg", [
    (128, 1, MoeConfig(4, 64, 128, 4, 3, mx_fp8=True)),
    (128, 32, MoeConfig(4, 128, 128, 4, 3, mx_fp8=True)),
    (128, 64, MoeConfig(8, 128, 128, 4, 3, mx_fp8=True)),
    (32, 32, MoeConfig(16, 128, 128, 4, 3, mx_fp8=True)),
])
def test_gpt_oss_fp8_gpu(e, t, cfg):
    k, h, i = 4, 2880, 2880
    experts = random_gpt_oss_experts(e, i, h, bias_dtype=torch.bfloat16, device="cuda")
    x = torch.randn(t, h, device="cuda", dtype=torch.bfloat16)
    w, ids = route_gpt_oss(torch.randn(t, e, device="cuda"), k)
    err = rel_err(fused_moe(x, experts, w, ids, config=cfg), fused_moe_ref(x, experts, w, ids))
    print(f"\ngpt-oss E={e} fp8 T={t} {cfg}: rel err {err:.1e}")
    assert err < 1e-2
