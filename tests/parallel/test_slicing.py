"""Tensor-parallel shard plans: the ranks' pieces tile each tensor exactly, quantized pieces
dequantize to pieces of the dequantized weight, per-rank sizes at the real model shapes, and
clear errors for splits the model does not allow."""
import sys
from functools import lru_cache
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).parents[1]))
from fixtures import open_fixture  # noqa: E402

from localchat.engine.model_configs import model_config  # noqa: E402
from localchat.engine.parallel.slicing import (  # noqa: E402
    REPLICATED, ShardingError, Slice, logical_shapes, shard_plan, slice_value, slice_weights)
from localchat.engine.spec import ModelSpec  # noqa: E402
from localchat.engine.weights.formats import DenseWeight, Fp8Weight  # noqa: E402
from localchat.engine.weights.loader import load_weights, load_weights_slice, read_spec, weight_bytes  # noqa: E402

# (fixture, tp, ep) combinations the tiny models allow: GLM 4 q / 2 kv heads, gpt-oss I = 96 (3
# MXFP4 groups, so tp 4 would leave a rank empty) and 4 experts.
TINY_CASES = [("glm-bf16", 2, False), ("glm-bf16", 4, False), ("glm-bf16", 4, True),
              ("glm-fp8-channel", 2, False), ("glm-fp8-channel", 4, True),
              ("gpt-oss-mxfp4", 2, False), ("gpt-oss-mxfp4", 4, True), ("gpt-oss-mxfp4", 2, True),
              ("gpt-oss-bf16", 2, False), ("gpt-oss-bf16", 4, True)]


@lru_cache(maxsize=None)
def _loaded(name):
    path = open_fixture(name)
    spec = read_spec(path)
    return spec, load_weights(path, spec, dtype=torch.float32)


def _values(v) -> list[torch.Tensor]:
    """What must survive slicing: the dequantized weight, and the raw payload bytes when they
    are in the weight's logical layout."""
    if isinstance(v, torch.Tensor):
        return [v]
    if isinstance(v, Fp8Weight):
        return [v.dequantize(), v.weight.view(torch.uint8)]
    return [v.dequantize()]


def _check_tiles(name, full, pieces: list[tuple[Slice, object]]):
    """Every rank's piece equals the full tensor at its range, and the ranges cover it."""
    fulls = _values(full)
    covered = None
    for rank, (s, piece) in enumerate(pieces):
        got = _values(piece)
        assert type(piece) is type(full), name
        for f, g in zip(fulls, got):
            if s.zeros:
                assert rank != 0 and torch.count_nonzero(g) == 0 and g.shape == f.shape, name
            elif s.dim is None:
                assert torch.equal(g, f), name
            else:
                assert torch.equal(g, f.narrow(s.dim, s.start, s.end - s.start)), (name, rank, s)
        if s.dim is not None:
            n = fulls[0].shape[s.dim]
            covered = torch.zeros(n, dtype=torch.bool) if covered is None else covered
            covered[s.start:s.end] = True
    if covered is not None:
        assert bool(covered.all()), f"{name}: the ranks' ranges leave part of the tensor out"
    if any(s.zeros for s, _ in pieces):  # a bias added once: whole on rank 0
        assert pieces[0][0] == REPLICATED, name


@pytest.mark.parametrize("name,tp,ep", TINY_CASES)
def test_ranks_tile_every_tiny_tensor_exactly(name, tp, ep):
    spec, weights = _loaded(name)
    plans = [shard_plan(spec, tp, r, ep=ep) for r in range(tp)]
    shards = [slice_weights(weights, p) for p in plans]
    split = 0
    for key, full in weights.items():
        pieces = [(plans[r][key], shards[r][key]) for r in range(tp)]
        for r in range(tp):
            assert _values(shards[r][key])[0].shape == plans[r][key].shape_of(_values(full)[0].shape), key
        _check_tiles(key, full, pieces)
        split += plans[0][key].dim is not None
    assert split > 10  # the plan really splits most linears


def test_tp1_is_the_whole_store():
    spec, weights = _loaded("gpt-oss-mxfp4")
    shard = slice_weights(weights, shard_plan(spec, 1, 0))
    for key, full in weights.items():
        assert all(torch.equal(a, b) for a, b in zip(_values(shard[key]), _values(full))), key


def test_tiny_plans_name_exactly_what_attention_and_experts_need():
    spec, weights = _loaded("gpt-oss-mxfp4")
    p = shard_plan(spec, 2, 1)
    x = "model.layers.0"
    assert p[f"{x}.self_attn.q_proj.weight"] == Slice(0, 32, 64)  # heads 2..3, head_dim 16
    assert p[f"{x}.self_attn.k_proj.weight"] == Slice(0, 16, 32)
    assert p[f"{x}.self_attn.o_proj.weight"] == Slice(1, 32, 64)
    assert p[f"{x}.self_attn.o_proj.bias"].zeros and p[f"{x}.mlp.experts.down_proj.bias"].zeros
    assert shard_plan(spec, 2, 0)[f"{x}.mlp.experts.down_proj.bias"] == REPLICATED
    assert p[f"{x}.self_attn.sinks"] == Slice(0, 2, 4)
    assert p[f"{x}.mlp.router.weight"] == REPLICATED
    # I = 96 -> cdiv(3, 2) * 32 = 64 on rank 0, the last 32 on rank 1; gate_up rows doubled.
    assert p[f"{x}.mlp.experts.gate_up_proj.weight"] == Slice(1, 128, 192)
    assert p[f"{x}.mlp.experts.down_proj.weight"] == Slice(2, 64, 96)
    d = slice_weights(weights, p)[f"{x}.mlp.experts.down_proj.weight"]
    assert d.blocks.shape == (4, 64, 1, 16) and d.scales.shape == (4, 64, 1)


def test_tp_beyond_kv_heads_replicates_kv_groups():
    spec, weights = _loaded("glm-bf16")
    key = "model.language_model.layers.0.self_attn.k_proj.weight"
    rows = [shard_plan(spec, 4, r)[key] for r in range(4)]
    assert [(s.start, s.end) for s in rows] == [(0, 32), (0, 32), (32, 64), (32, 64)]


def _spec(name, **quant):
    cfg = model_config(name)
    if quant:
        cfg["quantization_config"] = quant
    return ModelSpec.from_config(cfg)


def _plan_shapes(spec, tp, rank, ep=False):
    plan, full = shard_plan(spec, tp, rank, ep), logical_shapes(spec)
    return {k: plan[k].shape_of(full[k]) for k in plan}


def test_gpt_oss_120b_tp4_intermediate_is_736_with_a_last_rank_of_672():
    spec = _spec("gpt-oss-120b")
    x = "model.layers.5.mlp.experts"
    for rank, inner in ((0, 736), (1, 736), (2, 736), (3, 672)):
        s = _plan_shapes(spec, 4, rank)
        assert s[f"{x}.gate_up_proj.weight"] == (128, 2 * inner, 2880)
        assert s[f"{x}.gate_up_proj.bias"] == (128, 2 * inner)
        assert s[f"{x}.down_proj.weight"] == (128, 2880, inner)
        assert s["model.layers.5.self_attn.q_proj.weight"] == (16 * 64, 2880)
        assert s["model.layers.5.self_attn.sinks"] == (16,)
        assert s["lm_head.weight"] == (201088 // 4, 2880)
    ep = _plan_shapes(spec, 4, 3, ep=True)
    assert ep[f"{x}.gate_up_proj.weight"] == (32, 5760, 2880) and ep[f"{x}.down_proj.bias"] == (32, 2880)
    assert not shard_plan(spec, 4, 3, ep=True)[f"{x}.down_proj.bias"].zeros


def test_glm_tp8_holds_12_q_heads_and_1_kv_head():
    spec = _spec("glm-4.5v")
    s = _plan_shapes(spec, 8, 7)
    a = "model.language_model.layers.3.self_attn"
    assert s[f"{a}.q_proj.weight"] == (12 * 128, 4096) and s[f"{a}.q_proj.bias"] == (12 * 128,)
    assert s[f"{a}.k_proj.weight"] == (128, 4096) and s[f"{a}.v_proj.bias"] == (128,)
    assert s[f"{a}.o_proj.weight"] == (4096, 12 * 128)
    m = "model.language_model.layers.3.mlp"
    assert s[f"{m}.experts.gate_proj.weight"] == (128, 176, 4096)
    assert s[f"{m}.experts.down_proj.weight"] == (128, 4096, 176)
    assert s[f"{m}.shared_experts.down_proj.weight"] == (4096, 176)
    assert s["model.language_model.layers.0.mlp.up_proj.weight"] == (10944 // 8, 4096)
    assert s["model.visual.blocks.0.attn.qkv.weight"] == logical_shapes(spec)["model.visual.blocks.0.attn.qkv.weight"]


@pytest.mark.parametrize("name", ["glm-4.5v", "glm-4.5v-fp8", "gpt-oss-20b", "gpt-oss-120b"])
@pytest.mark.parametrize("tp", [1, 2, 4, 8])
@pytest.mark.parametrize("ep", [False, True])
def test_real_config_ranges_tile_each_dim(name, tp, ep):
    spec = _spec(name)
    full = logical_shapes(spec)
    plans = [shard_plan(spec, tp, r, ep) for r in range(tp)]
    for key, shape in full.items():
        slices = [p[key] for p in plans]
        if slices[0].dim is None:
            assert all(s == slices[0] or (s.zeros and r) for r, s in enumerate(slices)), key
            continue
        dim = slices[0].dim
        distinct = sorted({(s.start, s.end) for s in slices})
        assert all(s.dim == dim for s in slices), key
        # contiguous, non-overlapping, covering [0, n)
        assert distinct[0][0] == 0 and distinct[-1][1] == shape[dim], key
        assert all(a[1] == b[0] for a, b in zip(distinct, distinct[1:])), key


def test_impossible_head_split_is_refused():
    spec = _spec("glm-4.5v")  # 96 q heads, 8 kv heads: 12 splits q but neither divides the other for kv
    with pytest.raises(ShardingError, match="num_key_value_heads = 8 and tensor-parallel size 12"):
        shard_plan(spec, 12, 0)
    assert shard_plan(_spec("gpt-oss-20b"), 16, 5)["model.layers.0.self_attn.k_proj.weight"] == Slice(0, 128, 192)
    glm, _ = _loaded("glm-bf16")  # 4 q heads
    with pytest.raises(ShardingError, match="num_attention_heads = 4"):
        shard_plan(glm, 8, 0)


def test_empty_rank_and_uneven_experts_are_refused():
    spec, _ = _loaded("gpt-oss-mxfp4")  # I = 96: three 32-value groups
    with pytest.raises(ShardingError, match="rank 3 of 4 empty"):
        shard_plan(spec, 4, 3)
    cfg = model_config("gpt-oss-20b")
    cfg["num_local_experts"] = 30
    with pytest.raises(ShardingError, match="number of experts = 30"):
        shard_plan(ModelSpec.from_config(cfg), 4, 0, ep=True)


BLOCK_FP8 = {"quant_method": "fp8", "weight_block_size": [128, 128], "modules_to_not_convert": ["lm_head"]}


def test_block_fp8_off_the_block_grid_names_the_tensor():
    spec = _spec("glm-4.5v", **BLOCK_FP8)
    shard_plan(spec, 1, 0)
    with pytest.raises(ShardingError, match=r"layers\.0\.mlp\.gate_proj\.weight.*128-wide"):
        shard_plan(spec, 4, 1)  # 10944 / 4 = 2736 rows, 21.375 blocks
    tiny, weights = _loaded("glm-fp8-block")  # every tiny dim is under one 128 block
    with pytest.raises(ShardingError, match="FP8 scale blocks"):
        shard_plan(tiny, 2, 0)


def _random_block_fp8(n, k, block=(128, 128), lead=()):
    g = torch.Generator().manual_seed(0)
    w = (torch.randn(*lead, n, k, generator=g) * 4).to(torch.float8_e4m3fn)
    s = torch.rand(*lead, -(-n // block[0]), -(-k // block[1]), generator=g) + 0.5
    return Fp8Weight(w, s, block)


@pytest.mark.parametrize("lead,s", [((), Slice(0, 128, 256)), ((), Slice(0, 256, 320)),  # partial edge block
                                    ((), Slice(1, 128, 200)), ((2,), Slice(2, 0, 128)), ((2,), Slice(1, 128, 320)),
                                    ((3,), Slice(0, 1, 2))])
def test_block_fp8_pieces_dequantize_to_pieces_of_the_weight(lead, s):
    w = _random_block_fp8(320, 200, lead=lead)
    piece = slice_value("w", w, s)
    assert piece.block == w.block
    assert torch.equal(piece.dequantize(), w.dequantize().narrow(s.dim, s.start, s.end - s.start))


@pytest.mark.parametrize("s", [Slice(0, 64, 128), Slice(1, 0, 100)])
def test_block_fp8_piece_off_the_grid_is_refused(s):
    with pytest.raises(ShardingError, match="w: .*128-wide FP8 scale blocks"):
        slice_value("w", _random_block_fp8(320, 200), s)


def test_mxfp4_columns_must_fall_on_32_value_groups():
    spec, weights = _loaded("gpt-oss-mxfp4")
    w = weights["model.layers.0.mlp.experts.down_proj.weight"]
    with pytest.raises(ShardingError, match="32-value MXFP4 groups"):
        slice_value("down", w, Slice(2, 16, 48))
    assert isinstance(slice_value("dense", DenseWeight(torch.ones(4, 6)), Slice(1, 2, 4)), DenseWeight)


@pytest.mark.parametrize("name,tp,ep", TINY_CASES + [("glm-fp8-tensor", 2, False), ("glm-fp8-block", 1, False)])
def test_reading_only_a_ranks_ranges_equals_slicing_the_full_load(name, tp, ep):
    spec, weights = _loaded(name)
    for rank in range(tp):
        plan = shard_plan(spec, tp, rank, ep)
        want = slice_weights(weights, plan)
        got = load_weights_slice(open_fixture(name), spec, plan, dtype=torch.float32)
        assert got.keys() == want.keys()
        for key in want:
            assert type(got[key]) is type(want[key]), key
            assert all(torch.equal(a, b) for a, b in zip(_values(got[key]), _values(want[key]))), (key, rank)


@pytest.mark.parametrize("ep", [False, True])
def test_a_rank_reads_only_its_bytes(ep):
    name, tp = "gpt-oss-mxfp4", 2
    spec, _ = _loaded(name)
    reads = []
    for rank in range(tp):
        plan = shard_plan(spec, tp, rank, ep)
        seen = []
        shard = load_weights_slice(open_fixture(name), spec, plan, on_progress=lambda d, t, f: seen.append((d, t)))
        zeroed = sum(shard[k].numel() * shard[k].element_size() for k in shard if plan[k].zeros)
        done, total = seen[-1]
        assert done == weight_bytes(shard) - zeroed  # file dtypes kept: bytes held = bytes read
        reads.append(done)
    # Experts dominate: each rank reads well under the whole file, the two together a bit over it
    # (replicated norms and routers are the only overlap).
    assert all(r < 0.7 * total for r in reads) and total <= sum(reads) < 1.2 * total
