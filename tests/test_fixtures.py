"""The tiny checkpoints are what they claim: real on-disk layouts, both config dialects, working
tokenizers, templates and image processor, and a transformers oracle that agrees with them."""
import dataclasses
import json
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).parent))
from fixtures import FIXTURE_NAMES, load_oracle, open_fixture, oracle_weights, reference_dir  # noqa: E402
from fixtures.gpt_oss import build_gpt_oss_weights  # noqa: E402
from fixtures.tiny_tokenizer import HARMONY_SPECIAL  # noqa: E402

from localchat.engine.spec import ModelSpec  # noqa: E402
from localchat.engine.weights.safetensors_files import scan_checkpoint  # noqa: E402


def config(name):
    return json.loads((open_fixture(name) / "config.json").read_text())


def test_file_layouts():
    assert sorted(p.name for p in open_fixture("gpt-oss-mxfp4").glob("*.safetensors")) == [
        "model-00000-of-00002.safetensors", "model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors"]
    assert [p.name for p in open_fixture("gpt-oss-bf16").glob("*.safetensors")] == ["model.safetensors"]
    assert len(list(open_fixture("glm-bf16").glob("model-*-of-00005.safetensors"))) == 5
    # some expert stacks span two shards, as in the real 46-shard checkpoint
    glm = scan_checkpoint(open_fixture("glm-bf16")).tensors
    files = {glm[f"model.language_model.layers.1.mlp.experts.{e}.gate_proj.weight"].file for e in range(8)}
    assert len(files) == 2
    mx = scan_checkpoint(open_fixture("gpt-oss-mxfp4")).tensors
    assert mx["model.layers.0.mlp.experts.gate_up_proj_blocks"].dtype == "U8"
    assert mx["model.layers.0.mlp.experts.gate_up_proj_blocks"].shape == (4, 192, 2, 16)
    assert mx["model.layers.0.mlp.experts.gate_up_proj_bias"].dtype == "BF16"
    assert glm["model.language_model.layers.1.mlp.gate.e_score_correction_bias"].dtype == "F32"


def test_config_dialects_give_one_spec():
    hub, v5 = config("glm-bf16"), config("glm-fp8-block")
    assert "rope_theta" in hub["text_config"] and "torch_dtype" in hub and "rope_parameters" not in hub["text_config"]
    assert "rope_parameters" in v5["text_config"] and "dtype" in v5
    a, b = ModelSpec.from_dir(open_fixture("glm-bf16")), ModelSpec.from_dir(open_fixture("glm-fp8-block"))
    assert dataclasses.replace(b, quant=a.quant) == a
    assert a.rope.mrope_section == (2, 3, 3) and a.rope.rotary_dim == 16 and a.first_moe_layer == 1
    oss_hub, oss_v5 = ModelSpec.from_dir(open_fixture("gpt-oss-mxfp4")), ModelSpec.from_dir(open_fixture("gpt-oss-bf16"))
    assert "rope_scaling" in config("gpt-oss-mxfp4") and "rope_parameters" in config("gpt-oss-bf16")
    assert dataclasses.replace(oss_hub, quant=oss_v5.quant) == oss_v5
    assert oss_v5.sliding_window == 8 and oss_v5.layer_types == ("sliding", "full") and oss_v5.rope.kind == "yarn"


@pytest.mark.parametrize("name", ["glm-fp8-channel", "glm-fp8-block", "glm-fp8-tensor"])
def test_fp8_quantizes_exactly_the_non_exempt_linears(name):
    quant = ModelSpec.from_dir(open_fixture(name)).quant
    tensors = scan_checkpoint(open_fixture(name)).tensors
    fp8 = {n[: -len(".weight")] for n, t in tensors.items() if t.dtype == "F8_E4M3"}
    assert fp8 and not any(quant.is_exempt(m) for m in fp8)
    assert all(f"{m}.{quant.scale_suffix}" in tensors for m in fp8)
    for module in ("lm_head", "model.visual.blocks.0.attn.qkv", "model.visual.merger.gate_proj",
                   "model.language_model.layers.1.mlp.gate"):
        assert quant.is_exempt(module) and tensors[f"{module}.weight"].dtype == "BF16"
    assert "model.language_model.layers.1.mlp.experts.7.down_proj" in fp8
    assert "model.language_model.layers.2.mlp.shared_experts.up_proj" in fp8


def test_tokenizers_and_templates_match_config():
    from transformers import AutoTokenizer

    glm_dir = open_fixture("glm-bf16")
    tok = AutoTokenizer.from_pretrained(glm_dir)
    cfg, gen = config("glm-bf16"), json.loads((glm_dir / "generation_config.json").read_text())
    ids = tok.convert_tokens_to_ids
    assert ids("<|image|>") == cfg["image_token_id"] and ids("<|begin_of_image|>") == cfg["image_start_token_id"]
    assert gen["eos_token_id"] == [ids("<|endoftext|>"), ids("<|user|>"), ids("<|observation|>")]
    assert len(tok("the theory of the thing")["input_ids"]) < len("the theory of the thing") // 2  # merges work
    msgs = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "What is it?"}]}]
    text = tok.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True)
    assert text == "[gMASK]<sop><|user|>\n<|begin_of_image|><|image|><|end_of_image|>What is it?<|assistant|>\n"
    off = tok.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True, enable_thinking=False)
    assert off.endswith("What is it?/nothink<|assistant|>\n<think></think>\n")
    assert tok.decode([ids("<think>"), ids("<|user|>")], skip_special_tokens=True) == "<think>"

    oss_dir = open_fixture("gpt-oss-mxfp4")
    htok = AutoTokenizer.from_pretrained(oss_dir)
    gen = json.loads((oss_dir / "generation_config.json").read_text())
    hid = htok.convert_tokens_to_ids
    assert gen["eos_token_id"] == [hid("<|return|>"), hid("<|endoftext|>"), hid("<|call|>")]
    assert all(hid(t) < config("gpt-oss-mxfp4")["vocab_size"] for t in HARMONY_SPECIAL)
    text = htok.apply_chat_template([{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}],
                                    tokenize=False, add_generation_prompt=True, reasoning_effort="high")
    assert "Reasoning: high" in text and "<|start|>developer<|message|># Instructions\n\nBe brief.<|end|>" in text
    assert text.endswith("<|start|>user<|message|>Hi<|end|><|start|>assistant")


def test_image_processor_gives_a_few_tokens():
    from PIL import Image
    from transformers import AutoImageProcessor

    proc = AutoImageProcessor.from_pretrained(open_fixture("glm-bf16"))
    out = proc(images=[Image.new("RGB", (64, 48), (200, 30, 30))], return_tensors="pt")
    assert out["image_grid_thw"].tolist() == [[1, 4, 4]] and out["pixel_values"].shape == (16, 1176)


def test_transformers_mxfp4_loader_agrees_with_reference():
    from transformers import AutoModelForCausalLM, Mxfp4Config

    quant = AutoModelForCausalLM.from_pretrained(open_fixture("gpt-oss-mxfp4"), dtype=torch.float32,
                                                 quantization_config=Mxfp4Config(dequantize=True))
    a, b = oracle_weights(quant), oracle_weights(load_oracle("gpt-oss-mxfp4"))
    assert sorted(a) == sorted(b) and all(torch.equal(a[k], b[k]) for k in a)
    assert reference_dir("gpt-oss-mxfp4") == open_fixture("gpt-oss-bf16")


def test_builders_are_deterministic():
    ids = {t: 300 + i for i, t in enumerate(HARMONY_SPECIAL)}
    _, a, pa = build_gpt_oss_weights(ids)
    _, b, pb = build_gpt_oss_weights(ids)
    assert all(torch.equal(a[k], b[k]) for k in a) and all(torch.equal(pa[k], pb[k]) for k in pa)


def test_oracles_are_not_flat_and_the_router_bias_matters():
    model = load_oracle("glm-bf16")
    ids = torch.tensor([[5, 40, 77, 120, 200, 250, 33, 90]])
    with torch.no_grad():
        logits = model(input_ids=ids).logits[0]
    assert logits.std(dim=-1).min() > 0.5
    gate = model.model.language_model.layers[1].mlp.gate
    h = torch.randn(64, 64, generator=torch.Generator().manual_seed(0))
    scores = torch.sigmoid(h @ gate.weight.T)
    plain = scores.topk(2).indices.sort().values
    biased = (scores + gate.e_score_correction_bias).topk(2).indices.sort().values
    assert (plain != biased).any()
    oss = load_oracle("gpt-oss-bf16")
    with torch.no_grad():
        assert oss(input_ids=ids).logits[0].std(dim=-1).min() > 0.5


def test_every_fixture_has_a_loadable_reference():
    for name in FIXTURE_NAMES:
        assert (reference_dir(name) / "config.json").is_file()
        assert "quantization_config" not in json.loads((reference_dir(name) / "config.json").read_text())
