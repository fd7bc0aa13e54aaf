"""The decode-size (row-streaming) MoE kernels against the per-expert float32 reference."""
from dataclasses import replace

import pytest
import torch

from kernel_checks import (DEV, quantize_fp8_blocks, random_glm_weights, random_gpt_oss_experts,
                           random_mxfp4, random_routing, rel_err, with_aligned_scale_rows)
from localchat.engine.weights.formats import Fp8Weight, Mxfp4Weight, aligned_scale_rows
from localchat.kernels.moe import MoeConfig, MoeExperts, fused_moe, fused_moe_ref, gpt_oss_experts
from localchat.kernels.moe_routing import route_glm, route_gpt_oss

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
    experts = MoeExperts(*random_glm_weights(fmt, e, i, h, dtype=dtype, block=(16, 32)))
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


def _spread_tokens_run(experts, cfg, dtype):
    """Three tokens of very different magnitudes (each gets its own 2^k in the packed-f16 input),
    top-2 routing with one pair's expert -1, through fused_moe with cfg; each token checked against
    the float32 reference to its own relative error. -> (x, weights, ids, out)."""
    x = torch.randn(3, experts.hidden_size, device=DEV, dtype=dtype)
    x = x * torch.tensor([[1e-3], [1.0], [300.0]], device=DEV).to(dtype)
    w, ids = route_gpt_oss(torch.randn(3, experts.num_experts, device=DEV), 2)
    ids[2, 1] = -1
    out = fused_moe(x, experts, w, ids, config=cfg)
    ref = fused_moe_ref(x, experts, w, ids)
    for row in range(3):
        assert rel_err(out[row], ref[row]) < TOL[dtype]
    return x, w, ids, out


def _gpt_oss_case(e, h, i, scale_lo=118, scale_hi=123, codes=None):
    blocks, scales = random_mxfp4(e, 2 * i, h, device=DEV, scale_lo=scale_lo, scale_hi=scale_hi)
    dblocks, dscales = random_mxfp4(e, h, i, device=DEV, scale_lo=scale_lo, scale_hi=scale_hi)
    if codes is not None:  # bytes made only of the given codes
        pick = torch.tensor(codes, dtype=torch.uint8, device=DEV)
        blocks = pick[blocks.long() % len(codes)] | (pick[(blocks.long() // 16) % len(codes)] << 4)
        dblocks = pick[dblocks.long() % len(codes)] | (pick[(dblocks.long() // 16) % len(codes)] << 4)
    return gpt_oss_experts(Mxfp4Weight(blocks, scales), torch.randn(e, 2 * i, device=DEV),
                           Mxfp4Weight(dblocks, dscales), torch.randn(e, h, device=DEV))


@pytest.mark.parametrize("block_m,dtype,scales,prefetch", [(1, torch.float16, (96, 131), True),
                                                           (1, torch.bfloat16, (60, 229), False),
                                                           (2, torch.bfloat16, (60, 229), True),
                                                           (4, torch.float16, (96, 131), False)])
def test_gpt_oss_mxfp4_words(block_m, dtype, scales, prefetch):
    # H=96: three 32-value groups, so the second 64-wide chunk is half masked; I=160 five groups;
    # 6 experts for 4 pairs: some experts get none. The scales reach far from 127 (bf16 up to
    # 228, the multiplier's limit; fp16 as far as its range allows); bf16 activations take the
    # integer 2^100 path.
    e, k, h, i, t = 6, 2, 96, 160, 2
    experts = _gpt_oss_case(e, h, i, scale_lo=scales[0], scale_hi=scales[1])
    x = torch.randn(t, h, device=DEV, dtype=dtype)
    w, ids = route_gpt_oss(torch.randn(t, e, device=DEV), k)
    cfg = MoeConfig(block_m, 32, 64, 1, 1, gemv=True, mx_words=True, prefetch=prefetch)
    out = fused_moe(x, experts, w, ids, config=cfg)
    assert out.shape == (t, h) and out.dtype == dtype
    assert rel_err(out, fused_moe_ref(x, experts, w, ids)) < TOL[dtype]


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_mxfp4_words_keep_half_codes(dtype):
    # only +-0 and +-0.5: the word decode turns 0.5 into a float32 subnormal (0.5 * 2^-126),
    # so a flush to zero anywhere would zero the whole result
    e, k, h, i, t = 2, 1, 64, 32, 2
    experts = _gpt_oss_case(e, h, i, codes=(0, 1, 8, 9))
    experts = MoeExperts(experts.gate, experts.up, experts.down, None, None, None, "swiglu_clamped")
    x = torch.randn(t, h, device=DEV, dtype=dtype) * 4
    w, ids = route_gpt_oss(torch.randn(t, e, device=DEV), k)
    cfg = MoeConfig(1, 16, 64, 1, 1, gemv=True, mx_words=True, prefetch=True)
    ref = fused_moe_ref(x, experts, w, ids)
    assert ref.abs().max() > 0
    assert rel_err(fused_moe(x, experts, w, ids, config=cfg), ref) < TOL[dtype]


@pytest.mark.parametrize("dtype,block_n,block_k,tail_k,wide_x", [
    (torch.bfloat16, 32, 64, 64, False), (torch.float16, 16, 128, 64, False), (torch.bfloat16, 32, 32, 64, False),
    (torch.float16, 8, 128, 128, False), (torch.bfloat16, 16, 128, 32, False), (torch.float16, 16, 64, 32, True),
    (torch.bfloat16, 8, 128, 128, True)])
def test_gpt_oss_mxfp4_half2(dtype, block_n, block_k, tail_k, wide_x):
    # H=96 / I=160 leave partial K chunks and a partial row block; 6 experts for 6 pairs, one
    # pair's expert -1; token rows of very different magnitudes (each gets its own 2^k). tail_k:
    # the K steps after the last whole block_k (128: one masked step; 32: three steps of the
    # 96-wide gate/up input, one of the 160-wide GLU output after a whole step). wide_x: gate/up
    # loads each word's activation pairs at once.
    experts = _gpt_oss_case(6, 96, 160, scale_lo=110, scale_hi=131)
    cfg = MoeConfig(1, block_n, block_k, 1, 1, gemv=True, mx_half2=True, tail_k=tail_k, wide_x=wide_x)
    _spread_tokens_run(experts, cfg, dtype)


@pytest.mark.parametrize("dtype,block_n,tail_k,wide_x,tma_down,down_tile", [
    (torch.bfloat16, 32, 0, False, True, None), (torch.float16, 16, 64, True, True, (8, 512, 1, 2)),
    (torch.bfloat16, 16, 0, True, False, (32, 64, 1, 1))])
def test_gpt_oss_mxfp4_tma(dtype, block_n, tail_k, wide_x, tma_down, down_tile):
    # the packed-f16 kernels with words and scales read through tensor descriptors. Gate/up:
    # K=H=544, one whole 512-wide step and one group; down: K=I=96, no whole step. tail_k 0 runs
    # a last step past K on the descriptors' zero fill, 64 finishes with the pointer loads (one
    # masked step). 544 rows leave a partial row block at 32 rows; the pair with expert -1 and the
    # token magnitudes as in test_gpt_oss_mxfp4_half2. The down kernel on TMA with its own tile, or
    # on the pointer loads (which take steps of 64 past the last whole step when tail_k is 0).
    experts = with_aligned_scale_rows(_gpt_oss_case(3, 544, 96, scale_lo=110, scale_hi=131))
    cfg = MoeConfig(1, block_n, 512, 1, 2, gemv=True, mx_half2=True, tma=True, tma_down=tma_down, tail_k=tail_k,
                    wide_x=wide_x, down_tile=down_tile)
    x, w, ids, out = _spread_tokens_run(experts, cfg, dtype)
    if tail_k == 0 and tma_down:  # the same group sums as the pointer-load kernels, read another way
        plain = fused_moe(x, experts, w, ids, config=replace(cfg, tma=False, tma_down=False, block_k=256, tail_k=32))
        assert rel_err(out, plain) < 1e-5


@pytest.mark.parametrize("dtype,block_n,down_tile,wide_x", [(torch.bfloat16, 16, (32, 512, 1, 2), True),
                                                          (torch.float16, 32, None, False)])
def test_gpt_oss_mxfp4_two_pairs_per_program(dtype, block_n, down_tile, wide_x, num_warps=1):
    # two pairs of one expert per program (moe_align blocks of two), each word decoded once for
    # both. Routing by hand: expert 0 has three pairs (a block of two and one of one), expert 1
    # two, experts 2 and 3 one each, one pair expert -1 (another rank's); K = H = 544 (one whole
    # 512-wide step and one on the zero fill), I = 96 (no whole step); tokens far apart in magnitude.
    e, k, h, i = 4, 2, 544, 96
    experts = with_aligned_scale_rows(_gpt_oss_case(e, h, i, scale_lo=110, scale_hi=131))
    ids = torch.tensor([[0, 1], [0, 2], [0, -1], [3, 1]], dtype=torch.int32, device=DEV)
    w = torch.softmax(torch.randn(4, k, device=DEV), dim=1)
    x = (torch.randn(4, h, device=DEV, dtype=dtype)
         * torch.tensor([[1e-3], [1.0], [300.0], [2.0]], device=DEV).to(dtype))
    cfg = MoeConfig(2, block_n, 512, num_warps, 2, gemv=True, mx_half2=True, tma=True, tma_down=True, tail_k=0,
                    wide_x=wide_x, down_tile=down_tile)
    out = fused_moe(x, experts, w, ids, config=cfg)
    ref = fused_moe_ref(x, experts, w, ids)
    for row in range(4):
        assert rel_err(out[row], ref[row]) < TOL[dtype]
    # the same sums in the same order as one pair per program, and with the registers held
    assert torch.equal(out, fused_moe(x, experts, w, ids, config=replace(cfg, block_m=1)))
    assert torch.equal(out, fused_moe(x, experts, w, ids, config=replace(cfg, max_registers=184,
                                                                         down_max_registers=160)))


def test_tma_kernels_refuse_unaligned_scales_and_short_steps():
    e, k, h, i, t = 2, 2, 544, 96, 1
    experts = _gpt_oss_case(e, h, i)  # scale rows of 17 and 3 bytes
    x = torch.randn(t, h, device=DEV, dtype=torch.bfloat16)
    w, ids = route_gpt_oss(torch.randn(t, e, device=DEV), k)
    with pytest.raises(ValueError, match="aligned_scale_rows"):
        fused_moe(x, experts, w, ids, config=MoeConfig(1, 16, 512, 1, 2, gemv=True, mx_half2=True, tma_down=True))
    with pytest.raises(ValueError, match="multiple of 512"):
        fused_moe(x, with_aligned_scale_rows(experts), w, ids,
                  config=MoeConfig(1, 16, 256, 1, 2, gemv=True, mx_half2=True, tma=True))


def test_aligned_scale_rows_keeps_values():
    blocks, scales = random_mxfp4(3, 8, 96, device=DEV)
    wt = Mxfp4Weight(blocks, scales)
    aligned = aligned_scale_rows(wt)
    assert aligned.scales.stride(-2) == 16 and aligned.scales.data_ptr() % 16 == 0
    assert torch.equal(aligned.scales, scales) and aligned.blocks is blocks
    assert torch.equal(aligned.dequantize(), wt.dequantize())
    assert aligned_scale_rows(aligned) is aligned


def test_gpt_oss_mxfp4_half2_down_tile():
    # the down kernel on a tile of its own (rows, K step with a tail of one masked step, stages)
    e, k, h, i, t = 6, 2, 96, 160, 2
    experts = _gpt_oss_case(e, h, i)
    x = torch.randn(t, h, device=DEV, dtype=torch.bfloat16)
    w, ids = route_gpt_oss(torch.randn(t, e, device=DEV), k)
    cfg = MoeConfig(1, 16, 64, 1, 1, gemv=True, mx_half2=True, down_tile=(32, 128, 1, 1))
    out = fused_moe(x, experts, w, ids, config=cfg)
    assert rel_err(out, fused_moe_ref(x, experts, w, ids)) < TOL[torch.bfloat16]


def test_half2_input_from_the_norm_gives_the_same_result():
    # the conversion kernel equals its reference exactly, and fused_moe given that input form
    # (as the norm in front writes it) returns exactly what its own conversion gives
    from localchat.kernels.moe_gemv_half2 import half2_input_ref, mx_half2_x_kernel
    e, k, h, i, t = 6, 2, 96, 160, 3
    experts = _gpt_oss_case(e, h, i, scale_lo=110, scale_hi=131)
    x = (torch.randn(t, h, device=DEV) * torch.tensor([[1e-3], [1.0], [300.0]], device=DEV)).to(torch.bfloat16)
    xq = torch.empty(t, h, dtype=torch.float16, device=DEV)
    inv = torch.empty(t, dtype=torch.float32, device=DEV)
    mx_half2_x_kernel[(t,)](x, x.stride(0), xq, inv, h, BLOCK_H=128)
    ref_q, ref_inv = half2_input_ref(x)
    assert torch.equal(xq, ref_q) and torch.equal(inv, ref_inv)
    w, ids = route_gpt_oss(torch.randn(t, e, device=DEV), k)
    cfg = MoeConfig(1, 16, 64, 1, 1, gemv=True, mx_half2=True)
    assert torch.equal(fused_moe(x, experts, w, ids, config=cfg, x_half2=(ref_q, ref_inv)),
                       fused_moe(x, experts, w, ids, config=cfg))
    with pytest.raises(ValueError, match="x_half2"):
        fused_moe(x, experts, w, ids, config=cfg, x_half2=(ref_q[:, :64], ref_inv))


def test_half2_order_matches_kernel_positions():
    from localchat.kernels.moe_gemv_half2 import act_scale_exp, half2_order
    assert half2_order() == [0, 4, 1, 5, 2, 6, 3, 7]
    k = act_scale_exp(7.0)  # gpt-oss: |act| <= 56
    assert 56 * 2 ** k < 2 ** 14 <= 56 * 2 ** (k + 1)


def test_default_half2_falls_back_to_words_for_other_activations(monkeypatch):
    # the GPU default for MXFP4 is the packed-f16 path, which needs the clamped SwiGLU to bound
    # its f16 GLU output; experts with another activation must get the word decode instead
    import localchat.kernels.moe as moe
    chosen = []
    real = moe.half2_experts

    def spy(*args, **kwargs):
        chosen.append("half2")
        return real(*args, **kwargs)

    monkeypatch.setattr(moe, "default_config", lambda *a, **k: MoeConfig(1, 16, 64, 1, 1, gemv=True, mx_half2=True))
    monkeypatch.setattr(moe, "half2_experts", spy)
    gpt = _gpt_oss_case(3, 64, 32)
    x = torch.randn(2, 64, device=DEV, dtype=torch.bfloat16)
    w, ids = route_gpt_oss(torch.randn(2, 3, device=DEV), 2)
    assert rel_err(fused_moe(x, gpt, w, ids), fused_moe_ref(x, gpt, w, ids)) < TOL[torch.bfloat16]
    assert chosen == ["half2"]
    silu = MoeExperts(gpt.gate, gpt.up, gpt.down, gpt.gate_bias, gpt.up_bias, gpt.down_bias, "silu_glu")
    assert rel_err(fused_moe(x, silu, w, ids), fused_moe_ref(x, silu, w, ids)) < TOL[torch.bfloat16]
    assert chosen == ["half2"]  # the silu experts took the word decode


def _one_token_gpt_oss(dtype):
    """Two small gpt-oss experts (H=64, I=32), one token of dtype and its routing to one expert."""
    x = torch.randn(1, 64, device=DEV, dtype=dtype)
    return _gpt_oss_case(2, 64, 32), x, *route_gpt_oss(torch.randn(1, 2, device=DEV), 1)


def test_half2_rejects_what_it_cannot_run():
    gpt, x, w, ids = _one_token_gpt_oss(torch.bfloat16)
    with pytest.raises(ValueError, match="one or two pairs per program"):
        fused_moe(x, gpt, w, ids, config=MoeConfig(4, 16, 64, 1, 1, gemv=True, mx_half2=True))
    with pytest.raises(ValueError, match="TMA engine"):  # two pairs per program only on the TMA loads
        fused_moe(x, gpt, w, ids, config=MoeConfig(2, 16, 512, 1, 1, gemv=True, mx_half2=True, tma=True, tail_k=0))
    silu = MoeExperts(gpt.gate, gpt.up, gpt.down, activation="silu_glu")
    with pytest.raises(ValueError, match="clamped SwiGLU"):
        fused_moe(x, silu, w, ids, config=MoeConfig(1, 16, 64, 1, 1, gemv=True, mx_half2=True))


@pytest.mark.parametrize("fmt,dtype,block_m,block_k", [
    ("dense", torch.float32, 1, 32),
    ("fp8_channel", torch.float16, 2, 32),
    ("fp8_block", torch.float32, 1, 64),  # two 32-wide scale blocks per K step
    ("fp8_block", torch.float16, 4, 16),  # two K steps per scale block
])
def test_glm_experts_pipelined_rows(fmt, dtype, block_m, block_k):
    # the row kernels with their K loop pipelined two deep (a no-op under the interpreter, which
    # still runs the loop as written)
    e, k, h, i, t = 4, 2, 80, 48, 3  # partial K chunk, partial scale blocks, an expert without pairs
    experts = MoeExperts(*random_glm_weights(fmt, e, i, h, dtype=dtype, block=(16, 32)))
    x = torch.randn(t, h, device=DEV, dtype=dtype)
    w, ids = random_routing(t, e, k)
    cfg = MoeConfig(block_m, 16, block_k, 1, 2, gemv=True)
    out = fused_moe(x, experts, w, ids, config=cfg)
    assert rel_err(out, fused_moe_ref(x, experts, w, ids)) < TOL[dtype]


def test_fp8_block_gemv_wide_k():
    # the per-chunk-reduction kernel with a K step spanning two scale blocks
    e, k, h, i, t = 3, 2, 80, 40, 2
    weights = [Fp8Weight(*quantize_fp8_blocks(torch.randn(e, *s, device=DEV) / s[1] ** 0.5, 16, 32), block=(16, 32))
               for s in ((i, h), (i, h), (h, i))]
    experts = MoeExperts(*weights)
    x = torch.randn(t, h, device=DEV, dtype=torch.float32)
    w, ids = random_routing(t, e, k)
    out = fused_moe(x, experts, w, ids, config=MoeConfig(1, 16, 64, 1, 1, gemv=True))
    assert rel_err(out, fused_moe_ref(x, experts, w, ids)) < TOL[torch.float32]


def test_new_row_kernels_reject_bad_tiles():
    gpt, x, w, ids = _one_token_gpt_oss(torch.float16)
    with pytest.raises(ValueError, match="at most 4 pairs"):
        fused_moe(x, gpt, w, ids, config=MoeConfig(8, 16, 64, 1, 1, gemv=True, mx_words=True))
    glm = MoeExperts(*[Fp8Weight(*quantize_fp8_blocks(torch.randn(2, *s, device=DEV), 16, 32), block=(16, 32))
                       for s in ((32, 64), (32, 64), (64, 32))])
    with pytest.raises(ValueError, match="must divide the FP8 scale block"):
        fused_moe(x, glm, w, ids, config=MoeConfig(1, 16, 48, 1, 1, gemv=True))


# ---- real shapes on a GPU: the new row kernels against the reference ------------------------

@pytest.mark.gpu
@pytest.mark.parametrize("t,cfg", [
    (1, MoeConfig(1, 8, 256, 1, 1, gemv=True, mx_words=True, prefetch=True)),
    (1, MoeConfig(1, 16, 512, 4, 1, gemv=True, mx_words=True)),
    (32, MoeConfig(4, 16, 256, 4, 1, gemv=True, mx_words=True, prefetch=True)),
    (1, MoeConfig(1, 8, 256, 1, 3, gemv=True, mx_words=True)),
    (1, MoeConfig(1, 16, 512, 4, 3, gemv=True, mx_half2=True)),
    (1, MoeConfig(1, 8, 256, 1, 3, gemv=True, mx_half2=True)),
    (8, MoeConfig(1, 8, 256, 1, 2, gemv=True, mx_half2=True)),
    (32, MoeConfig(1, 16, 256, 1, 2, gemv=True, mx_half2=True)),
    (4, MoeConfig(1, 8, 256, 1, 2, gemv=True, mx_half2=True, tail_k=256)),
    (1, MoeConfig(1, 8, 512, 1, 3, gemv=True, mx_half2=True, tma=True, tma_down=True, wide_x=True, tail_k=0)),
    (1, MoeConfig(1, 16, 512, 1, 3, gemv=True, mx_half2=True, tma=True, wide_x=True, down_tile=(8, 256, 1, 3))),
    (1, MoeConfig(1, 16, 256, 1, 3, gemv=True, mx_half2=True, wide_x=True, down_tile=(8, 256, 1, 3))),
    (32, MoeConfig(1, 16, 512, 1, 3, gemv=True, mx_half2=True, tma=True, tma_down=True, tail_k=0, wide_x=True)),
    (32, MoeConfig(2, 16, 512, 1, 3, gemv=True, mx_half2=True, tma=True, tma_down=True, tail_k=0, wide_x=True,
                   down_tile=(32, 512, 1, 3))),
    (8, MoeConfig(2, 8, 512, 1, 3, gemv=True, mx_half2=True, tma=True, tma_down=True, tail_k=0, wide_x=True,
                  down_tile=(16, 512, 1, 3))),
    (8, MoeConfig(1, 32, 512, 2, 3, gemv=True, mx_half2=True, tma=True, tma_down=True, tail_k=0, wide_x=True,
                  down_tile=(32, 512, 2, 3))),
    (48, MoeConfig(2, 32, 512, 2, 3, gemv=True, mx_half2=True, tma=True, tma_down=True, tail_k=0, wide_x=True,
                   down_tile=(32, 512, 2, 3))),
    (32, MoeConfig(2, 32, 512, 2, 3, gemv=True, mx_half2=True, tma=True, tma_down=True, tail_k=0, wide_x=True,
                   down_tile=(32, 512, 2, 3), down_max_registers=160)),
    (4, MoeConfig(1, 32, 512, 2, 3, gemv=True, mx_half2=True, tma=True, tma_down=True, tail_k=0, wide_x=True,
                  down_tile=(32, 512, 2, 3), max_registers=184, down_max_registers=160)),
])
def test_gpt_oss_row_kernels_gpu(t, cfg):
    e, k, h, i = 128, 4, 2880, 2880
    experts = random_gpt_oss_experts(e, i, h, bias_dtype=torch.bfloat16, device="cuda")
    if cfg.tma or cfg.tma_down:
        experts = with_aligned_scale_rows(experts)
    x = torch.randn(t, h, device="cuda", dtype=torch.bfloat16)
    w, ids = route_gpt_oss(torch.randn(t, e, device="cuda"), k)
    err = rel_err(fused_moe(x, experts, w, ids, config=cfg), fused_moe_ref(x, experts, w, ids))
    kind = ("tma" if cfg.tma or cfg.tma_down else "half2") if cfg.mx_half2 else "words"
    kind += ", two pairs a program" if cfg.block_m == 2 and cfg.mx_half2 else ""
    print(f"\ngpt-oss-120b {kind} T={t} {cfg}: rel err {err:.1e}")
    assert err < TOL[torch.bfloat16]


@pytest.mark.gpu
def test_half2_small_shapes_gpu():
    # the interpreter cases compiled: partial chunks, a -1 expert, rows far apart in magnitude,
    # and +-0 / +-0.5 codes only (e4m3 subnormals through the hardware conversion)
    e, k, h, i, t = 6, 2, 96, 160, 3
    for codes in (None, (0, 1, 8, 9)):
        experts = _gpt_oss_case(e, h, i, scale_lo=110, scale_hi=131, codes=codes)
        x = torch.randn(t, h, device=DEV, dtype=torch.bfloat16) * torch.tensor([[1e-3], [1.0], [300.0]], device=DEV)
        w, ids = route_gpt_oss(torch.randn(t, e, device=DEV), k)
        ids[2, 1] = -1
        out = fused_moe(x.to(torch.bfloat16), experts, w, ids, config=MoeConfig(1, 32, 64, 1, 1, gemv=True,
                                                                                 mx_half2=True))
        ref = fused_moe_ref(x.to(torch.bfloat16), experts, w, ids)
        for row in range(t):
            assert rel_err(out[row], ref[row]) < TOL[torch.bfloat16]


@pytest.mark.gpu
def test_two_pairs_per_program_small_shapes_gpu():
    # the interpreter cases compiled: both loops of moe_gemv_pairs.py, the last step on the
    # boxes' zero fill, a -1 expert; bit-identical to one pair per program on the GPU too
    test_gpt_oss_mxfp4_two_pairs_per_program(torch.bfloat16, 16, (32, 512, 1, 2), True)
    test_gpt_oss_mxfp4_two_pairs_per_program(torch.float16, 32, None, False)
    # two warps of 16 rows (the default from 4 tokens)
    test_gpt_oss_mxfp4_two_pairs_per_program(torch.bfloat16, 32, (32, 512, 2, 3), True, num_warps=2)


@pytest.mark.gpu
@pytest.mark.parametrize("fmt,t,cfg", [
    ("fp8_channel", 1, MoeConfig(1, 32, 256, 4, 3, gemv=True)),
    ("fp8_block", 1, MoeConfig(1, 32, 256, 4, 3, gemv=True)),
    ("fp8_block", 16, MoeConfig(1, 64, 256, 4, 3, gemv=True)),
    ("fp8_block", 32, MoeConfig(2, 16, 256, 4, 3, gemv=True)),
    ("fp8_block", 1, MoeConfig(1, 16, 256, 4, 1, gemv=True)),
    ("fp8_block", 1, MoeConfig(1, 16, 256, 2, 3, gemv=True, fused_combine=True, down_tile=(64, 256, 4, 3))),
    ("fp8_channel", 8, MoeConfig(1, 16, 256, 2, 3, gemv=True, fused_combine=True, down_tile=(32, 256, 4, 2))),
])
def test_glm_row_kernels_gpu(fmt, t, cfg):
    e, k, h, i = 128, 8, 4096, 1408
    experts = MoeExperts(*random_glm_weights(fmt, e, i, h, device="cuda"))
    for _ in range(3):  # token sums in the down kernel: each call must leave the arrival counts at zero
        x = torch.randn(t, h, device="cuda", dtype=torch.bfloat16)
        w, ids = route_glm(torch.randn(t, e, device="cuda"), torch.randn(e, device="cuda") * 0.1, k)
        err = rel_err(fused_moe(x, experts, w, ids, config=cfg), fused_moe_ref(x, experts, w, ids))
        print(f"\nGLM-4.5V {fmt} T={t} {cfg}: rel err {err:.1e}")
        assert err < TOL[torch.bfloat16]


@pytest.mark.parametrize("fmt,dtype,cfg", [
    ("fp8_block", torch.float32, MoeConfig(1, 16, 64, 1, 2, gemv=True, fused_combine=True)),
    ("fp8_channel", torch.float16, MoeConfig(1, 16, 32, 1, 2, gemv=True, down_tile=(32, 16, 1, 1))),
    ("dense", torch.float32, MoeConfig(1, 16, 32, 1, 2, gemv=True, fused_combine=True, down_tile=(8, 32, 1, 2))),
])
def test_glm_down_options(fmt, dtype, cfg):
    # the token sums written by the last of each token's down programs (no combine launch), and a
    # down tile of its own (H=80 in row blocks of 8 / 32, the last partial); a pair on expert -1
    # must still count its arrival; two calls: the counts are left at zero
    e, k, h, i, t = 4, 3, 80, 48, 3
    experts = MoeExperts(*random_glm_weights(fmt, e, i, h, dtype=dtype, block=(16, 32)))
    for _ in range(2):
        x = torch.randn(t, h, device=DEV, dtype=dtype)
        w, ids = random_routing(t, e, k)
        ids[2, 1] = -1
        out = fused_moe(x, experts, w, ids, config=cfg)
        assert out.dtype == dtype
        assert rel_err(out, fused_moe_ref(x, experts, w, ids)) < TOL[dtype]
    # register caps change occupancy, not sums
    assert torch.equal(out, fused_moe(x, experts, w, ids, config=replace(cfg, max_registers=128,
                                                                         down_max_registers=96)))


def test_down_options_need_one_pair_row_kernels():
    e, k, h, i, t = 2, 1, 64, 32, 1
    experts = MoeExperts(*random_glm_weights("fp8_channel", e, i, h, dtype=torch.float32))
    x = torch.randn(t, h, device=DEV)
    w, ids = random_routing(t, e, k)
    for cfg in (MoeConfig(16, 16, 32, 1, 1, fused_combine=True), MoeConfig(2, 16, 32, 1, 1, gemv=True,
                                                                           down_tile=(16, 32, 1, 1))):
        with pytest.raises(ValueError, match="fused_combine needs .* down_tile those"):
            fused_moe(x, experts, w, ids, config=cfg)


@pytest.mark.parametrize("fmt", ["fp8_channel", "fp8_block"])
@pytest.mark.parametrize("e,t", [(32, 1), (25, 1)])  # 1/16 and 2/25 pair per expert at top-2
def test_glm_gpu_defaults_on_small_shapes(fmt, e, t):
    # the configurations the GPU picks at decode sizes (fused token sums, a down tile of its own),
    # run by the interpreter on small experts: H=300 leaves a partial K step and row block
    from localchat.kernels.moe import FMT_FP8_BLK, FMT_FP8_ROW, default_config
    k, h, i = 2, 300, 64
    cfg = default_config(t * k, e, FMT_FP8_BLK if fmt == "fp8_block" else FMT_FP8_ROW, on_gpu=True)
    assert cfg.gemv and cfg.fused_combine and cfg.down_tile
    experts = MoeExperts(*random_glm_weights(fmt, e, i, h, dtype=torch.float32, block=(16, 32)))
    x = torch.randn(t, h, device=DEV)
    w, ids = random_routing(t, e, k)
    out = fused_moe(x, experts, w, ids, config=cfg)
    assert rel_err(out, fused_moe_ref(x, experts, w, ids)) < TOL[torch.float32]
