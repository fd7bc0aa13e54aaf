"""Serving speed of the full-size architectures with random weights in their native formats.

For each model the real Engine (scheduler, CUDA-graph decode, sampling, detokenizer, streams)
serves synthetic requests: per batch size, that many concurrent requests of `--prompt-len`
random tokens each generating `--gen-len` tokens. Reported per batch size: time to first token
(text prompt at batch 1; image prompt for GLM), decode tokens/s per stream and in total, the
replay time of the captured decode graph alone, bytes one decode step must read, and
    floor_ms = bytes_per_step / ceiling_bytes_per_s,  ratio = floor_ms / measured step time.
Random weights end no answer early: end-of-sequence ids are ignored, so every stream runs
`--gen-len` tokens.

Usage: localchat bench gpt-oss-120b --dummy --batch 1,8,32 [--prompt-len 512] [--gen-len 256]
[--image 1024x768] [--layers N] [--compare transformers] [--json FILE]  (several models: comma-separated)
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import statistics
import sys
import time
from pathlib import Path

import torch

from ..engine.model_configs import model_config
from ..engine.models import build_model
from ..engine.runtime.request import ChatRequest, Final, ImagePart, Message, SamplingParams, TextPart
from ..engine.spec import ModelSpec
from ..engine.weights.dummy import dummy_weights
from ..engine.weights.formats import stored_bytes
from ..engine.weights.loader import weight_bytes

COPY_CEILING = 4.27e12  # device-to-device copy on one H200, read + write (DESIGN.md)
BLOCK = 16


def spec_for(name: str, layers: int | None) -> ModelSpec:
    """The registered model's spec, optionally cut to its first `layers` decoder layers."""
    cfg = model_config(name)
    if layers:
        text = cfg.get("text_config", cfg)
        text["num_hidden_layers"] = layers
        if "layer_types" in text:
            text["layer_types"] = text["layer_types"][:layers]
    return ModelSpec.from_config(cfg)


def dummy_model(name: str, layers: int | None):
    """-> (spec, weights, model) of a registered model (first `layers` layers when given) with
    random weights in its native format, built on the GPU."""
    spec = spec_for(name, layers)
    weights = dummy_weights(spec, device="cuda", dtype=torch.bfloat16)
    return spec, weights, build_model(spec, weights, "cuda")


def step_bytes(spec: ModelSpec, weights: dict, batch: int, context: int) -> int:
    """Bytes one decode step reads: every non-expert weight once (the embedding only for the
    batch's rows, vision tower not at all), the routed experts the batch selects (expected
    distinct count under uniform routing), a shared expert folded into their stacks, and the KV
    cache of every sequence."""
    total = 0
    e, k = spec.moe.num_experts, spec.moe.top_k
    distinct = e * (1 - (1 - k / e) ** batch)
    for name, w in weights.items():
        if ".visual." in name:
            continue
        if name.endswith("embed_tokens.weight"):
            total += batch * w.shape[1] * w.element_size()
        elif ".mlp.experts." in name:
            # stacks past the E routed experts hold the folded shared expert, read every step
            per_expert = stored_bytes(w) / w.shape[0]
            total += per_expert * (distinct + w.shape[0] - e)
        else:
            total += stored_bytes(w)
    kv_per_token = 2 * spec.num_kv_heads * spec.head_dim * 2
    for t in spec.layer_types:
        seen = min(context, spec.sliding_window) if t == "sliding" else context
        total += batch * seen * kv_per_token
    return int(total)


def random_image(size: str, seed: int = 0) -> ImagePart:
    import io

    import numpy as np
    from PIL import Image

    w, h = (int(x) for x in size.lower().split("x"))
    pixels = np.random.RandomState(seed).randint(0, 255, (h, w, 3), dtype=np.uint8)
    buf = io.BytesIO()
    Image.fromarray(pixels).save(buf, format="PNG")
    return ImagePart.from_bytes(buf.getvalue())


def _request(gen_len: int, *parts) -> ChatRequest:
    return ChatRequest((Message("user", tuple(parts) or (TextPart("bench"),)),),
                       SamplingParams(temperature=0.0, max_tokens=gen_len))


def _finals(streams) -> list[Final]:
    out = []
    for s in streams:
        final = [item for item in s if isinstance(item, Final)][-1]
        if final.finish_reason not in ("stop", "length"):
            raise RuntimeError(f"a benchmark request ended with {final.finish_reason}: {final.error}")
        out.append(final)
    return out


def first_token_beside_answers(engine, new_request, answering_request, answering: int,
                               reps: int) -> tuple[float, float]:
    """(median time to the first token of new_request() arriving while `answering` chats of
    answering_request() decode, the longest gap between one answering chat's tokens meanwhile)."""
    ttfts, gaps = [], []
    chats = [engine.submit(answering_request()) for _ in range(answering)]
    streams = [iter(c) for c in chats]
    for _ in range(10):  # every answering chat is decoding
        for s in streams:
            next(s)
    for _ in range(reps):
        start = time.perf_counter()
        new = engine.submit(new_request())
        stamps = [start]
        while not new.items.qsize():  # until the new request's first token
            item = next(streams[0])
            stamps.append(time.perf_counter())
            if isinstance(item, Final):
                raise RuntimeError("an answering chat ended: raise its max_tokens")
        ttfts.append(_finals([new])[0].timings.ttft)
        gaps.append(max(b - a for a, b in zip(stamps, stamps[1:])))
    for chat in chats:  # ends them now (an abort), rather than after all their tokens
        chat.close()
    for s in streams:
        for _ in s:
            pass
    return statistics.median(ttfts), statistics.median(gaps)


def graph_replay_ms(engine, batch: int, replays: int = 20) -> float:
    """Median time of one replay of the captured decode graph of `batch`'s bucket (GPU only,
    no host work); the inputs left from the last real step are valid. A lower bound where the
    MoE cost depends on the routing (tensor-core tiles: distinct experts): the chats of a
    random-weight model tend to end on one repeated token, which routes every row alike."""
    graphs = engine.runner.graphs
    size = graphs.bucket(batch)
    if size not in graphs.graphs:
        return float("nan")
    times = []
    for _ in range(replays):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        graphs.graphs[size].replay()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b))
    return sorted(times)[len(times) // 2]


def make_engine(spec: ModelSpec, model, weights_bytes: int, prompt_len: int, gen_len: int, max_batch: int,
                image_tokens: int, chunk: int | None = None, kv_tokens: int | None = None):
    """chunk: the tokens one step may hold, the length of a long prompt's prefill chunks (the
    engine's max_batch_tokens; None: its default); kv_tokens: the KV cache's size (default: room
    for max_batch conversations of prompt_len + gen_len tokens that share nothing)."""
    from ..engine.runtime.engine import Engine
    from .bench_prompts import SyntheticPrompts

    context = prompt_len + gen_len + image_tokens + 64
    tokens = kv_tokens or max_batch * (prompt_len + gen_len + 2 * BLOCK) + 2 * context
    return Engine.from_model(dataclasses.replace(spec, eos_token_ids=()), model, SyntheticPrompts(spec, prompt_len),
                             device="cuda", dtype="bfloat16", max_context=context, name=spec.family,
                             weights_bytes=weights_bytes, max_running=max_batch, max_kv_tokens=tokens,
                             max_batch_tokens=chunk)


def measure_batch(engine, spec, weights, batch: int, prompt_len: int, gen_len: int) -> dict:
    """`batch` concurrent requests. The step time is that of the decode steps in which all of them
    ran (prefill chunks of the later requests, and the tail as streams finish, are left out);
    it includes sampling and streaming the text."""
    before = engine.decode_step_times().get(batch, (0, 0.0))
    streams = [engine.submit(_request(gen_len)) for _ in range(batch)]
    finals = _finals(streams)
    steps, seconds = engine.decode_step_times().get(batch, (0, 0.0))
    if steps == before[0]:
        raise RuntimeError(f"no decode step ran all {batch} requests together; raise --gen-len")
    step_s = (seconds - before[1]) / (steps - before[0])
    per_stream = 1 / step_s
    by = step_bytes(spec, weights, batch, prompt_len + gen_len // 2)
    floor = by / COPY_CEILING
    return dict(batch=batch, prompt_len=prompt_len, gen_len=gen_len,
                ttft_ms=1e3 * sum(f.timings.ttft for f in finals) / batch,
                tok_s_per_stream=per_stream, tok_s_total=per_stream * batch, step_ms=1e3 * step_s,
                graph_ms=graph_replay_ms(engine, batch), step_bytes=by, floor_ms=floor * 1e3,
                floor_ratio=floor / step_s)


def measure_image(engine, size: str, question_tokens: int = 50) -> dict:
    """Time to first token of one image + question (second of two runs: the first compiles)."""
    for seed in (1, 2):  # a different image each run, so nothing comes from the prefix cache
        final = _finals([engine.submit(_request(1, random_image(size, seed), TextPart(f"tokens:{question_tokens}")))])[0]
    t = final.timings
    return dict(image=size, prompt_tokens=final.prompt_tokens, image_encode_ms=t.image_encode * 1e3,
                prefill_ms=t.prefill * 1e3, first_token_ms=t.first_token * 1e3, ttft_ms=t.ttft * 1e3)


def bench_model(name: str, args) -> dict:
    batches = [int(x) for x in args.batch.split(",")]
    t0 = time.perf_counter()
    spec, weights, model = dummy_model(name, args.layers)
    torch.cuda.synchronize()
    total = weight_bytes(weights)
    print(f"{name}: {spec.num_layers} layers, weights {total / 1e9:.1f} GB built in {time.perf_counter() - t0:.1f} s"
          + (f", prefill chunks of {args.chunk} tokens" if args.chunk else ""), flush=True)
    image_tokens = 1100 if (args.image and spec.vision is not None) else 0
    engine = make_engine(spec, model, total, args.prompt_len, args.gen_len, max(batches), image_tokens, args.chunk)
    result = dict(model=name, layers=spec.num_layers, weights_gb=total / 1e9, rows=[], image=None)
    try:
        _finals([engine.submit(_request(4, TextPart("tokens:64")))])  # compiles the prefill kernels
        print(f"  warmed up in {engine.warmup():.1f} s (prefill kernels compiled, decode graphs for batch sizes "
              f"{engine.runner.graphs.sizes} captured)", flush=True)
        ahead = engine.decode_ahead
        for b, one_by_one in [(b, x) for b in batches for x in ((True, False) if args.one_by_one else (False,))]:
            engine.decode_ahead = ahead and not one_by_one
            row = measure_batch(engine, spec, weights, b, args.prompt_len, args.gen_len)
            row["decode_ahead"] = engine.decode_ahead
            result["rows"].append(row)
            print(f"  batch {b:3d}{' (one step at a time)' if one_by_one else ''}: TTFT {row['ttft_ms']:8.1f} ms | {row['tok_s_per_stream']:7.1f} tok/s/stream, "
                  f"{row['tok_s_total']:8.1f} tok/s total | step {row['step_ms']:6.2f} ms (graph alone "
                  f"{row['graph_ms']:6.2f}) | {row['step_bytes'] / 1e9:6.2f} GB/step, floor {row['floor_ms']:.2f} ms, "
                  f"{100 * row['floor_ratio']:5.1f}% of floor", flush=True)
        if args.image and spec.vision is not None:
            result["image"] = img = measure_image(engine, args.image)
            print(f"  image {img['image']} + 50-token question ({img['prompt_tokens']} tokens): TTFT "
                  f"{img['ttft_ms']:.1f} ms = image {img['image_encode_ms']:.1f} + prefill {img['prefill_ms']:.1f} "
                  f"+ first token {img['first_token_ms']:.1f}", flush=True)
    finally:
        engine.shutdown()
    del engine  # its KV cache and graphs, before transformers' copy of the weights needs the room
    torch.cuda.empty_cache()
    if args.compare == "transformers":
        from .bench_compare import compare_transformers

        try:
            result["compare"] = compare_transformers(name, spec, weights, args)
        except torch.cuda.OutOfMemoryError as e:  # report it and go on with the next model
            print(f"  vs transformers: did not fit in GPU memory ({e}); try --compare-layers N", flush=True)
            result["compare"] = None
            torch.cuda.empty_cache()
    del model, weights
    torch.cuda.empty_cache()
    return result


def add_bench_command(subparsers) -> None:
    p = subparsers.add_parser("bench", help="serving speed of a registered model with random weights on the GPU",
                              description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("model", help="glm-4.5v, glm-4.5v-fp8, gpt-oss-20b or gpt-oss-120b (comma-separated for several)")
    p.add_argument("--dummy", action="store_true",
                   help="random weights in the native format, built on the GPU (the only mode so far)")
    p.add_argument("--batch", default="1,8,32")
    p.add_argument("--prompt-len", type=int, default=512)
    p.add_argument("--gen-len", type=int, default=256)
    p.add_argument("--image", default="1024x768", metavar="WxH",
                   help="image size for the image time-to-first-token (GLM-4.5V only; 'none' to skip)")
    p.add_argument("--layers", type=int, default=None, help="truncate the model to this many layers")
    p.add_argument("--chunk", type=int, default=None, metavar="TOKENS",
                   help="tokens one step may hold, i.e. the prefill chunk of a long prompt (default: the engine's, "
                        "8192 on a GPU)")
    p.add_argument("--compare", choices=["transformers"], default=None,
                   help="also time the transformers implementation on the same weights")
    p.add_argument("--compare-layers", type=int, default=None,
                   help="depth for --compare (default: the whole model where its bf16 copy fits, else 8)")
    p.add_argument("--one-by-one", action="store_true",
                   help="also measure each batch with every decode step waiting for the previous one's tokens "
                        "(decode steps launched ahead off)")
    p.add_argument("--json", default=None, metavar="FILE", help="also write the results to FILE")
    p.set_defaults(func=run_bench)


def run_bench(args) -> int:
    if not args.dummy:
        print("localchat: bench needs --dummy for now (random weights; no download)", file=sys.stderr)
        return 2
    if args.chunk is not None and args.chunk < 1:
        print(f"localchat: --chunk must be a positive number of tokens, got {args.chunk}", file=sys.stderr)
        return 2
    if not torch.cuda.is_available():
        print("localchat: bench measures the CUDA path and no CUDA GPU is visible", file=sys.stderr)
        return 2
    if args.image and args.image.lower() == "none":
        args.image = None
    results = [bench_model(name, args) for name in args.model.split(",")]
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=1))
    return 0
