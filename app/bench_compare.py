"""`localchat bench --compare transformers`: the transformers implementation of the same model on
the same random weights (dequantised to bf16), decoding greedily at batch 1 in the same process,
against this engine at the same depth.

Models whose bf16 copy does not fit beside the engine's are compared on their first layers
(both engines cut to the same depth); the output says so.
"""
from __future__ import annotations

import json
import math
import re
import time

import torch

from ..engine.model_configs import model_config
from ..engine.models import build_model
from ..engine.spec import ModelSpec
from ..engine.weights.formats import DenseWeight

ARCHITECTURES = {"gpt_oss": "GptOssForCausalLM", "glm4v_moe": "Glm4vMoeForConditionalGeneration"}
_LAYER = re.compile(r"\.layers\.(\d+)\.")


def hf_tensors(store: dict, family: str, dtype: torch.dtype = torch.bfloat16):
    """The engine's weight store as transformers' (name, tensor) pairs in `dtype`, one at a time
    (quantised weights dequantised; experts back in transformers' fused layouts)."""
    gates: dict[str, dict[str, torch.Tensor]] = {}
    for name, w in store.items():
        t = w if isinstance(w, torch.Tensor) else (w.weight if isinstance(w, DenseWeight) else w.dequantize(dtype))
        t = t.to(dtype) if t.is_floating_point() else t
        if ".mlp.experts." not in name:
            yield name, t
            continue
        base = name.rsplit(".", 2)[0]  # ...mlp.experts
        proj, kind = name.rsplit(".", 2)[1:]
        if family == "gpt_oss":  # transformers keeps gpt-oss experts as [E, in, out]
            yield (f"{base}.{proj}_bias", t) if kind == "bias" else (f"{base}.{proj}", t.transpose(1, 2))
        elif proj in ("gate_proj", "up_proj"):  # GLM: one [E, 2I, H] tensor, gate rows first
            pair = gates.setdefault(base, {})
            pair[proj] = t
            if len(pair) == 2:
                yield f"{base}.gate_up_proj", torch.cat((pair.pop("gate_proj"), pair.pop("up_proj")), dim=1)
        else:
            yield f"{base}.down_proj", t


def first_layers(store: dict, layers: int) -> dict:
    return {k: v for k, v in store.items() if (m := _LAYER.search(k)) is None or int(m.group(1)) < layers
            or ".visual." in k}


def hf_model(cfg: dict, layers: int, state, device: str = "cuda", dtype: torch.dtype = torch.bfloat16):
    """transformers' model for a config.json dict, cut to `layers`, holding `state` ((name,
    tensor) pairs, copied in one at a time so only one extra tensor exists at once)."""
    import transformers

    cfg = json.loads(json.dumps(cfg))  # a deep copy: the caller's dict stays as it was
    cfg.pop("quantization_config", None)
    text = cfg.get("text_config", cfg)
    text.pop("quantization_config", None)
    text["num_hidden_layers"] = layers
    if "layer_types" in text:
        text["layer_types"] = text["layer_types"][:layers]
    config = transformers.AutoConfig.for_model(**cfg)
    arch = getattr(transformers, ARCHITECTURES[cfg["model_type"]])
    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        with torch.device(device):
            model = arch(config).eval()
    finally:
        torch.set_default_dtype(previous)
    params = model.state_dict()
    unexpected, seen = [], set()
    with torch.no_grad():
        for name, tensor in (state.items() if isinstance(state, dict) else state):
            if name not in params or params[name].shape != tensor.shape:
                unexpected.append(name)
                continue
            params[name].copy_(tensor)
            seen.add(name)
    missing = [k for k in params if k not in seen and "rotary" not in k]
    if missing or unexpected:
        raise RuntimeError(f"transformers' {arch.__name__} does not take these weights: missing {missing[:5]}, "
                           f"unexpected {unexpected[:5]}")
    return model


def hf_decode_tok_s(model, prompt_len: int, gen_len: int) -> float:
    ids = torch.randint(1000, 100000, (1, prompt_len), device="cuda")
    timings = {}
    for n in (1, gen_len + 1):
        with torch.inference_mode():
            model.generate(ids, max_new_tokens=2, min_new_tokens=2, do_sample=False)  # warm
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            model.generate(ids, max_new_tokens=n, min_new_tokens=n, do_sample=False)
            torch.cuda.synchronize()
            timings[n] = time.perf_counter() - t0
    return gen_len / (timings[gen_len + 1] - timings[1])


def compare_depth(spec: ModelSpec, weights: dict, spare_bytes: float = 12e9) -> int:
    """The whole model when its bf16 copy fits in the free GPU memory (less `spare_bytes` for the
    cut engine's KV cache and both engines' activations), else the most layers that fit, at most 8."""
    per_layer: dict[int, int] = {}
    rest = largest = 0
    for name, w in weights.items():
        largest = max(largest, math.prod(w.shape))
        m = _LAYER.search(name)
        if m is None or ".visual." in name:
            rest += math.prod(w.shape)
        else:
            per_layer[int(m.group(1))] = per_layer.get(int(m.group(1)), 0) + math.prod(w.shape)
    # bf16: 2 bytes a parameter, plus one tensor dequantised while copying in (MXFP4 goes through
    # three float32 temporaries of the whole tensor)
    room = (torch.cuda.mem_get_info()[0] - spare_bytes - 12 * largest) / 2 - rest
    fits = int(room // max(per_layer.values()))
    return spec.num_layers if fits >= spec.num_layers else max(1, min(8, fits))


def compare_transformers(name: str, spec: ModelSpec, weights: dict, args) -> dict:
    from .bench import make_engine, measure_batch, spec_for

    layers = args.compare_layers or compare_depth(spec, weights)
    cut_spec = spec_for(name, layers) if layers != spec.num_layers else spec
    cut = first_layers(weights, layers)
    engine = make_engine(cut_spec, build_model(cut_spec, cut, "cuda"), 0, args.prompt_len, args.gen_len, 1, 0)
    try:
        measure_batch(engine, cut_spec, cut, 1, args.prompt_len, 8)  # compiles and captures
        ours = measure_batch(engine, cut_spec, cut, 1, args.prompt_len, args.gen_len)["tok_s_per_stream"]
    finally:
        engine.shutdown()
    model = hf_model(model_config(name), layers, hf_tensors(cut, spec.family))
    theirs = hf_decode_tok_s(model, args.prompt_len, min(args.gen_len, 64))
    del model
    torch.cuda.empty_cache()
    depth = "whole model" if layers == spec.num_layers else f"first {layers} of {spec.num_layers} layers, both engines"
    print(f"  vs transformers {__import__('transformers').__version__} ({depth}), batch 1, "
          f"{args.prompt_len}-token prompt: localchat {ours:.1f} tok/s, transformers {theirs:.1f} tok/s, "
          f"{ours / theirs:.1f}x", flush=True)
    return dict(layers=layers, localchat_tok_s=ours, transformers_tok_s=theirs, speedup=ours / theirs)

