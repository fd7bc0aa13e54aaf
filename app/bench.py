"""Decode speed of the full-size architectures with random weights in their native formats.

For each model and batch size: prefill `--prompt-len` tokens per sequence, then time decode
steps (eager, and replayed as one CUDA graph per step), and compare the bytes one step must read
(weights of the layers it touches + KV cache) with the copy ceiling:
    floor_ms = bytes_per_step / ceiling_bytes_per_s,  ratio = floor_ms / measured_ms.
Usage: localchat bench gpt-oss-120b --dummy --batch 1,8,32 [--prompt-len 512] [--gen-len 64]
[--layers N] [--json FILE]  (several models: comma-separated)
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

from ..engine.model_configs import model_config
from ..engine.models import build_model
from ..engine.runtime.forward_batch import ForwardBatch
from ..engine.runtime.kv_cache import PagedKVCache
from ..engine.spec import ModelSpec
from ..engine.weights.dummy import dummy_weights

COPY_CEILING = 4.27e12  # device-to-device copy on one H200, read + write (DESIGN.md)
BLOCK = 16


def spec_for(name: str, layers: int | None) -> ModelSpec:
    cfg = model_config(name)
    if layers:
        text = cfg.get("text_config", cfg)
        text["num_hidden_layers"] = layers
        if "layer_types" in text:
            text["layer_types"] = text["layer_types"][:layers]
    return ModelSpec.from_config(cfg)


def nbytes(w) -> int:
    tensors = [w] if isinstance(w, torch.Tensor) else [t for t in vars(w).values() if isinstance(t, torch.Tensor)]
    return sum(t.numel() * t.element_size() for t in tensors)


def step_bytes(spec: ModelSpec, weights: dict, batch: int, context: int) -> int:
    """Bytes one decode step reads: every non-expert weight once (the embedding only for the
    batch's rows, vision tower not at all), the routed experts the batch selects (expected
    distinct count under uniform routing), and the KV cache of every sequence."""
    total = 0
    e, k = spec.moe.num_experts, spec.moe.top_k
    distinct = e * (1 - (1 - k / e) ** batch)
    for name, w in weights.items():
        if ".visual." in name:
            continue
        if name.endswith("embed_tokens.weight"):
            total += batch * w.shape[1] * w.element_size()
        elif ".mlp.experts." in name:
            total += nbytes(w) * distinct / e
        else:
            total += nbytes(w)
    kv_per_token = 2 * spec.num_kv_heads * spec.head_dim * 2
    for t in spec.layer_types:
        seen = min(context, spec.sliding_window) if t == "sliding" else context
        total += batch * seen * kv_per_token
    return int(total)


class DecodeBench:
    def __init__(self, spec: ModelSpec, model, batch: int, prompt_len: int, gen_len: int):
        self.spec, self.model, self.b = spec, model, batch
        self.blocks_per_seq = -(-(prompt_len + gen_len + 1) // BLOCK)
        self.cache = PagedKVCache(spec.num_layers, batch * self.blocks_per_seq, BLOCK, spec.num_kv_heads,
                                  spec.head_dim, torch.bfloat16, "cuda")
        self.tables = [list(range(i * self.blocks_per_seq, (i + 1) * self.blocks_per_seq)) for i in range(batch)]
        self.prompt_len = prompt_len

    def prefill(self) -> float:
        """Prefills every sequence (one batch), returns seconds."""
        n = self.prompt_len
        ids = torch.randint(0, 10000, (self.b * n,), device="cuda")
        rope = torch.arange(n).repeat(self.b)
        batch = ForwardBatch.build([(t, 0, n) for t in self.tables], rope, BLOCK, "cuda")
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        h = self.model.forward(self.model.embed(ids), batch, self.cache)
        self.model.logits(h[batch.query_start[1:] - 1]).argmax(-1)
        torch.cuda.synchronize()
        return time.perf_counter() - t0

    def static_batch(self, pos: int) -> ForwardBatch:
        return ForwardBatch.build([(t, pos, 1) for t in self.tables], torch.full((self.b,), pos), BLOCK, "cuda")

    def step(self, tokens, batch):
        h = self.model.forward(self.model.embed(tokens), batch, self.cache)
        return self.model.logits(h).argmax(-1)

    def eager(self, steps: int) -> float:
        tokens = torch.randint(0, 10000, (self.b,), device="cuda")
        pos = self.prompt_len
        batch = self.static_batch(pos)
        self.step(tokens, batch)
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        for i in range(steps):
            tokens = self.step(tokens, self.static_batch(pos + i))
        torch.cuda.synchronize()
        return (time.perf_counter() - t0) / steps

    def graph(self, steps: int) -> float:
        """One captured decode step replayed; positions advance by copying into its inputs."""
        pos = self.prompt_len
        batch = self.static_batch(pos)
        tokens = torch.randint(0, 10000, (self.b,), device="cuda")
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            for _ in range(2):
                self.step(tokens, batch)
        torch.cuda.current_stream().wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            out = self.step(tokens, batch)
        nxt = [self.static_batch(pos + i) for i in range(steps)]
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        for b in nxt:
            batch.slot_mapping.copy_(b.slot_mapping, non_blocking=True)
            batch.context_lens.copy_(b.context_lens, non_blocking=True)
            batch.rope_positions.copy_(b.rope_positions, non_blocking=True)
            graph.replay()
            tokens.copy_(out)
        torch.cuda.synchronize()
        return (time.perf_counter() - t0) / steps


def add_bench_command(subparsers) -> None:
    p = subparsers.add_parser("bench", help="decode speed of a registered model with random weights on the GPU",
                              description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("model", help="glm-4.5v, glm-4.5v-fp8, gpt-oss-20b or gpt-oss-120b (comma-separated for several)")
    p.add_argument("--dummy", action="store_true",
                   help="random weights in the native format, built on the GPU (the only mode so far)")
    p.add_argument("--batch", default="1,8,32")
    p.add_argument("--prompt-len", type=int, default=512)
    p.add_argument("--gen-len", type=int, default=64)
    p.add_argument("--layers", type=int, default=None, help="truncate the model to this many layers")
    p.add_argument("--json", default=None, metavar="FILE", help="also write the rows to FILE")
    p.set_defaults(func=run_bench)


def run_bench(args) -> int:
    if not args.dummy:
        print("localchat: bench needs --dummy for now (random weights; no download)", file=sys.stderr)
        return 2
    if not torch.cuda.is_available():
        print("localchat: bench measures the CUDA path and no CUDA GPU is visible", file=sys.stderr)
        return 2
    rows = []

    for name in args.model.split(","):
        spec = spec_for(name, args.layers)
        t0 = time.perf_counter()
        weights = dummy_weights(spec, device="cuda", dtype=torch.bfloat16)
        model = build_model(spec, weights, "cuda")
        torch.cuda.synchronize()
        print(f"{name}: {spec.num_layers} layers, weights {sum(nbytes(w) for w in weights.values()) / 1e9:.1f} GB "
              f"built in {time.perf_counter() - t0:.1f} s", flush=True)
        for b in [int(x) for x in args.batch.split(",")]:
            with torch.inference_mode():
                bench = DecodeBench(spec, model, b, args.prompt_len, args.gen_len)
                prefill_s = bench.prefill()
                eager_s = bench.eager(min(args.gen_len, 16))
                try:
                    graph_s = bench.graph(args.gen_len)
                except Exception as e:  # report, keep measuring the other sizes
                    print(f"  graph capture failed: {type(e).__name__}: {e}", flush=True)
                    graph_s = float("nan")
            by = step_bytes(spec, weights, b, args.prompt_len + args.gen_len // 2)
            best = min(eager_s, graph_s) if graph_s == graph_s else eager_s
            floor = by / COPY_CEILING
            row = dict(model=name, layers=spec.num_layers, batch=b, prompt_len=args.prompt_len,
                       prefill_ms=prefill_s * 1e3, eager_ms=eager_s * 1e3, graph_ms=graph_s * 1e3,
                       tok_s_per_stream=1 / best, tok_s_total=b / best, step_bytes=by,
                       floor_ms=floor * 1e3, floor_ratio=floor / best)
            rows.append(row)
            print(f"  batch {b:3d}: prefill {row['prefill_ms']:8.1f} ms | step eager {row['eager_ms']:7.2f} ms, "
                  f"graph {row['graph_ms']:7.2f} ms | {row['tok_s_per_stream']:7.1f} tok/s/stream, "
                  f"{row['tok_s_total']:8.1f} tok/s total | {by / 1e9:6.2f} GB/step, floor {row['floor_ms']:.2f} ms, "
                  f"{100 * row['floor_ratio']:5.1f}% of floor", flush=True)
        del model, weights, bench
        torch.cuda.empty_cache()
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=1))
    return 0
