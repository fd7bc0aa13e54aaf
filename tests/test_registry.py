"""Registry: names, repo ids and local paths resolve; only root HF files are wanted; the sizes and KV
layouts stored for each model agree with tensor tables built from the real config.json files."""
from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

from localchat.engine.planner import KvLayout, TensorInfo, WeightBytes
from localchat.engine.registry import REGISTRY, UnknownModel, resolve
from localchat.engine.spec import ModelSpec
from localchat.engine.model_configs import CONFIG_DIR

CONFIGS = CONFIG_DIR
DTYPE_BYTES = {"BF16": 2, "F32": 4, "F8_E4M3": 1, "U8": 1}


def glm_table(spec, fp8=False):
    """(name, dtype, shape) of every GLM-4.5V tensor (models.md A.2). fp8: the compressed-tensors
    layout, a bf16 [rows, 1] `weight_scale` beside each decoder linear (the vision tower stays bf16)."""
    H, V = spec.hidden_size, spec.vocab_size
    q, kv = spec.num_heads * spec.head_dim, spec.num_kv_heads * spec.head_dim
    lin = "F8_E4M3" if fp8 else "BF16"
    t = [("lm_head.weight", "BF16", (V, H)), ("model.language_model.embed_tokens.weight", "BF16", (V, H)),
         ("model.language_model.norm.weight", "BF16", (H,))]

    def linear(name, out, inp, bias=False):
        t.append((name + ".weight", lin, (out, inp)))
        if fp8:
            t.append((name + ".weight_scale", "BF16", (out, 1)))
        if bias:
            t.append((name + ".bias", "BF16", (out,)))

    for i in range(spec.num_layers):
        p = f"model.language_model.layers.{i}."
        t += [(p + "input_layernorm.weight", "BF16", (H,)), (p + "post_attention_layernorm.weight", "BF16", (H,))]
        linear(p + "self_attn.q_proj", q, H, True)
        linear(p + "self_attn.k_proj", kv, H, True)
        linear(p + "self_attn.v_proj", kv, H, True)
        linear(p + "self_attn.o_proj", H, q)
        if not spec.is_moe_layer(i):
            inter = spec.dense_intermediate_size
            for n in ("gate_proj", "up_proj"):
                linear(p + f"mlp.{n}", inter, H)
            linear(p + "mlp.down_proj", H, inter)
            continue
        m = spec.moe
        t += [(p + "mlp.gate.weight", "BF16", (m.num_experts, H)),
              (p + "mlp.gate.e_score_correction_bias", "F32", (m.num_experts,))]
        experts = [f"experts.{e}" for e in range(m.num_experts)] + ["shared_experts"]
        for ex in experts:
            inter = m.intermediate_size * (m.num_shared_experts if ex == "shared_experts" else 1)
            for n in ("gate_proj", "up_proj"):
                linear(p + f"mlp.{ex}.{n}", inter, H)
            linear(p + f"mlp.{ex}.down_proj", H, inter)
    v = spec.vision
    vh, side, out, merge = v.hidden_size, v.image_size // v.patch_size, v.out_hidden_size, v.spatial_merge_size
    t += [("model.visual.patch_embed.proj.weight", "BF16",
           (vh, v.in_channels, v.temporal_patch_size, v.patch_size, v.patch_size)),
          ("model.visual.patch_embed.proj.bias", "BF16", (vh,)),
          ("model.visual.post_conv_layernorm.weight", "BF16", (vh,)),
          ("model.visual.embeddings.position_embedding.weight", "BF16", (side * side, vh))]
    for b in range(v.depth):
        p = f"model.visual.blocks.{b}."
        t += [(p + "norm1.weight", "BF16", (vh,)), (p + "norm2.weight", "BF16", (vh,)),
              (p + "attn.qkv.weight", "BF16", (3 * vh, vh)), (p + "attn.proj.weight", "BF16", (vh, vh)),
              (p + "mlp.gate_proj.weight", "BF16", (out, vh)), (p + "mlp.up_proj.weight", "BF16", (out, vh)),
              (p + "mlp.down_proj.weight", "BF16", (vh, out))]
    t += [("model.visual.post_layernorm.weight", "BF16", (vh,)),
          ("model.visual.downsample.weight", "BF16", (out, vh, merge, merge)),
          ("model.visual.downsample.bias", "BF16", (out,)), ("model.visual.merger.proj.weight", "BF16", (out, out)),
          ("model.visual.merger.post_projection_norm.weight", "BF16", (out,)),
          ("model.visual.merger.post_projection_norm.bias", "BF16", (out,)),
          ("model.visual.merger.gate_proj.weight", "BF16", (v.intermediate_size, out)),
          ("model.visual.merger.up_proj.weight", "BF16", (v.intermediate_size, out)),
          ("model.visual.merger.down_proj.weight", "BF16", (out, v.intermediate_size))]
    return t


def gpt_oss_table(spec):
    """(name, dtype, shape) of every gpt-oss HF-format tensor (models.md C.2): MXFP4 experts as
    uint8 blocks [E, rows, K/32, 16] and scales [E, rows, K/32], the rest bf16."""
    H, V, E, inter = spec.hidden_size, spec.vocab_size, spec.moe.num_experts, spec.moe.intermediate_size
    q, kv = spec.num_heads * spec.head_dim, spec.num_kv_heads * spec.head_dim
    t = [("lm_head.weight", "BF16", (V, H)), ("model.embed_tokens.weight", "BF16", (V, H)),
         ("model.norm.weight", "BF16", (H,))]
    for i in range(spec.num_layers):
        p = f"model.layers.{i}."
        t += [(p + "input_layernorm.weight", "BF16", (H,)), (p + "post_attention_layernorm.weight", "BF16", (H,))]
        for n, o, k in (("q_proj", q, H), ("k_proj", kv, H), ("v_proj", kv, H), ("o_proj", H, q)):
            t += [(p + f"self_attn.{n}.weight", "BF16", (o, k)), (p + f"self_attn.{n}.bias", "BF16", (o,))]
        t += [(p + "self_attn.sinks", "BF16", (spec.num_heads,)),
              (p + "mlp.router.weight", "BF16", (E, H)), (p + "mlp.router.bias", "BF16", (E,)),
              (p + "mlp.experts.gate_up_proj_blocks", "U8", (E, 2 * inter, H // 32, 16)),
              (p + "mlp.experts.gate_up_proj_scales", "U8", (E, 2 * inter, H // 32)),
              (p + "mlp.experts.gate_up_proj_bias", "BF16", (E, 2 * inter)),
              (p + "mlp.experts.down_proj_blocks", "U8", (E, H, inter // 32, 16)),
              (p + "mlp.experts.down_proj_scales", "U8", (E, H, inter // 32)),
              (p + "mlp.experts.down_proj_bias", "BF16", (E, H))]
    return t


def tensor_table(name: str):
    """(spec, [TensorInfo]) of the real checkpoint: names and shapes of models.md A.2 / C.2."""
    spec = ModelSpec.from_config(json.loads((CONFIGS / f"{name}.json").read_text()))
    rows = glm_table(spec, fp8=name.endswith("fp8")) if spec.family == "glm4v_moe" else gpt_oss_table(spec)
    return spec, [TensorInfo(n, d, tuple(s), math.prod(s) * DTYPE_BYTES[d]) for n, d, s in rows]


@pytest.mark.parametrize("name", sorted(REGISTRY))
def test_registry_sizes_and_kv_layout_match_the_real_configs(name):
    spec, table = tensor_table(name)
    entry = REGISTRY[name]
    assert entry.weights == WeightBytes.from_tensors(table)
    assert entry.kv == KvLayout.from_spec(spec)
    assert entry.download_bytes > entry.weight_bytes


def test_tensor_tables_match_the_published_checkpoints():
    # GLM-4.5V bf16: 18,106 tensors, 107,710,933,120 parameters, 200.63 GiB; gpt-oss-20b: 459 tensors, 12.82 GiB.
    _, glm = tensor_table("glm-4.5v")
    assert len(glm) == 18106 and sum(math.prod(t.shape) for t in glm) == 107_710_933_120
    assert round(sum(t.nbytes for t in glm) / 2**30, 2) == 200.63
    _, oss = tensor_table("gpt-oss-20b")
    assert len(oss) == 459 and round(sum(t.nbytes for t in oss) / 2**30, 2) == 12.82


def test_registry_entries():
    assert {e.repo_id for e in REGISTRY.values()} == {
        "zai-org/GLM-4.5V", "zai-org/GLM-4.5V-FP8", "openai/gpt-oss-20b", "openai/gpt-oss-120b"}
    assert {n: e.format for n, e in REGISTRY.items()} == {
        "glm-4.5v": "bf16", "glm-4.5v-fp8": "fp8", "gpt-oss-20b": "mxfp4", "gpt-oss-120b": "mxfp4"}
    assert REGISTRY["glm-4.5v"].alternative == "glm-4.5v-fp8"


def test_resolve_names_repo_ids_and_directories(tmp_path):
    src = resolve("GPT-OSS-20B")
    assert (src.kind, src.name, src.repo_id, src.revision) == ("registry", "gpt-oss-20b", "openai/gpt-oss-20b", None)
    by_repo = resolve("zai-org/GLM-4.5V-FP8")
    assert by_repo.entry is REGISTRY["glm-4.5v-fp8"] and by_repo.name == "glm-4.5v-fp8"
    other = resolve("someone/some-model@v1.0")
    assert (other.kind, other.repo_id, other.revision, other.entry) == ("hub", "someone/some-model", "v1.0", None)
    (tmp_path / "ckpt").mkdir()
    local = resolve(str(tmp_path / "ckpt"))
    assert local.kind == "local" and local.local_path == (tmp_path / "ckpt").resolve()


def test_resolve_refuses_unknown_names_with_a_suggestion(tmp_path):
    with pytest.raises(UnknownModel, match="did you mean gpt-oss-20b"):
        resolve("gpt-oss-20")
    with pytest.raises(UnknownModel, match="known models: glm-4.5v, glm-4.5v-fp8, gpt-oss-20b, gpt-oss-120b"):
        resolve("llama")
    with pytest.raises(UnknownModel, match="is not a directory"):
        resolve(str(tmp_path / "missing" / "dir"))
    (tmp_path / "file.txt").write_text("x")
    with pytest.raises(UnknownModel, match="is not a directory"):
        resolve(str(tmp_path / "file.txt"))


def test_only_root_hugging_face_files_are_wanted():
    src = resolve("gpt-oss-120b")
    repo_files = (
        [f"model-{i:05d}-of-00014.safetensors" for i in range(15)]
        + [f"original/model--{i:05d}-of-00007.safetensors" for i in range(1, 8)]
        + ["original/config.json", "original/dtypes.json", "metal/model.bin", "model.safetensors.index.json",
           "config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json",
           "special_tokens_map.json", "chat_template.jinja", "README.md", "LICENSE", "USAGE_POLICY", ".gitattributes"])
    wanted = {f for f in repo_files if src.wants(f)}
    assert wanted == {f"model-{i:05d}-of-00014.safetensors" for i in range(15)} | {
        "model.safetensors.index.json", "config.json", "generation_config.json", "tokenizer.json",
        "tokenizer_config.json", "special_tokens_map.json", "chat_template.jinja"}
    glm = resolve("glm-4.5v")
    assert glm.wants("preprocessor_config.json") and glm.wants("model-00046-of-00046.safetensors")
    assert not glm.wants("assets/demo.png")
