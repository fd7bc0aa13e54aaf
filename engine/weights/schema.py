"""What a checkpoint of each family must contain, derived from its ModelSpec.

Each entry says how one output of the loader is made from checkpoint tensors (names as stored on
disk: GLM-4.5V reference notes A.2, gpt-oss C.2), with the shape config.json implies. The loader
checks every header against these before it reads any data.

Output naming (what the model code consumes):
* a linear layer -> "<module>.weight" holding a LinearWeight record; its bias -> "<module>.bias";
* GLM routed experts, stored one tensor per expert, -> "...mlp.experts.{gate,up,down}_proj.weight"
  stacked to [E, N, K];
* gpt-oss experts -> "...mlp.experts.gate_up_proj.weight" [E, 2I, H] (gate/up rows interleaved,
  as stored) and "...mlp.experts.down_proj.weight" [E, H, I], biases "....bias" [E, 2I] / [E, H];
* everything else -> a plain tensor under its checkpoint name.
"""
from __future__ import annotations

import re
from dataclasses import dataclass

from ..spec import ModelSpec
from .formats import MXFP4_BLOCK

FLOAT_DTYPES = frozenset({"BF16", "F16", "F32"})
FP8_DTYPE = "F8_E4M3"


@dataclass(frozen=True)
class PlainTensor:
    """A tensor loaded as it is (cast to the load dtype unless keep_fp32)."""

    out: str
    source: str
    shape: tuple[int, ...]
    keep_fp32: bool = False
    optional: bool = False


@dataclass(frozen=True)
class LinearModule:
    """One linear weight [N, K] = shape, read from "<source>.weight" (+ its FP8 scale). With
    `stacked`, `sources` holds one module per expert and the output is [E, N, K]."""

    out: str
    sources: tuple[str, ...]
    shape: tuple[int, int]
    stacked: bool = False
    optional: bool = False


@dataclass(frozen=True)
class Mxfp4Experts:
    """gpt-oss expert weights "<source>_blocks" [E, N, K/32, 16] and "<source>_scales" [E, N, K/32]
    (both uint8); shape = (E, N, K)."""

    out: str
    source: str
    shape: tuple[int, int, int]


@dataclass(frozen=True)
class TransposedExperts:
    """gpt-oss bf16 experts as transformers saves them, [E, K, N] (x @ W); loaded as [E, N, K]."""

    out: str
    source: str
    shape: tuple[int, int, int]

    @property
    def stored_shape(self) -> tuple[int, int, int]:
        e, n, k = self.shape
        return (e, k, n)


Entry = PlainTensor | LinearModule | Mxfp4Experts | TransposedExperts

# Buffers some exporters write although they are recomputed from config (rotary tables).
_HARMLESS = re.compile(r".*\.rotary(_pos)?_emb\.(original_)?inv_freq$")
_LAYER = re.compile(r"^model\.(?:language_model\.)?layers\.(\d+)\.")


def expected_entries(spec: ModelSpec) -> list[Entry]:
    if spec.family == "glm4v_moe":
        return _glm_text(spec) + _glm_vision(spec)
    if spec.family == "gpt_oss":
        return _gpt_oss(spec)
    raise ValueError(f"no tensor schema for family {spec.family!r}")


def is_harmless_extra(name: str, spec: ModelSpec) -> bool:
    """Tensors a checkpoint may carry that the engine does not use: rotary buffers, and
    multi-token-prediction layers past num_layers (GLM-4.5-Air style NextN blocks)."""
    if _HARMLESS.match(name):
        return True
    m = _LAYER.match(name)
    return m is not None and int(m.group(1)) >= spec.num_layers


def _plain(name: str, shape, **kw) -> PlainTensor:
    return PlainTensor(name, name, tuple(shape), **kw)


def _linear(module: str, n: int, k: int, optional: bool = False) -> LinearModule:
    return LinearModule(f"{module}.weight", (module,), (n, k), optional=optional)


def _attention(spec: ModelSpec, p: str) -> list[Entry]:
    h, q, kv = spec.hidden_size, spec.num_heads * spec.head_dim, spec.num_kv_heads * spec.head_dim
    out: list[Entry] = []
    for name, n, k, bias in (("q_proj", q, h, spec.qkv_bias), ("k_proj", kv, h, spec.qkv_bias),
                             ("v_proj", kv, h, spec.qkv_bias), ("o_proj", h, q, spec.o_bias)):
        out.append(_linear(f"{p}.self_attn.{name}", n, k))
        if bias:
            out.append(_plain(f"{p}.self_attn.{name}.bias", (n,)))
    return out


def _glu_mlp(p: str, hidden: int, inner: int) -> list[Entry]:
    return [_linear(f"{p}.gate_proj", inner, hidden), _linear(f"{p}.up_proj", inner, hidden),
            _linear(f"{p}.down_proj", hidden, inner)]


def _decoder_common(spec: ModelSpec, root: str) -> list[Entry]:
    h, v = spec.hidden_size, spec.vocab_size
    return [_plain(f"{root}.embed_tokens.weight", (v, h)), _plain(f"{root}.norm.weight", (h,)),
            _linear("lm_head", v, h, optional=spec.tie_word_embeddings)]


def _glm_text(spec: ModelSpec) -> list[Entry]:
    root, h, moe = "model.language_model", spec.hidden_size, spec.moe
    out = _decoder_common(spec, root)
    for i in range(spec.num_layers):
        p = f"{root}.layers.{i}"
        out += [_plain(f"{p}.input_layernorm.weight", (h,)), _plain(f"{p}.post_attention_layernorm.weight", (h,))]
        out += _attention(spec, p)
        if not spec.is_moe_layer(i):
            out += _glu_mlp(f"{p}.mlp", h, spec.dense_intermediate_size)
            continue
        e, inner = moe.num_experts, moe.intermediate_size
        out += [_plain(f"{p}.mlp.gate.weight", (e, h)),
                _plain(f"{p}.mlp.gate.e_score_correction_bias", (e,), keep_fp32=True)]
        for proj, shape in (("gate_proj", (inner, h)), ("up_proj", (inner, h)), ("down_proj", (h, inner))):
            out.append(LinearModule(f"{p}.mlp.experts.{proj}.weight",
                                    tuple(f"{p}.mlp.experts.{j}.{proj}" for j in range(e)), shape, stacked=True))
        if moe.num_shared_experts:
            out += _glu_mlp(f"{p}.mlp.shared_experts", h, inner * moe.num_shared_experts)
    return out


def _glm_vision(spec: ModelSpec) -> list[Entry]:
    v, p = spec.vision, "model.visual"
    vh, out_h, m = v.hidden_size, v.out_hidden_size, v.spatial_merge_size
    side = v.image_size // v.patch_size
    out: list[Entry] = [
        _plain(f"{p}.patch_embed.proj.weight", (vh, v.in_channels, v.temporal_patch_size, v.patch_size, v.patch_size)),
        _plain(f"{p}.patch_embed.proj.bias", (vh,)),
        _plain(f"{p}.post_conv_layernorm.weight", (vh,)),
        _plain(f"{p}.embeddings.position_embedding.weight", (side * side, vh)),
    ]
    for j in range(v.depth):
        b = f"{p}.blocks.{j}"
        out += [_plain(f"{b}.norm1.weight", (vh,)), _plain(f"{b}.norm2.weight", (vh,)),
                _linear(f"{b}.attn.qkv", 3 * vh, vh),
                # GLM-4.5V has no qkv bias (attention_bias false); accepted if a checkpoint has one.
                _plain(f"{b}.attn.qkv.bias", (3 * vh,), optional=True),
                _linear(f"{b}.attn.proj", vh, vh)]
        out += _glu_mlp(f"{b}.mlp", vh, out_h)  # the block MLP is out_hidden_size wide (notes A.2)
    out += [_plain(f"{p}.post_layernorm.weight", (vh,)),
            _plain(f"{p}.downsample.weight", (out_h, vh, m, m)), _plain(f"{p}.downsample.bias", (out_h,)),
            _linear(f"{p}.merger.proj", out_h, out_h),
            _plain(f"{p}.merger.post_projection_norm.weight", (out_h,)),
            _plain(f"{p}.merger.post_projection_norm.bias", (out_h,))]
    out += _glu_mlp(f"{p}.merger", out_h, v.intermediate_size)
    return out


def _gpt_oss(spec: ModelSpec) -> list[Entry]:
    h, moe = spec.hidden_size, spec.moe
    e, inner = moe.num_experts, moe.intermediate_size
    mxfp4 = spec.quant.method == "mxfp4"
    if mxfp4 and (h % MXFP4_BLOCK or inner % MXFP4_BLOCK):
        raise ValueError(f"MXFP4 experts need hidden_size and intermediate_size divisible by {MXFP4_BLOCK}")
    out = _decoder_common(spec, "model")
    for i in range(spec.num_layers):
        p = f"model.layers.{i}"
        out += [_plain(f"{p}.input_layernorm.weight", (h,)), _plain(f"{p}.post_attention_layernorm.weight", (h,))]
        out += _attention(spec, p)
        out += [_plain(f"{p}.self_attn.sinks", (spec.num_heads,)),
                _plain(f"{p}.mlp.router.weight", (e, h)), _plain(f"{p}.mlp.router.bias", (e,))]
        x = f"{p}.mlp.experts"
        for proj, shape in (("gate_up_proj", (e, 2 * inner, h)), ("down_proj", (e, h, inner))):
            kind = Mxfp4Experts if mxfp4 else TransposedExperts
            out.append(kind(f"{x}.{proj}.weight", f"{x}.{proj}", shape))
            out.append(PlainTensor(f"{x}.{proj}.bias", f"{x}.{proj}_bias", shape[:2]))
    return out
