"""Loader round trips: every tiny checkpoint loads to exactly the weights transformers holds."""
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).parent))
from fixtures import FIXTURE_NAMES, load_oracle, open_fixture, oracle_weights  # noqa: E402

from localchat.engine.weights.formats import DenseWeight, Fp8Weight, Mxfp4Weight  # noqa: E402
from localchat.engine.weights.loader import check_checkpoint, load_weights, read_spec, weight_bytes  # noqa: E402
from localchat.engine.weights.safetensors_files import scan_checkpoint  # noqa: E402

_oracles = {}


def oracle(name):
    if name not in _oracles:
        _oracles[name] = oracle_weights(load_oracle(name))
    return _oracles[name]


def as_float(v):
    return v.float() if isinstance(v, torch.Tensor) else v.dequantize(torch.float32)


@pytest.mark.parametrize("name", FIXTURE_NAMES)
def test_round_trip_matches_transformers_exactly(name):
    path = open_fixture(name)
    weights = load_weights(path, read_spec(path))
    expected = oracle(name)
    assert sorted(weights) == sorted(expected)
    for key, ref in expected.items():
        got = as_float(weights[key])
        assert got.shape == ref.shape, key
        assert torch.equal(got, ref), f"{key}: max diff {(got - ref).abs().max()}"


@pytest.mark.parametrize("name, kind", [("glm-bf16", DenseWeight), ("glm-fp8-channel", Fp8Weight),
                                        ("glm-fp8-block", Fp8Weight), ("glm-fp8-tensor", Fp8Weight)])
def test_glm_layout_and_dtypes(name, kind):
    path = open_fixture(name)
    spec = read_spec(path)
    w = load_weights(path, spec, dtype=torch.float32)
    e, i, h = spec.moe.num_experts, spec.moe.intermediate_size, spec.hidden_size
    layer = "model.language_model.layers.1"
    for proj, shape in (("gate_proj", (e, i, h)), ("up_proj", (e, i, h)), ("down_proj", (e, h, i))):
        rec = w[f"{layer}.mlp.experts.{proj}.weight"]
        assert isinstance(rec, kind) and rec.shape == shape
        assert f"{layer}.mlp.experts.0.{proj}.weight" not in w
    q = w[f"{layer}.self_attn.q_proj.weight"]
    assert isinstance(q, kind) and isinstance(w[f"{layer}.self_attn.q_proj.bias"], torch.Tensor)
    assert w[f"{layer}.mlp.gate.e_score_correction_bias"].dtype == torch.float32
    assert isinstance(w[f"{layer}.mlp.gate.weight"], torch.Tensor)  # the router stays a plain tensor
    assert isinstance(w["lm_head.weight"], DenseWeight)  # never quantized
    assert isinstance(w["model.visual.blocks.0.attn.qkv.weight"], DenseWeight)
    assert isinstance(w["model.visual.patch_embed.proj.weight"], torch.Tensor)
    if kind is Fp8Weight:
        assert q.weight.dtype == torch.float8_e4m3fn and q.scale.dtype == torch.float32
        scale_shape = {"glm-fp8-channel": (e, i, 1), "glm-fp8-tensor": (e, 1, 1), "glm-fp8-block": (e, 1, 1)}[name]
        assert w[f"{layer}.mlp.experts.gate_proj.weight"].scale.shape == scale_shape
        dense = w["model.language_model.layers.0.mlp.down_proj.weight"]  # [64, 160]
        if name == "glm-fp8-block":
            assert dense.block == (128, 128) and dense.scale.shape == (1, 2)  # second block partial
        else:
            assert dense.block is None


def test_dtype_casts_dense_only():
    path = open_fixture("glm-fp8-channel")
    spec = read_spec(path)
    kept = load_weights(path, spec)
    cast = load_weights(path, spec, dtype=torch.float32)
    emb = "model.language_model.embed_tokens.weight"
    assert kept[emb].dtype == torch.bfloat16 and cast[emb].dtype == torch.float32
    assert kept["lm_head.weight"].weight.dtype == torch.bfloat16 and cast["lm_head.weight"].weight.dtype == torch.float32
    q = "model.language_model.layers.0.self_attn.q_proj.weight"
    assert kept[q].weight.dtype == cast[q].weight.dtype == torch.float8_e4m3fn
    assert cast[q].scale.dtype == torch.float32
    half = load_weights(path, spec, dtype=torch.bfloat16)
    assert half["model.language_model.layers.1.mlp.gate.e_score_correction_bias"].dtype == torch.float32
    assert half[q].scale.dtype == torch.float32


def test_gpt_oss_layouts():
    for name, kind in (("gpt-oss-mxfp4", Mxfp4Weight), ("gpt-oss-bf16", DenseWeight)):
        path = open_fixture(name)
        spec = read_spec(path)
        w = load_weights(path, spec, dtype=torch.bfloat16)
        e, i, h = spec.moe.num_experts, spec.moe.intermediate_size, spec.hidden_size
        x = "model.layers.0.mlp.experts"
        gu, down = w[f"{x}.gate_up_proj.weight"], w[f"{x}.down_proj.weight"]
        assert isinstance(gu, kind) and gu.shape == (e, 2 * i, h) and down.shape == (e, h, i)
        assert w[f"{x}.gate_up_proj.bias"].shape == (e, 2 * i) and w[f"{x}.down_proj.bias"].shape == (e, h)
        assert isinstance(w["model.layers.0.mlp.router.weight"], torch.Tensor)
        assert w["model.layers.0.self_attn.sinks"].shape == (spec.num_heads,)
        if kind is Mxfp4Weight:
            assert gu.blocks.dtype == torch.uint8 and gu.blocks.shape == (e, 2 * i, h // 32, 16)
        else:
            assert gu.weight.is_contiguous() and gu.weight.dtype == torch.bfloat16


def test_quantize_fp8_at_load_gives_the_channel_layout():
    # a bf16 checkpoint's decoder projections become e4m3 codes with a float32 scale per row, bit
    # for bit what an independent encoder makes of the same weights; the same modules as the FP8
    # checkpoint quantizes (lm_head, vision tower, router, embeddings and norms stay as they are)
    from fixtures.quantize import fp8_channel
    path = open_fixture("glm-bf16")
    spec = read_spec(path)
    plain = load_weights(path, spec)
    quantized = load_weights(path, spec, quantize="fp8")
    assert sorted(quantized) == sorted(plain)
    converted = {k for k, v in quantized.items() if isinstance(v, Fp8Weight)}
    fp8_path = open_fixture("glm-fp8-channel")
    assert converted == {k for k, v in load_weights(fp8_path, read_spec(fp8_path)).items() if isinstance(v, Fp8Weight)}
    assert "model.language_model.layers.1.mlp.experts.gate_proj.weight" in converted
    for key, rec in quantized.items():
        if key not in converted:
            got, ref = as_float(rec), as_float(plain[key])
            assert got.dtype == ref.dtype and torch.equal(got, ref), key
            continue
        assert rec.block is None and rec.weight.dtype == torch.float8_e4m3fn and rec.scale.dtype == torch.float32
        source = plain[key].weight
        for e in range(source.shape[0]) if source.dim() == 3 else [None]:
            w, q, scale = (source, rec.weight, rec.scale) if e is None else (source[e], rec.weight[e], rec.scale[e])
            q_ref, scale_ref, _ = fp8_channel(w, torch.float32)
            assert torch.equal(q.view(torch.uint8), q_ref.view(torch.uint8)) and torch.equal(scale, scale_ref), key
    assert weight_bytes(quantized) < 0.75 * weight_bytes(plain)


def test_quantize_fp8_needs_a_bf16_checkpoint():
    for name in ("glm-fp8-channel", "gpt-oss-mxfp4"):
        path = open_fixture(name)
        with pytest.raises(ValueError, match="already quantized"):
            load_weights(path, read_spec(path), quantize="fp8")
    path = open_fixture("glm-bf16")
    with pytest.raises(ValueError, match="only 'fp8'"):
        load_weights(path, read_spec(path), quantize="int4")


def test_progress_reports_every_byte_file_by_file():
    path = open_fixture("glm-fp8-block")
    spec = read_spec(path)
    calls = []
    load_weights(path, spec, on_progress=lambda done, total, f: calls.append((done, total, Path(f).name)))
    ckpt = scan_checkpoint(path)
    assert calls[-1][0] == calls[-1][1] == ckpt.total_bytes
    assert [c[0] for c in calls] == sorted(c[0] for c in calls)
    files = [c[2] for c in calls]
    assert files == sorted(files) and len(set(files)) == 3  # one shard after the other


def test_weight_bytes_and_header_only_check():
    bf16, fp8 = open_fixture("glm-bf16"), open_fixture("glm-fp8-channel")
    plan = check_checkpoint(bf16, read_spec(bf16))
    loaded = load_weights(bf16, read_spec(bf16))
    assert weight_bytes(loaded) == plan.total_bytes == scan_checkpoint(bf16).total_bytes
    quant = load_weights(fp8, read_spec(fp8))
    assert weight_bytes(quant) < weight_bytes(loaded)
    stored = scan_checkpoint(fp8).tensors
    bf16_scales = sum(t.nbytes for n, t in stored.items() if n.endswith("weight_scale"))
    assert bf16_scales and all(stored[n].dtype == "BF16" for n in stored if n.endswith("weight_scale"))
    assert weight_bytes(quant) == sum(t.nbytes for t in stored.values()) + bf16_scales  # scales become fp32


def _tensors(v):
    return [v] if isinstance(v, torch.Tensor) else [getattr(v, f) for f in v.__dataclass_fields__
                                                    if isinstance(getattr(v, f), torch.Tensor)]


@pytest.mark.gpu
@pytest.mark.parametrize("name,quantize", [(n, None) for n in FIXTURE_NAMES] + [("glm-bf16", "fp8")])
def test_loads_onto_cuda_unchanged(name, quantize):
    # FP8 made while loading: the same codes and scales on the GPU as on the CPU
    path = open_fixture(name)
    spec = read_spec(path)
    cpu = load_weights(path, spec, dtype=torch.bfloat16, quantize=quantize)
    gpu = load_weights(path, spec, dtype=torch.bfloat16, device="cuda", quantize=quantize)
    assert sorted(cpu) == sorted(gpu)
    for key in cpu:
        assert type(cpu[key]) is type(gpu[key])
        for a, b in zip(_tensors(cpu[key]), _tensors(gpu[key])):
            assert b.is_cuda and a.dtype == b.dtype and torch.equal(a.view(torch.uint8), b.cpu().view(torch.uint8))
