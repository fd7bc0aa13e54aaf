import json

import pytest

from localchat.engine.spec import ModelSpec, SamplingDefaults, UnsupportedModel
from localchat.engine.weights.quant_config import UnsupportedQuantization, parse_quant_config
from localchat.engine.model_configs import CONFIG_DIR

CONFIGS = CONFIG_DIR


def load(name):
    return json.loads((CONFIGS / name).read_text())


def test_glm45v_hub_dialect():
    spec = ModelSpec.from_config(load("glm-4.5v.json"))
    assert spec.family == "glm4v_moe"
    assert (spec.num_layers, spec.num_heads, spec.num_kv_heads, spec.head_dim) == (46, 96, 8, 128)
    assert spec.rope.rotary_dim == 64 and spec.rope.mrope_section == (8, 12, 12) and spec.rope.theta == 10000.0
    assert spec.moe.num_experts == 128 and spec.moe.top_k == 8 and spec.moe.router == "sigmoid_bias"
    assert spec.first_moe_layer == 1 and spec.dense_intermediate_size == 10944
    assert spec.eos_token_ids == (151329, 151336, 151338)
    assert spec.vision.depth == 24 and spec.vision.head_dim == 128 and spec.vision.intermediate_size == 10944
    assert spec.image_tokens.image == 151363
    assert spec.quant.method is None and not spec.o_bias and spec.qkv_bias


def test_glm_transformers5_dialect_equals_hub_dialect():
    hub = load("glm-4.5v.json")
    v5 = json.loads(json.dumps(hub))
    text = v5["text_config"]
    text["rope_parameters"] = {"rope_type": "default", "rope_theta": text.pop("rope_theta"),
                               "mrope_section": text.pop("rope_scaling")["mrope_section"],
                               "partial_rotary_factor": text.pop("partial_rotary_factor")}
    assert ModelSpec.from_config(v5) == ModelSpec.from_config(hub)


def test_gpt_oss_both_dialects():
    hub = load("gpt-oss-20b.json")
    spec = ModelSpec.from_config(hub, {"eos_token_id": [200002, 199999, 200012]})
    assert spec.rope.kind == "yarn" and spec.rope.factor == 32.0 and spec.rope.truncate is False
    assert spec.rope.rotary_dim == 64 and spec.rope.theta == 150000
    assert spec.layer_types[:2] == ("sliding", "full") and spec.sliding_window == 128
    assert spec.moe.num_experts == 32 and spec.moe.top_k == 4 and spec.moe.activation == "swiglu_clamped"
    assert spec.eos_token_ids == (200002, 199999, 200012)
    assert spec.quant.method == "mxfp4" and spec.quant.is_exempt("model.layers.3.self_attn.q_proj")
    assert not spec.quant.is_exempt("model.layers.3.mlp.experts")
    v5 = dict(hub)
    v5["rope_parameters"] = dict(v5.pop("rope_scaling"), rope_theta=v5.pop("rope_theta"))
    assert ModelSpec.from_config(v5) == ModelSpec.from_config(hub)
    assert ModelSpec.from_config(load("gpt-oss-120b.json")).num_layers == 36


def test_sampling_defaults_from_generation_config_else_the_family():
    glm = ModelSpec.from_config(load("glm-4.5v.json"), {"do_sample": True, "temperature": 0.8, "top_p": 0.6,
                                                         "top_k": 2})
    assert glm.sampling == SamplingDefaults(temperature=0.8, top_p=0.6, top_k=2)
    assert ModelSpec.from_config(load("glm-4.5v.json")).sampling == SamplingDefaults()
    # gpt-oss's file sets do_sample only: OpenAI's recommendation fills in
    oss = ModelSpec.from_config(load("gpt-oss-20b.json"), {"do_sample": True, "eos_token_id": 200002})
    assert oss.sampling == SamplingDefaults(temperature=1.0, top_p=1.0, top_k=None)
    assert ModelSpec.from_config(load("gpt-oss-20b.json"), {"temperature": 0.5}).sampling.temperature == 0.5
    greedy = ModelSpec.from_config(load("gpt-oss-20b.json"), {"do_sample": False, "temperature": 0.5})
    assert greedy.sampling.temperature == 0.0


def test_unknown_architecture_lists_supported():
    with pytest.raises(UnsupportedModel) as e:
        ModelSpec.from_config({"model_type": "llama"})
    assert "llama" in str(e.value) and "glm4v_moe" in str(e.value) and "gpt_oss" in str(e.value)


def test_quant_configs():
    fp8 = ModelSpec.from_config(load("glm-4.5v-fp8.json")).quant
    assert (fp8.method, fp8.fp8_strategy, fp8.scale_suffix) == ("fp8", "channel", "weight_scale")
    assert fp8.is_exempt("model.visual.blocks.0.attn.qkv") and fp8.is_exempt("lm_head")
    assert fp8.is_exempt("model.language_model.layers.3.mlp.gate")
    assert not fp8.is_exempt("model.language_model.layers.3.mlp.gate_proj")
    block = parse_quant_config({"quant_method": "fp8", "weight_block_size": [128, 128], "activation_scheme": "dynamic"})
    assert block.block_size == (128, 128) and block.scale_suffix == "weight_scale_inv"
    with pytest.raises(UnsupportedQuantization, match="awq"):
        parse_quant_config({"quant_method": "awq"})
