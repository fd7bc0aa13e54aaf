"""Tiny random gpt-oss and GLM-4.5V models for the runtime tests: a transformers model (the
reference), the same weights converted into the engine's weight store, an ASCII tokenizer with a
small chat template saved to a directory, and an Engine over them."""
from __future__ import annotations

import dataclasses
from pathlib import Path

import numpy as np
import torch
from PIL import Image
from tokenizers import Tokenizer, decoders, models, pre_tokenizers
from transformers import PreTrainedTokenizerFast

from localchat.engine.models import build_model
from localchat.engine.runtime.engine import Engine
from localchat.engine.runtime.prompt import ChatFormatter
from localchat.engine.runtime.request import ChatRequest, ImagePart, Message, SamplingParams, TextPart
from localchat.engine.spec import ModelSpec
from localchat.engine.weights.formats import DenseWeight

_LINEARS = {"q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj", "qkv", "proj", "lm_head"}


def to_store(state_dict: dict, family: str, device: str = "cpu") -> dict:
    """HF state_dict -> the engine's flat weight store (linear weights as DenseWeight; experts
    stacked [E, N, K]; GLM's fused gate_up split; gpt-oss's [E, K, N] experts transposed)."""
    out = {}
    for name, t in state_dict.items():
        t = t.detach().to(device=device, dtype=torch.float32)
        if ".mlp.experts." in name:
            if family == "gpt_oss":
                if name.endswith(("gate_up_proj", "down_proj")):
                    out[name + ".weight"] = DenseWeight(t.transpose(1, 2).contiguous())
                elif name.endswith("_bias"):
                    out[name[:-len("_bias")] + ".bias"] = t
                continue
            if name.endswith("gate_up_proj"):
                i = t.shape[1] // 2
                out[name.replace("gate_up_proj", "gate_proj.weight")] = DenseWeight(t[:, :i].contiguous())
                out[name.replace("gate_up_proj", "up_proj.weight")] = DenseWeight(t[:, i:].contiguous())
                continue
            if name.endswith("down_proj"):
                out[name + ".weight"] = DenseWeight(t)
                continue
        module = name.rsplit(".", 1)[0].split(".")[-1]
        is_linear = (name.endswith(".weight") and module in _LINEARS and t.dim() == 2
                     and "patch_embed" not in name and "downsample" not in name)
        out[name] = DenseWeight(t) if is_linear else t
    return out


GLM_SPECIALS = ("<|endoftext|>", "<|system|>", "<|user|>", "<|assistant|>", "<think>", "</think>",
                "<|image|>", "<|begin_of_image|>", "<|end_of_image|>", "<|video|>", "<|begin_of_video|>",
                "<|end_of_video|>", "<|begin_of_box|>", "<|end_of_box|>")
OSS_SPECIALS = ("<|endoftext|>", "<|start|>", "<|end|>", "<|message|>", "<|channel|>", "<|return|>",
                "<|call|>", "<|constrain|>")

GLM_TEMPLATE = (
    "{%- for m in messages -%}<|{{ m.role }}|>"
    "{%- if m.content is string -%}{{ m.content }}{%- else -%}{%- for p in m.content -%}"
    "{%- if p.type == 'image' -%}<|begin_of_image|><|image|><|end_of_image|>{%- else -%}{{ p.text }}{%- endif -%}"
    "{%- endfor -%}{%- endif -%}{%- endfor -%}"
    "{%- if add_generation_prompt -%}<|assistant|>{%- if not enable_thinking -%}<think></think>{%- endif -%}{%- endif -%}")
OSS_TEMPLATE = (
    "{%- for m in messages -%}<|start|>{{ m.role }}<|message|>{{ m.content }}<|end|>{%- endfor -%}"
    "{%- if add_generation_prompt -%}<|start|>assistant{%- endif -%}")


def ascii_tokenizer(specials: tuple[str, ...], template: str) -> PreTrainedTokenizerFast:
    """One token per printable ASCII character (byte-level, so space is 'Ġ'), then the specials."""
    chars = sorted({pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False).pre_tokenize_str(chr(c))[0][0]
                    for c in [10, *range(32, 127)]})
    tok = Tokenizer(models.BPE(vocab={c: i for i, c in enumerate(chars)}, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens(list(specials))
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|endoftext|>")
    fast.chat_template = template
    return fast


def _randomize(model) -> None:
    # std 0.5: with smaller weights a random model falls into a two-token loop at once, and
    # repeated outputs would hide a wrong position or a stale cache entry.
    torch.manual_seed(0)
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0, 0.5)
        for mod in model.modules():
            if hasattr(mod, "e_score_correction_bias"):
                mod.e_score_correction_bias.normal_(0, 0.1)


@dataclasses.dataclass
class Tiny:
    hf: object  # the transformers model
    spec: ModelSpec
    model: object  # the engine's model over the same weights
    path: Path  # tokenizer, template (and image processor) directory
    tokenizer: PreTrainedTokenizerFast
    device: str = "cpu"

    def engine(self, **serving) -> Engine:
        """serving: Engine options (block_size, num_blocks, max_batch_tokens, max_context, ...)."""
        max_context = serving.pop("max_context", None)
        return Engine.from_model(self.spec, self.model, ChatFormatter(self.path, self.spec), device=self.device,
                                 dtype="float32", max_context=max_context, **serving)


def tiny_gpt_oss(path: Path, device: str = "cpu") -> Tiny:
    from transformers import GptOssConfig, GptOssForCausalLM

    tok = ascii_tokenizer(OSS_SPECIALS, OSS_TEMPLATE)
    tok.save_pretrained(path)
    cfg = GptOssConfig(vocab_size=len(tok), hidden_size=64, intermediate_size=64, num_hidden_layers=2,
                       num_attention_heads=4, num_key_value_heads=2, head_dim=16, num_local_experts=4,
                       num_experts_per_tok=2, sliding_window=8, max_position_embeddings=512,
                       rope_parameters={"rope_type": "yarn", "rope_theta": 150000.0, "factor": 32.0,
                                        "original_max_position_embeddings": 16, "beta_fast": 32.0,
                                        "beta_slow": 1.0},
                       eos_token_id=tok.convert_tokens_to_ids("<|endoftext|>"), attn_implementation="eager")
    hf = GptOssForCausalLM(cfg).eval()
    _randomize(hf)
    # No end-of-sequence id: greedy runs last exactly max_tokens (tests that need one set it).
    spec = dataclasses.replace(ModelSpec.from_config(cfg.to_dict()), eos_token_ids=())
    return Tiny(hf, spec, build_model(spec, to_store(hf.state_dict(), "gpt_oss", device), device), path, tok, device)


def tiny_glm(path: Path, device: str = "cpu") -> Tiny:
    from transformers import Glm4vMoeConfig, Glm4vMoeForConditionalGeneration
    from transformers.models.glm4v.image_processing_pil_glm4v import Glm4vImageProcessorPil

    tok = ascii_tokenizer(GLM_SPECIALS, GLM_TEMPLATE)
    tok.save_pretrained(path)
    Glm4vImageProcessorPil(size={"shortest_edge": 12544, "longest_edge": 40000}).save_pretrained(path)
    ids = tok.convert_tokens_to_ids
    cfg = Glm4vMoeConfig(
        text_config=dict(vocab_size=len(tok), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, head_dim=32, moe_intermediate_size=32,
                         n_routed_experts=8, num_experts_per_tok=2, n_shared_experts=1, first_k_dense_replace=1,
                         max_position_embeddings=512, eos_token_id=ids("<|endoftext|>"),
                         pad_token_id=ids("<|endoftext|>"),
                         rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "mrope_section": [2, 3, 3],
                                          "partial_rotary_factor": 0.5}),
        vision_config=dict(depth=2, hidden_size=32, num_heads=2, intermediate_size=64, out_hidden_size=64,
                           patch_size=14, temporal_patch_size=2, spatial_merge_size=2, image_size=56),
        image_token_id=ids("<|image|>"), video_token_id=ids("<|video|>"),
        image_start_token_id=ids("<|begin_of_image|>"), image_end_token_id=ids("<|end_of_image|>"),
        video_start_token_id=ids("<|begin_of_video|>"), video_end_token_id=ids("<|end_of_video|>"))
    hf = Glm4vMoeForConditionalGeneration(cfg).eval()
    _randomize(hf)
    spec = dataclasses.replace(ModelSpec.from_config(cfg.to_dict()), eos_token_ids=())
    return Tiny(hf, spec, build_model(spec, to_store(hf.state_dict(), "glm", device), device), path, tok, device)


def image(seed: int, height: int = 56, width: int = 56) -> ImagePart:
    """A random RGB picture (PNG bytes, so it carries a content hash)."""
    import io

    pixels = np.random.RandomState(seed).randint(0, 255, (height, width, 3), dtype=np.uint8)
    buf = io.BytesIO()
    Image.fromarray(pixels).save(buf, format="PNG")
    return ImagePart.from_bytes(buf.getvalue())


def chat(*turns, max_tokens: int = 8, thinking: bool = False, **sampling) -> ChatRequest:
    """turns: ("user" | "assistant", text or a tuple of parts) pairs; greedy unless told."""
    sampling.setdefault("temperature", 0.0)
    messages = tuple(Message(role, (TextPart(c),) if isinstance(c, str) else tuple(c)) for role, c in turns)
    return ChatRequest(messages, SamplingParams(max_tokens=max_tokens, **sampling), thinking=thinking)


def hf_greedy(tiny: Tiny, prompt, n: int) -> list[int]:
    """n greedy tokens from the transformers model, recomputing the whole sequence each step."""
    ids = torch.tensor(prompt.input_ids)[None]
    extra = {}
    if prompt.pixel_values is not None:
        extra = dict(pixel_values=prompt.pixel_values, image_grid_thw=prompt.image_grid_thw)
    out = []
    with torch.no_grad():
        for _ in range(n):
            if extra:
                extra["mm_token_type_ids"] = (ids == tiny.spec.image_tokens.image).int()
            nxt = int(tiny.hf(input_ids=ids, **extra).logits[0, -1].argmax())
            out.append(nxt)
            ids = torch.cat((ids, torch.tensor([[nxt]])), dim=1)
    return out


def collect(stream, timeout: float = 60.0):
    """Drains a stream -> (generated token ids, answer text, reasoning text, Final)."""
    from localchat.engine.runtime.request import Final

    ids, text, reasoning = [], [], []
    for item in stream:
        if isinstance(item, Final):
            return ids, "".join(text), "".join(reasoning), item
        ids += item.token_ids
        text.append(item.text)
        reasoning.append(item.reasoning)
    raise AssertionError("the stream ended without a Final")
