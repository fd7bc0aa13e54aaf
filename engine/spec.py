"""ModelSpec: everything the engine needs to know about a checkpoint, read once from config.json.

The spec is frozen and passed down explicitly; no layer reads config.json itself. Both config
dialects are accepted: the one the Hub files use (transformers 4.5x: `rope_theta`,
`rope_scaling`, `partial_rotary_factor` beside them) and the one transformers 5.x writes
(`rope_parameters` holding all of them).
"""
from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

from .weights.quant_config import QuantScheme, parse_quant_config

SUPPORTED_ARCHITECTURES = {
    "glm4v_moe": "GLM-4.5V (Glm4vMoeForConditionalGeneration), bf16 or FP8",
    "gpt_oss": "gpt-oss-20b / gpt-oss-120b (GptOssForCausalLM), MXFP4 or bf16",
}


class UnsupportedModel(ValueError):
    pass


@dataclass(frozen=True)
class RopeSpec:
    """Rotary embedding over the first `rotary_dim` dims of each head, NeoX (half-split) style.

    kind "default": inv_freq_j = theta^(-2j/rotary_dim).
    kind "yarn": YaRN-scaled inv_freq and cos/sin multiplied by `attention_factor`.
    mrope_section: GLM's 3-axis split of the rotary_dim/2 frequencies over (t, h, w) positions.
    """

    kind: str
    theta: float
    rotary_dim: int
    mrope_section: tuple[int, ...] | None = None
    factor: float = 1.0
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    original_max_position: int | None = None
    truncate: bool = True
    attention_factor: float | None = None


@dataclass(frozen=True)
class MoeSpec:
    """router: "sigmoid_bias" (GLM: sigmoid scores, correction bias only for selection) or
    "softmax_topk" (gpt-oss: top-k logits, softmax over them).
    activation: "silu_glu" (down(silu(gate) * up)) or "swiglu_clamped" (gpt-oss, interleaved)."""

    num_experts: int
    top_k: int
    intermediate_size: int
    router: str
    activation: str
    num_shared_experts: int = 0
    norm_topk_prob: bool = True
    routed_scaling_factor: float = 1.0
    n_group: int = 1
    topk_group: int = 1
    expert_bias: bool = False
    swiglu_alpha: float = 1.702
    swiglu_limit: float = 7.0


@dataclass(frozen=True)
class VisionSpec:
    """GLM-4.5V vision tower. `image_size // patch_size` is the side of the learned position table."""

    depth: int
    hidden_size: int
    num_heads: int
    patch_size: int
    temporal_patch_size: int
    spatial_merge_size: int
    image_size: int
    in_channels: int
    out_hidden_size: int
    intermediate_size: int
    rms_norm_eps: float

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_heads


@dataclass(frozen=True)
class ImageTokens:
    image: int
    image_start: int
    image_end: int
    video: int
    video_start: int
    video_end: int


@dataclass(frozen=True)
class SamplingDefaults:
    """The sampling the checkpoint recommends (generation_config.json; temperature 0 where it says
    do_sample false). None where neither the file nor the family says, so callers keep their own."""

    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None

    @classmethod
    def from_generation_config(cls, generation: dict, **family: float) -> "SamplingDefaults":
        """family: the model family's published recommendation, for what the file leaves out."""
        def value(key: str, kind: type):
            v = generation[key] if generation.get(key) is not None else family.get(key)
            return None if v is None else kind(v)

        temperature = 0.0 if generation.get("do_sample") is False else value("temperature", float)
        return cls(temperature=temperature, top_p=value("top_p", float), top_k=value("top_k", int))


@dataclass(frozen=True)
class ModelSpec:
    """Text decoder (both families) plus, for GLM, the vision tower and image token ids.

    layer_types[i] is "full" or "sliding"; sliding layers see the last `sliding_window` keys
    (the query's own position included). `norm_weight_first`: gpt-oss multiplies the RMSNorm
    weight in float32 before casting back, GLM casts first (matters in bf16 only).
    """

    family: str
    vocab_size: int
    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope: RopeSpec
    max_position_embeddings: int
    qkv_bias: bool
    o_bias: bool
    layer_types: tuple[str, ...]
    sliding_window: int | None
    attention_sinks: bool
    dense_intermediate_size: int | None
    first_moe_layer: int
    moe: MoeSpec
    norm_weight_first: bool
    tie_word_embeddings: bool
    eos_token_ids: tuple[int, ...]
    pad_token_id: int | None
    quant: QuantScheme = field(default_factory=QuantScheme)
    vision: VisionSpec | None = None
    image_tokens: ImageTokens | None = None
    torch_dtype: str = "bfloat16"
    sampling: SamplingDefaults = field(default_factory=SamplingDefaults)

    def is_moe_layer(self, i: int) -> bool:
        return i >= self.first_moe_layer

    @classmethod
    def from_dir(cls, path: str | Path) -> "ModelSpec":
        path = Path(path)
        cfg_file = path / "config.json"
        if not cfg_file.is_file():
            raise FileNotFoundError(f"{path} has no config.json: it is not a Hugging Face checkpoint directory")
        config = json.loads(cfg_file.read_text())
        gen_file = path / "generation_config.json"
        generation = json.loads(gen_file.read_text()) if gen_file.is_file() else {}
        return cls.from_config(config, generation)

    @classmethod
    def from_config(cls, config: dict, generation_config: dict | None = None) -> "ModelSpec":
        model_type = config.get("model_type")
        builder = {"glm4v_moe": _glm4v_moe, "gpt_oss": _gpt_oss}.get(model_type)
        if builder is None:
            supported = "; ".join(f"{k}: {v}" for k, v in SUPPORTED_ARCHITECTURES.items())
            raise UnsupportedModel(f"model_type {model_type!r} is not supported. Supported architectures: {supported}")
        return builder(config, generation_config or {})


def _eos_ids(*sources) -> tuple[int, ...]:
    ids: list[int] = []
    for value in sources:
        for v in value if isinstance(value, (list, tuple)) else [value]:
            if v is not None and int(v) not in ids:
                ids.append(int(v))
    return tuple(ids)


def _rope_params(cfg: dict) -> dict:
    """One dict holding rope_type, rope_theta and the scaling keys, from either dialect."""
    params = dict(cfg.get("rope_parameters") or {})
    legacy = cfg.get("rope_scaling") or {}
    for k, v in legacy.items():
        params.setdefault(k, v)
    if "type" in params and "rope_type" not in params:
        params["rope_type"] = params.pop("type")
    if "rope_theta" in cfg:
        params.setdefault("rope_theta", cfg["rope_theta"])
    if "partial_rotary_factor" in cfg:
        params.setdefault("partial_rotary_factor", cfg["partial_rotary_factor"])
    params.setdefault("rope_type", "default")
    return params


def _rope_spec(params: dict, head_dim: int, default_partial: float, default_theta: float) -> RopeSpec:
    kind = params["rope_type"]
    rotary_dim = int(head_dim * float(params.get("partial_rotary_factor", default_partial)))
    theta = float(params.get("rope_theta", default_theta))
    section = tuple(int(s) for s in params["mrope_section"]) if params.get("mrope_section") else None
    if section is not None and 2 * sum(section) != rotary_dim:
        raise UnsupportedModel(f"mrope_section {list(section)} does not cover the {rotary_dim} rotary dims")
    if kind == "default":
        return RopeSpec("default", theta, rotary_dim, section)
    if kind == "yarn":
        return RopeSpec(
            "yarn", theta, rotary_dim, section,
            factor=float(params["factor"]),
            beta_fast=float(params.get("beta_fast") or 32.0),
            beta_slow=float(params.get("beta_slow") or 1.0),
            original_max_position=int(params["original_max_position_embeddings"]),
            truncate=bool(params.get("truncate", True)),
            attention_factor=params.get("attention_factor"),
        )
    raise UnsupportedModel(f"rope_type {kind!r} is not supported (default and yarn are)")


def _glm4v_moe(config: dict, generation: dict) -> ModelSpec:
    text = config.get("text_config") or {}
    vis = config.get("vision_config") or {}
    heads = int(text["num_attention_heads"])
    head_dim = int(text.get("head_dim") or text["hidden_size"] // heads)
    layers = int(text["num_hidden_layers"])
    rope = _rope_spec(_rope_params(text), head_dim, default_partial=0.5, default_theta=10000.0)
    vision = VisionSpec(
        depth=int(vis["depth"]), hidden_size=int(vis["hidden_size"]), num_heads=int(vis["num_heads"]),
        patch_size=int(vis.get("patch_size", 14)), temporal_patch_size=int(vis.get("temporal_patch_size", 2)),
        spatial_merge_size=int(vis.get("spatial_merge_size", 2)), image_size=int(vis.get("image_size", 336)),
        in_channels=int(vis.get("in_channels", 3)), out_hidden_size=int(vis["out_hidden_size"]),
        intermediate_size=int(vis["intermediate_size"]), rms_norm_eps=float(vis.get("rms_norm_eps", 1e-5)),
    )
    if vision.out_hidden_size != int(text["hidden_size"]):
        raise UnsupportedModel("vision_config.out_hidden_size must equal text_config.hidden_size")
    return ModelSpec(
        family="glm4v_moe",
        vocab_size=int(text["vocab_size"]), hidden_size=int(text["hidden_size"]), num_layers=layers,
        num_heads=heads, num_kv_heads=int(text["num_key_value_heads"]), head_dim=head_dim,
        rms_norm_eps=float(text.get("rms_norm_eps", 1e-5)), rope=rope,
        max_position_embeddings=int(text.get("max_position_embeddings", 65536)),
        qkv_bias=bool(text.get("attention_bias", True)), o_bias=False,
        layer_types=("full",) * layers, sliding_window=None, attention_sinks=False,
        dense_intermediate_size=int(text["intermediate_size"]),
        first_moe_layer=int(text.get("first_k_dense_replace", 1)),
        moe=MoeSpec(
            num_experts=int(text["n_routed_experts"]), top_k=int(text["num_experts_per_tok"]),
            intermediate_size=int(text["moe_intermediate_size"]), router="sigmoid_bias", activation="silu_glu",
            num_shared_experts=int(text.get("n_shared_experts", 1)), norm_topk_prob=bool(text.get("norm_topk_prob", True)),
            routed_scaling_factor=float(text.get("routed_scaling_factor", 1.0)),
            n_group=int(text.get("n_group", 1)), topk_group=int(text.get("topk_group", 1)),
        ),
        norm_weight_first=False,
        tie_word_embeddings=bool(config.get("tie_word_embeddings", text.get("tie_word_embeddings", False))),
        eos_token_ids=_eos_ids(generation.get("eos_token_id"), text.get("eos_token_id"), config.get("eos_token_id")),
        pad_token_id=text.get("pad_token_id", config.get("pad_token_id")),
        quant=parse_quant_config(config.get("quantization_config")),
        vision=vision,
        image_tokens=ImageTokens(
            image=int(config["image_token_id"]), image_start=int(config["image_start_token_id"]),
            image_end=int(config["image_end_token_id"]), video=int(config["video_token_id"]),
            video_start=int(config["video_start_token_id"]), video_end=int(config["video_end_token_id"]),
        ),
        torch_dtype=str(config.get("dtype") or config.get("torch_dtype") or text.get("dtype") or "bfloat16"),
        sampling=SamplingDefaults.from_generation_config(generation),
    )


def _gpt_oss(config: dict, generation: dict) -> ModelSpec:
    heads = int(config["num_attention_heads"])
    head_dim = int(config.get("head_dim") or config["hidden_size"] // heads)
    layers = int(config["num_hidden_layers"])
    types = config.get("layer_types") or [
        "sliding_attention" if i % 2 == 0 else "full_attention" for i in range(layers)]
    layer_types = tuple("sliding" if t == "sliding_attention" else "full" for t in types)
    rope = _rope_spec(_rope_params(config), head_dim, default_partial=1.0, default_theta=150000.0)
    experts = int(config.get("num_local_experts") or config["num_experts"])
    return ModelSpec(
        family="gpt_oss",
        vocab_size=int(config["vocab_size"]), hidden_size=int(config["hidden_size"]), num_layers=layers,
        num_heads=heads, num_kv_heads=int(config["num_key_value_heads"]), head_dim=head_dim,
        rms_norm_eps=float(config.get("rms_norm_eps", 1e-5)), rope=rope,
        max_position_embeddings=int(config.get("max_position_embeddings", 131072)),
        qkv_bias=bool(config.get("attention_bias", True)), o_bias=bool(config.get("attention_bias", True)),
        layer_types=layer_types, sliding_window=int(config["sliding_window"]) if config.get("sliding_window") else None,
        attention_sinks=True, dense_intermediate_size=None, first_moe_layer=0,
        moe=MoeSpec(
            num_experts=experts, top_k=int(config.get("num_experts_per_tok") or config["experts_per_token"]),
            intermediate_size=int(config["intermediate_size"]), router="softmax_topk", activation="swiglu_clamped",
            expert_bias=True, swiglu_alpha=float(config.get("swiglu_alpha", 1.702)),
            swiglu_limit=float(config.get("swiglu_limit", 7.0)),
        ),
        norm_weight_first=True,
        tie_word_embeddings=bool(config.get("tie_word_embeddings", False)),
        eos_token_ids=_eos_ids(generation.get("eos_token_id"), config.get("eos_token_id")),
        pad_token_id=config.get("pad_token_id"),
        quant=parse_quant_config(config.get("quantization_config")),
        torch_dtype=str(config.get("dtype") or config.get("torch_dtype") or "bfloat16"),
        # The checkpoints' generation_config.json sets do_sample only; OpenAI recommends these
        # (openai/gpt-oss README).
        sampling=SamplingDefaults.from_generation_config(generation, temperature=1.0, top_p=1.0),
    )
