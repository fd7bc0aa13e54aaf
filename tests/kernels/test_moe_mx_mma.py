"""The MXFP4 tensor-core MoE kernels (kernels/moe_mx_mma.py) against the per-expert float32 reference."""
import pytest
import torch

from kernel_checks import DEV, random_gpt_oss_experts, rel_err
from localchat.kernels.moe import MoeConfig, fused_moe, fused_moe_ref
from localchat.kernels.moe_mx_mma import chunk_major, chunk_order
from localchat.kernels.moe_routing import route_gpt_oss
from test_moe_gemv import _gpt_oss_case

BF16_TOL = 2e-2


def _case(t, e, k, h, i, scales=(110, 131), codes=None, drop=True):
    experts = _gpt_oss_case(e, h, i, scale_lo=scales[0], scale_hi=scales[1], codes=codes)
    # token rows of very different magnitudes
    x = (torch.randn(t, h, device=DEV) * torch.logspace(-3, 2.5, t, device=DEV)[:, None]).to(torch.bfloat16)
    w, ids = route_gpt_oss(torch.randn(t, e, device=DEV), k)
    if drop:
        ids[t // 2, 1] = -1  # a pair another rank would hold
    return experts, x, w, ids


def _check_rows(out, ref):
    assert out.shape == ref.shape and out.dtype == ref.dtype
    for row in range(out.shape[0]):  # each token to its own relative error, whatever its magnitude
        assert rel_err(out[row], ref[row]) < BF16_TOL, row


@pytest.mark.parametrize("block_m,block_n,block_k,down_tile", [(4, 32, 64, None), (2, 16, 128, (32, 32, 1, 1)),
                                                               (4, 32, 64, (32, 128, 1, 1)), (64, 32, 64, None)])
def test_gpt_oss_mxfp4_mma(block_m, block_n, block_k, down_tile):
    # H=96 / I=160: partial K chunks (three and five 32-value groups, rows padded to whole
    # chunks, down's K step other than gate/up's) and a partial row block; four dots a K step,
    # and one (64 pairs a block);
    # 6 experts for 10 pairs: some share an expert, some experts get none, one pair is dropped
    experts, x, w, ids = _case(5, 6, 2, 96, 160)
    cfg = MoeConfig(block_m, block_n, block_k, 1, 1, mx_mma=True, down_tile=down_tile)
    out = fused_moe(x, experts, w, ids, config=cfg)
    _check_rows(out, fused_moe_ref(x, experts, w, ids))


def test_mma_pads_whatever_its_buffers_held(monkeypatch):
    # I=160 on down's K steps of 64 pads the gate/up output to 192 columns: the pad meets zero
    # weights, so it must hold zeros, not what the allocator left (here NaN)
    experts, x, w, ids = _case(5, 6, 2, 96, 160)
    cfg = MoeConfig(4, 32, 64, 1, 1, mx_mma=True)
    clean = fused_moe(x, experts, w, ids, config=cfg)
    empty = torch.empty

    def poisoned(*size, **kw):
        t = empty(*size, **kw)
        return t.fill_(float("nan")) if t.is_floating_point() else t

    monkeypatch.setattr(torch, "empty", poisoned)
    assert torch.equal(fused_moe(x, experts, w, ids, config=cfg), clean)


def test_mma_takes_rows_of_a_wider_buffer():
    # x as a view of every other column block of a wider tensor: rows are not contiguous
    experts, x, w, ids = _case(3, 4, 2, 64, 64, drop=False)
    wide = torch.zeros(3, 128, dtype=x.dtype, device=DEV)
    wide[:, :64] = x
    cfg = MoeConfig(4, 32, 64, 1, 1, mx_mma=True)
    assert torch.equal(fused_moe(wide[:, :64], experts, w, ids, config=cfg), fused_moe(x, experts, w, ids, config=cfg))


@pytest.mark.parametrize("h,chunk", [(96, 32), (160, 128), (256, 128), (96, 64)])
def test_chunk_order_is_the_launcher_permutation(h, chunk):
    # partial last chunks (160 = 128 + 32, 96 = 64 + 32) padded with zeros, each chunk on its own
    x = torch.arange(1, 2 * h + 1, dtype=torch.float32).view(2, h)
    xq = chunk_major(x, chunk)
    padded = -(-h // chunk) * chunk
    assert xq.shape == (2, padded)
    for k in range(h):
        assert xq[1, chunk_order(k, chunk)] == x[1, k]
    assert len({chunk_order(k, chunk) for k in range(h)}) == h
    assert (xq == 0).sum().item() == 2 * (padded - h)


def test_mma_rejects_what_it_cannot_run():
    experts, x, w, ids = _case(2, 4, 2, 64, 64, drop=False)
    with pytest.raises(ValueError, match="bf16 activations"):
        fused_moe(x.to(torch.float16), experts, w, ids, config=MoeConfig(4, 32, 64, 1, 1, mx_mma=True))
    with pytest.raises(ValueError, match="tile"):
        fused_moe(x, experts, w, ids, config=MoeConfig(1, 32, 64, 1, 1, gemv=True, mx_mma=True))


def test_defaults_take_the_tensor_core_kernels_above_one_pair_per_expert():
    from localchat.kernels.moe import FMT_MXFP4, default_config
    assert default_config(32 * 4, 128, FMT_MXFP4, on_gpu=True).mx_half2  # one pair per expert
    cfg = default_config(64 * 4, 128, FMT_MXFP4, on_gpu=True)
    assert cfg.mx_mma and (cfg.block_m, cfg.block_k, cfg.down_tile) == (8, 128, (128, 128, 4, 3))
    assert (default_config(1024 * 4, 32, FMT_MXFP4, on_gpu=True).block_m, default_config(1024 * 4, 128, FMT_MXFP4, on_gpu=True).block_m) == (128, 64)
    # fp16 activations: the row kernels up to four pairs per expert, then the dot_scaled tiles
    assert default_config(64 * 4, 128, FMT_MXFP4, on_gpu=True, bf16=False).mx_half2
    assert not default_config(1024 * 4, 32, FMT_MXFP4, on_gpu=True, bf16=False).mx_mma


# ---- on a GPU: the assembly path ---------------------------------------------------------------

@pytest.mark.gpu
@pytest.mark.parametrize("codes,scales", [(None, (66, 193)), ((0, 1, 8, 9), (110, 131))])
def test_mma_small_shapes_gpu(codes, scales):
    # the interpreter cases compiled, at the ends of the exact scale range (2^-61..2^65), and with
    # +-0 / +-0.5 codes only: 0.5 is a bf16 subnormal before its scale multiply, so a flush to
    # zero there would zero the result
    experts, x, w, ids = _case(5, 6, 2, 96, 160, scales=scales, codes=codes)
    for cfg in (MoeConfig(8, 16, 128, 1, 3, mx_mma=True, down_tile=(32, 128, 1, 3)),
                MoeConfig(8, 32, 128, 2, 2, mx_mma=True),
                MoeConfig(16, 128, 128, 4, 3, mx_mma=True), MoeConfig(64, 128, 128, 8, 3, mx_mma=True),
                MoeConfig(128, 64, 128, 4, 3, mx_mma=True, down_tile=(128, 256, 8, 2))):
        ref = fused_moe_ref(x, experts, w, ids)
        assert ref.abs().max() > 0
        _check_rows(fused_moe(x, experts, w, ids, config=cfg), ref)


@pytest.mark.gpu
@pytest.mark.parametrize("codes,scales", [(None, (66, 193)), ((0, 1, 8, 9), (110, 131))])
def test_mma_float32_decode_matches_the_assembly_gpu(codes, scales, monkeypatch):
    # what GPUs before Hopper run (no mul.bf16x2): codes decoded and scaled in float32, rounded to
    # bf16, the same dots in the same order -> within the bound of the reference, and the assembly
    # path's sums exactly where its products (times 2^-64) stay float32 normals
    from localchat.kernels import moe as moe_launchers
    from localchat.kernels.gpu_facts import GpuArch
    experts, x, w, ids = _case(5, 6, 2, 96, 160, scales=scales, codes=codes)
    ref = fused_moe_ref(x, experts, w, ids)
    for cfg in (MoeConfig(8, 16, 128, 1, 3, mx_mma=True, down_tile=(32, 128, 1, 3)),
                MoeConfig(64, 128, 128, 8, 3, mx_mma=True)):
        hopper = fused_moe(x, experts, w, ids, config=cfg)
        with monkeypatch.context() as m:
            m.setattr(moe_launchers, "gpu_arch", lambda device: GpuArch((8, 9), 101376))
            ada = fused_moe(x, experts, w, ids, config=cfg)
        _check_rows(ada, ref)
        if scales == (110, 131):
            assert torch.equal(ada, hopper)


@pytest.mark.gpu
def test_mma_rejects_tiles_that_fail_on_the_gpu():
    experts, x, w, ids = _case(2, 4, 2, 64, 64, drop=False)
    with pytest.raises(ValueError, match="multiple of 128"):
        fused_moe(x, experts, w, ids, config=MoeConfig(8, 32, 64, 1, 3, mx_mma=True))


@pytest.mark.gpu
@pytest.mark.parametrize("e,t,cfg", [
    (128, 8, MoeConfig(8, 128, 128, 4, 3, mx_mma=True)),
    (128, 32, MoeConfig(16, 128, 128, 4, 3, mx_mma=True)),
    (128, 64, MoeConfig(16, 64, 256, 4, 3, mx_mma=True)),
    (32, 32, MoeConfig(16, 128, 128, 8, 3, mx_mma=True)),
    (128, 1024, MoeConfig(64, 64, 128, 4, 3, mx_mma=True)),
    (128, 2048, MoeConfig(128, 64, 128, 4, 3, mx_mma=True)),
])
def test_gpt_oss_mma_gpu(e, t, cfg):
    k, h, i = 4, 2880, 2880
    experts = random_gpt_oss_experts(e, i, h, bias_dtype=torch.bfloat16, device="cuda")
    x = torch.randn(t, h, device="cuda", dtype=torch.bfloat16)
    w, ids = route_gpt_oss(torch.randn(t, e, device="cuda"), k)
    err = rel_err(fused_moe(x, experts, w, ids, config=cfg), fused_moe_ref(x, experts, w, ids))
    print(f"\ngpt-oss E={e} mma T={t} {cfg}: rel err {err:.1e}")
    assert err < BF16_TOL
