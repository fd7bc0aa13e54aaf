"""`--model demo`: a tiny GLM-4.5V-architecture checkpoint with random weights, built on first use.

It lets the whole app (page, API, `localchat run`) work on a machine with no GPU and no
download. The transformer layers are random; embedding and output layer hold a word-pair table
of a few sentences (`_word_pair_head`), so the demo thinks, answers and stops the way GLM does,
with made-up words. The files have the real checkpoint's layout (per-expert bf16 tensors in sharded
safetensors with an index, config.json in the Hub dialect, generation_config.json, tokenizer
files with a GLM-shaped chat template, preprocessor_config.json), so the engine loads it through
the same code path as a real model.

The tokenizer builder (with a smaller vocabulary learned from other text) and the chat template
here are also what the test fixtures use.
"""
from __future__ import annotations

import json
import shutil
import tempfile
from pathlib import Path

DEMO_NAME = "demo"
DEMO_NOTE = ("Demo model: random weights and a small word-pair table; the answers are made up and "
             "ignore your images and question.")
# Bump when anything written below changes, so stale cached builds are not reused.
DEMO_VERSION = 3
VOCAB = 336  # the test fixtures' tokenizer has 321 entries; the embedding is padded like the real one's
DEMO_BPE_VOCAB = 1024  # enough merges that every word of the demo text is one token
SHARDS = 3
LM_HEAD_SCALE = 3.0  # x the other linears' std: peaked but varied sampling

BPE_VOCAB = 300  # 256 byte symbols + 44 merges
# GLM-4.5 special tokens (reference notes A.8). Whether <think>, </think>, /nothink and the box
# markers are "special" in the real tokenizer.json is inferred: they are kept as added but
# non-special tokens so skip_special_tokens decoding keeps the reasoning markers.
GLM_SPECIAL = ("<|endoftext|>", "[MASK]", "[gMASK]", "[sMASK]", "<sop>", "<eop>", "<|system|>", "<|user|>",
               "<|assistant|>", "<|observation|>", "<|begin_of_image|>", "<|end_of_image|>", "<|begin_of_video|>",
               "<|end_of_video|>", "<|image|>", "<|video|>")
GLM_ADDED = ("<think>", "</think>", "<tool_call>", "</tool_call>", "<tool_response>", "</tool_response>",
             "<arg_key>", "</arg_key>", "<arg_value>", "</arg_value>", "/nothink", "<|begin_of_box|>",
             "<|end_of_box|>")

# A few hundred merges are learned from this fixed text so ordinary words are not one token per byte.
_CORPUS = [
    "The quick brown fox jumps over the lazy dog.",
    "What is in this picture? Describe the image in one sentence.",
    "Hello, how are you today? I am fine, thank you for asking.",
    "A red square and a blue circle are on the table in the kitchen.",
    "Think step by step, then answer the question with a short number.",
    "the theory of the thing is that there is nothing in the world that the thinker thinks",
    "one two three four five six seven eight nine ten eleven twelve",
    "Please write a poem about the sea, the sky and the stars at night.",
] * 8

# The shape of GLM-4.5V's template (reference notes A.8): prefix `[gMASK]<sop>`; turns
# `<|system|>\n`, `<|user|>\n`, `<|assistant|>`; an image renders
# `<|begin_of_image|><|image|><|end_of_image|>`; `/nothink` ends user turns when thinking is off;
# assistant history carries `\n<think>reasoning</think>` only after the last user turn (else
# `\n<think></think>`), then `\ncontent`; the generation prompt is `<|assistant|>\n`, plus
# `<think></think>\n` when thinking is off. With tools, a `<|system|>\n# Tools` block lists them
# as JSON inside `<tools></tools>` and shows the call format; an assistant's calls follow its text
# as `\n<tool_call>NAME` + `\n<arg_key>K</arg_key>\n<arg_value>V</arg_value>` per argument (V as
# text for strings, JSON otherwise) + `\n</tool_call>`; results are `<|observation|>` (once for a
# run of them) then `\n<tool_response>\n...\n</tool_response>` each.
GLM_CHAT_TEMPLATE = r"""{%- macro visible(content) -%}
{%- if content is string -%}{{ content }}
{%- elif content is not none -%}
{%- for item in content -%}
{%- if item.type == 'text' -%}{{ item.text }}
{%- elif item.type in ['image', 'image_url'] -%}{{ '<|begin_of_image|><|image|><|end_of_image|>' }}
{%- elif item.type in ['video', 'video_url'] -%}{{ '<|begin_of_video|><|video|><|end_of_video|>' }}
{%- endif -%}
{%- endfor -%}
{%- endif -%}
{%- endmacro -%}
{%- set thinking = enable_thinking is not defined or enable_thinking -%}
{%- set ns = namespace(last_user=-1) -%}
{%- for m in messages -%}{%- if m.role == 'user' -%}{%- set ns.last_user = loop.index0 -%}{%- endif -%}{%- endfor -%}
{{- '[gMASK]<sop>' -}}
{%- if tools -%}
{{- '<|system|>\n# Tools\n\nFunctions you may call, one JSON signature a line:\n<tools>\n' -}}
{%- for tool in tools -%}{{- tool | tojson -}}{{- '\n' -}}{%- endfor -%}
{{- '</tools>\n\nTo call one, write:\n<tool_call>{name}\n<arg_key>{key}</arg_key>\n<arg_value>{value}</arg_value>\n...\n</tool_call>' -}}
{%- endif -%}
{%- for m in messages -%}
{%- set text = visible(m.content) -%}
{%- if m.role == 'system' -%}
{{- '<|system|>\n' + text -}}
{%- elif m.role == 'user' -%}
{{- '<|user|>\n' + text -}}
{%- if not thinking and not text.endswith('/nothink') -%}{{- '/nothink' -}}{%- endif -%}
{%- elif m.role == 'assistant' -%}
{%- set reasoning = m.reasoning_content if m.reasoning_content is defined and m.reasoning_content else '' -%}
{%- if '</think>' in text -%}
{%- set reasoning = text.split('</think>')[0].split('<think>')[-1].strip() -%}
{%- set text = text.split('</think>')[-1] -%}
{%- endif -%}
{{- '<|assistant|>' -}}
{%- if loop.index0 > ns.last_user and reasoning -%}
{{- '\n<think>' + reasoning.strip() + '</think>' -}}
{%- else -%}
{{- '\n<think></think>' -}}
{%- endif -%}
{%- if text.strip() -%}{{- '\n' + text.strip() -}}{%- endif -%}
{%- for call in m.tool_calls or [] -%}
{%- set fn = call.function if call.function is defined else call -%}
{{- '\n<tool_call>' + fn.name -}}
{%- if fn.arguments is mapping -%}
{%- for key, value in fn.arguments.items() -%}
{{- '\n<arg_key>' + key + '</arg_key>\n<arg_value>' + (value if value is string else value | tojson) + '</arg_value>' -}}
{%- endfor -%}
{%- endif -%}
{{- '\n</tool_call>' -}}
{%- endfor -%}
{%- elif m.role in ['tool', 'observation'] -%}
{%- if loop.first or messages[loop.index0 - 1].role not in ['tool', 'observation'] -%}{{- '<|observation|>' -}}{%- endif -%}
{{- '\n<tool_response>\n' + text + '\n</tool_response>' -}}
{%- endif -%}
{%- endfor -%}
{%- if add_generation_prompt -%}
{{- '<|assistant|>\n' -}}
{%- if not thinking -%}{{- '<think></think>\n' -}}{%- endif -%}
{%- endif -%}"""


def build_tokenizer(special: tuple[str, ...], added: tuple[str, ...] = (), *, vocab_size: int = BPE_VOCAB,
                    corpus: list[str] | None = None):
    """A byte-level BPE `tokenizers.Tokenizer`: merges learned from `corpus` (default: the test
    fixtures' text) up to `vocab_size`, then `special`, then `added` (fixed ids)."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                  show_progress=False, special_tokens=[])
    tok.train_from_iterator(corpus or _CORPUS, trainer=trainer)
    for t in special:
        tok.add_special_tokens([AddedToken(t, special=True, normalized=False)])
    for t in added:
        tok.add_tokens([AddedToken(t, special=False, normalized=False)])
    return tok


def save_tokenizer(tok, out: Path, chat_template: str, *, eos: str, pad: str, bos: str | None = None,
                   extra_config: dict | None = None) -> None:
    """tokenizer.json + tokenizer_config.json (+ chat_template.jinja) as transformers writes them."""
    from transformers import PreTrainedTokenizerFast

    fast = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token=eos, pad_token=pad, bos_token=bos,
                                   clean_up_tokenization_spaces=False, model_max_length=4096, **(extra_config or {}))
    fast.chat_template = chat_template
    fast.save_pretrained(out)


def demo_root() -> Path:
    from platformdirs import user_cache_dir

    return Path(user_cache_dir("localchat")) / "demo"


def ensure_demo(root: Path | None = None) -> Path:
    """The demo checkpoint directory under `root` (default: the user cache dir), built if missing."""
    root = Path(root) if root is not None else demo_root()
    target = root / f"v{DEMO_VERSION}"
    if (target / "config.json").is_file():
        return target
    root.mkdir(parents=True, exist_ok=True)
    # Build beside the final place and rename, so an interrupted build is never taken as done.
    stage = Path(tempfile.mkdtemp(prefix=".building-", dir=root))
    try:
        build_demo(stage)
        try:
            stage.rename(target)
        except OSError:  # another process finished first
            if not (target / "config.json").is_file():
                raise
    finally:
        shutil.rmtree(stage, ignore_errors=True)
    return target


def build_demo(out: Path, seed: int = 0) -> None:
    """Write the whole demo checkpoint into the directory `out`."""
    from ..engine.spec import ModelSpec

    tok = build_tokenizer(GLM_SPECIAL, GLM_ADDED, vocab_size=DEMO_BPE_VOCAB, corpus=_demo_corpus())
    ids = {n: tok.token_to_id(n) for n in GLM_SPECIAL + GLM_ADDED}
    eos = [ids["<|endoftext|>"], ids["<|user|>"], ids["<|observation|>"]]
    vocab = -(-tok.get_vocab_size() // 64) * 64  # padded like the real embedding
    config = _config(ids, eos, vocab)
    generation = {"eos_token_id": eos, "pad_token_id": ids["<|endoftext|>"], "do_sample": True,
                  "temperature": 0.8, "top_p": 0.9, "top_k": 40}
    spec = ModelSpec.from_config(config, generation)
    tensors = _random_tensors(spec, seed, _unprintable_ids(tok))
    _word_pair_head(tensors, spec, tok, seed)
    _write_shards(out, tensors)
    _write_json(out / "config.json", config)
    _write_json(out / "generation_config.json", generation)
    _write_json(out / "preprocessor_config.json", preprocessor_config())
    save_tokenizer(tok, out, GLM_CHAT_TEMPLATE, eos="<|endoftext|>", pad="<|endoftext|>",
                   extra_config={"processor_class": "Glm4vProcessor"})


def _config(ids: dict[str, int], eos: list[int], vocab: int = VOCAB) -> dict:
    """config.json in the Hub's 4.5x dialect (rope keys inside text_config, "torch_dtype")."""
    text = {
        "model_type": "glm4v_moe_text", "vocab_size": vocab, "hidden_size": 64, "intermediate_size": 160,
        "num_hidden_layers": 3, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 32,
        "moe_intermediate_size": 32, "n_routed_experts": 8, "num_experts_per_tok": 2, "n_shared_experts": 1,
        "first_k_dense_replace": 1, "norm_topk_prob": True, "routed_scaling_factor": 1.0, "n_group": 1,
        "topk_group": 1, "attention_bias": True, "max_position_embeddings": 8192, "rms_norm_eps": 1e-5,
        "rope_theta": 10000.0, "partial_rotary_factor": 0.5,
        "rope_scaling": {"rope_type": "default", "mrope_section": [2, 3, 3]},
        "hidden_act": "silu", "eos_token_id": eos, "pad_token_id": ids["<|endoftext|>"], "torch_dtype": "bfloat16",
    }
    vision = {"model_type": "glm4v_moe_vision", "depth": 2, "hidden_size": 32, "num_heads": 2,
              "intermediate_size": 96, "out_hidden_size": 64, "patch_size": 14, "temporal_patch_size": 2,
              "spatial_merge_size": 2, "image_size": 56, "in_channels": 3, "rms_norm_eps": 1e-5, "hidden_act": "silu"}
    return {
        "architectures": ["Glm4vMoeForConditionalGeneration"], "model_type": "glm4v_moe",
        "text_config": text, "vision_config": vision, "tie_word_embeddings": False, "torch_dtype": "bfloat16",
        "image_token_id": ids["<|image|>"], "video_token_id": ids["<|video|>"],
        "image_start_token_id": ids["<|begin_of_image|>"], "image_end_token_id": ids["<|end_of_image|>"],
        "video_start_token_id": ids["<|begin_of_video|>"], "video_end_token_id": ids["<|end_of_video|>"],
        "transformers_version": "4.57.1",
    }


def preprocessor_config() -> dict:
    """Glm4vImageProcessor with small pixel limits (at most 224x224 pixels: 64 image tokens; a
    64x48 image becomes a 56x56 grid, 4 tokens)."""
    return {
        "image_processor_type": "Glm4vImageProcessor", "processor_class": "Glm4vProcessor",
        "do_resize": True, "do_rescale": True, "rescale_factor": 1 / 255, "do_normalize": True, "do_convert_rgb": True,
        "image_mean": [0.48145466, 0.4578275, 0.40821073], "image_std": [0.26862954, 0.26130258, 0.27577711],
        "patch_size": 14, "temporal_patch_size": 2, "merge_size": 2, "resample": 3,
        "size": {"shortest_edge": 3136, "longest_edge": 50176},
    }


def _unprintable_ids(tok) -> list[int]:
    """Byte tokens that decode to control characters or half a UTF-8 sequence, and special
    tokens other than the stop tokens: the demo should rarely emit them."""
    keep = {"<|endoftext|>", "<|user|>", "<|observation|>", "<think>", "</think>"}
    out = []
    for i in range(tok.get_vocab_size()):
        piece = tok.id_to_token(i)
        if piece in GLM_SPECIAL + GLM_ADDED:
            if piece not in keep:
                out.append(i)
            continue
        text = tok.decode([i])
        if not text or "\ufffd" in text or not all(c.isprintable() or c in " \n" for c in text):
            out.append(i)
    return out


def _random_tensors(spec, seed: int, muted_ids: list[int]) -> dict:
    """{checkpoint name: tensor} for every entry of the schema, bf16 (correction bias fp32).

    The scale follows the test fixtures (std 0.08, norms near 1, non-zero router bias) so logits
    are not flat; lm_head rows get a larger scale so sampling is peaked and varied, and the rows
    of `muted_ids` a small one so those tokens are seldom sampled."""
    import torch

    from ..engine.weights.schema import LinearModule, PlainTensor, expected_entries

    g = torch.Generator().manual_seed(seed)
    normal = lambda shape, std: torch.randn(shape, generator=g) * std  # noqa: E731
    out: dict[str, torch.Tensor] = {}
    for entry in expected_entries(spec):
        if isinstance(entry, PlainTensor):
            name, shape = entry.source, entry.shape
            if name.endswith("e_score_correction_bias"):
                out[name] = normal(shape, 0.1)
            elif "norm" in name and name.endswith("weight"):
                out[name] = 1.0 + normal(shape, 0.1)
            elif name.endswith("bias"):
                out[name] = normal(shape, 0.05)
            elif "embed_tokens" in name:
                out[name] = normal(shape, 0.2)
            else:
                out[name] = normal(shape, 0.08)
        elif isinstance(entry, LinearModule):
            for module in entry.sources:
                w = normal(entry.shape, 0.08)
                if module == "lm_head":
                    w *= LM_HEAD_SCALE
                    w[muted_ids] *= 0.1
                out[f"{module}.weight"] = w
        else:
            raise ValueError(f"the demo builds GLM checkpoints only, not {type(entry).__name__}")
    return {n: t if n.endswith("e_score_correction_bias") else t.to(torch.bfloat16)
            for n, t in sorted(out.items(), key=lambda kv: _hub_order(kv[0]))}


# What the demo says. Thoughts share no token with the answers and end in "?"; answer sentences
# end in "." and every answer ends with the one sentence that ends in "!". So a word-pair table
# stays in the thoughts until a "?" leads to `</think>`, and ends the answer after the "!".
DEMO_THOUGHTS = (
    "Hmm?",
    "Shapes? Colours?",
    "Which bars look tallest?",
    "Any labels? Legend?",
    "Count them first?",
    "Maybe compare heights?",
    "Background colour?",
)
DEMO_ANSWERS = (
    "This answer comes from the demo model, which has random weights.",
    "Its words are picked from a small table of word pairs, not from your image or your question.",
    "Your images and your message still go through the whole model, so the page works as it would with a real one.",
    "The demo model runs on the CPU of any machine, with no download.",
)
DEMO_LAST = "Start localchat with a vision model for real answers!"
_EOS = "<|endoftext|>"
_FLOOR = -16.0  # logit of a word that never follows the current one
_FLAG_IN, _FLAG_OUT = 63, 62  # residual dims: "this is <|assistant|>", "the previous token was <|assistant|>"


def _demo_corpus() -> list[str]:
    # Joined by spaces too, so a sentence's first word after a space is one token as well.
    sentences = DEMO_THOUGHTS + DEMO_ANSWERS + (DEMO_LAST,)
    return [" ".join(sentences)] * 8 + list(sentences) * 8 + _CORPUS


def _demo_documents(seed: int, n: int = 400) -> list[str]:
    """Example answers in GLM's shape: `<think>` thoughts `</think>` newline answer, end of text."""
    import random

    rng = random.Random(seed)
    docs = []
    for _ in range(n):
        thoughts = rng.sample(DEMO_THOUGHTS, rng.randint(1, 3))
        answers = rng.sample(DEMO_ANSWERS, rng.randint(1, 2)) + [DEMO_LAST]
        docs.append("<think>" + " ".join(thoughts) + "</think>\n" + " ".join(answers) + _EOS)
    return docs


def _word_pair_logits(tok, vocab: int, seed: int):
    """[vocab, vocab] log P(next | current) counted over `_demo_documents`, floored at _FLOOR.
    A current token the documents never show is followed by what follows `</think>\n`."""
    import torch

    counts = torch.zeros(vocab, vocab)
    for doc in _demo_documents(seed):
        ids = tok.encode(doc).ids
        for a, b in zip(ids, ids[1:]):
            counts[a, b] += 1
    newline = tok.encode("\n").ids[-1]
    unseen = counts.sum(1) == 0
    counts[unseen] = counts[newline].clone()
    think = tok.token_to_id("<think>")
    counts[:, think] = 0  # only the previous-token flag starts thinking
    probs = counts / counts.sum(1, keepdim=True)
    return probs.clamp_min(1e-30).log().clamp_min(_FLOOR)


def _word_pair_head(tensors: dict, spec, tok, seed: int) -> None:
    """Turn the random model into one that babbles the demo text, thinking first, as GLM does.

    The transformer layers stay random but write only a little into the residual stream (their
    output projections are scaled down), so the logits mostly depend on the current token:
    embedding and lm_head are a rank-60 factorisation of a word-pair table (`_word_pair_logits`).
    One attention head of layer 0 attends to the previous position (its query and key are
    constant vectors whose rotary phases agree at distance 1) and copies an "is <|assistant|>"
    flag, so the token after `<|assistant|>\n`, the end of a thinking prompt, is `<think>`;
    after `<think></think>\n` (thinking off) the answer starts directly.
    """
    import torch

    from ..engine.layers.rotary import RotaryEmbedding, apply_rotary

    prefix = "model.language_model"
    embed = tensors[f"{prefix}.embed_tokens.weight"].float()
    vocab, hidden = embed.shape
    rank = hidden - 4  # dims [0, rank): the table; rank: constant; 62, 63: the flag
    logits = _word_pair_logits(tok, vocab, seed)
    u, sv, _ = torch.linalg.svd(logits - logits.mean(), full_matrices=False)
    feats = torch.zeros(vocab, hidden)
    feats[:, :rank] = u[:, :rank] * sv[:rank].sqrt()
    feats[:, rank] = feats[:, :rank].norm(dim=1).mean() / 4
    feats = feats / feats.pow(2).mean(1, keepdim=True).sqrt()  # the final RMSNorm sees these rows
    head = torch.zeros(vocab, hidden)
    head[:, :rank + 1] = torch.linalg.lstsq(feats[:, :rank + 1], logits).solution.T
    assistant, think = tok.token_to_id("<|assistant|>"), tok.token_to_id("<think>")
    feats[assistant] = 0
    feats[assistant, _FLAG_IN] = hidden ** 0.5  # after RMSNorm: exactly this value
    head[think, _FLAG_OUT] = 5.0
    tensors[f"{prefix}.embed_tokens.weight"] = feats
    tensors["lm_head.weight"] = head
    for name in list(tensors):
        if name.endswith("norm.weight") and name.startswith(prefix):
            tensors[name] = torch.ones_like(tensors[name])
        if name.startswith(f"{prefix}.layers.") and name.endswith(("o_proj.weight", "down_proj.weight")):
            tensors[name] = tensors[name].float() * 0.01

    # Layer 0, head 0: attend to position p-1 and copy the flag into dim _FLAG_OUT.
    attn = f"{prefix}.layers.0.self_attn"
    d = spec.head_dim
    q = torch.zeros(d)
    for i in range(3):  # the three fastest rotary frequencies; amplitude sets the sharpness
        q[i] = 12.0
    cos, sin = RotaryEmbedding(spec.rope).cos_sin(torch.ones(3, 1, dtype=torch.long), torch.float32)
    k = apply_rotary(q.view(1, 1, d), cos, sin).view(d)
    qw, qb = tensors[f"{attn}.q_proj.weight"].float(), tensors[f"{attn}.q_proj.bias"].float()
    kw, kb = tensors[f"{attn}.k_proj.weight"].float(), tensors[f"{attn}.k_proj.bias"].float()
    vw, vb = tensors[f"{attn}.v_proj.weight"].float(), tensors[f"{attn}.v_proj.bias"].float()
    ow = tensors[f"{attn}.o_proj.weight"].float()
    per_kv = spec.num_heads // spec.num_kv_heads
    qw[:d * per_kv], qb[:d * per_kv] = 0, 0  # heads sharing key/value head 0
    qb[:d] = q
    kw[:d], kb[:d] = 0, k
    vw[:d], vb[:d] = 0, 0
    vw[0, _FLAG_IN] = 1.0
    ow[:, :d * per_kv] = 0
    ow[_FLAG_OUT, 0] = 1.0
    # Nothing else writes the flag dims.
    for name in list(tensors):
        if name.startswith(f"{prefix}.layers.") and name.endswith(("o_proj.weight", "down_proj.weight")):
            w = ow if name == f"{attn}.o_proj.weight" else tensors[name].float()
            w[_FLAG_IN] = 0
            if name != f"{attn}.o_proj.weight":
                w[_FLAG_OUT] = 0
            tensors[name] = w
    tensors.update({f"{attn}.q_proj.weight": qw, f"{attn}.q_proj.bias": qb, f"{attn}.k_proj.weight": kw,
                    f"{attn}.k_proj.bias": kb, f"{attn}.v_proj.weight": vw, f"{attn}.v_proj.bias": vb})
    for name, t in tensors.items():
        if not name.endswith("e_score_correction_bias"):
            tensors[name] = t.to(torch.bfloat16)


def _hub_order(name: str):
    """Numeric layer/expert order like the Hub shards, so one layer's experts may span two files."""
    return [int(p) if p.isdigit() else p for p in name.split(".")]


def _write_shards(out: Path, tensors: dict) -> None:
    """SHARDS files named like transformers' (model-0000i-of-0000n) of about equal bytes + the index."""
    from safetensors.torch import save_file

    from ..engine.weights.safetensors_files import INDEX_NAME

    out.mkdir(parents=True, exist_ok=True)
    sizes = {n: t.numel() * t.element_size() for n, t in tensors.items()}
    target, acc = sum(sizes.values()) / SHARDS, 0
    groups: list[dict] = [{} for _ in range(SHARDS)]
    for name, t in tensors.items():
        groups[min(int(acc // target), SHARDS - 1)][name] = t.contiguous()
        acc += sizes[name]
    weight_map = {}
    for i, group in enumerate(groups):
        fname = f"model-{i + 1:05d}-of-{SHARDS:05d}.safetensors"
        save_file(group, str(out / fname), metadata={"format": "pt"})
        weight_map.update(dict.fromkeys(group, fname))
    _write_json(out / INDEX_NAME, {"metadata": {"total_size": sum(sizes.values())}, "weight_map": weight_map})


def _write_json(path: Path, obj: dict) -> None:
    path.write_text(json.dumps(obj, indent=2, sort_keys=True) + "\n")
