"""Steps of few tokens from captured chunk graphs against the same steps run eagerly, through the
Engine (random weights in the native format, on the GPU), in one process with the graphs switched
off and on in turns:
- a short prompt's time to first token (one step of N tokens; the warm-up has captured every bucket);
- the same prompt arriving while `--answering` chats decode: its first token, and the longest gap
  between the answering chats' tokens meanwhile (the steps that carry both are the mixed ones).

    python bench/bench_chunk_graphs.py MODEL [--layers N] [--prompts 16,64,128,240] [--answering 8] [--reps 3]
        [--fp8-act-min-pairs P]

Medians over --reps requests of each kind; each prompt is new (nothing from the prefix cache).
"""
from __future__ import annotations

import argparse
import statistics

from localchat.app.bench import _finals, _request, dummy_model, first_token_beside_answers, make_engine
from localchat.engine.runtime.request import TextPart
from localchat.engine.weights.loader import weight_bytes
from localchat.kernels import moe_config


def ttft_alone(engine, n: int, reps: int) -> float:
    return statistics.median(_finals([engine.submit(_request(1, TextPart(f"tokens:{n}")))])[0].timings.ttft
                             for _ in range(reps))


def beside_answers(engine, n: int, answering: int, reps: int) -> tuple[float, float]:
    """(median TTFT of an n-token prompt arriving while `answering` chats decode, the longest gap
    between one answering chat's tokens meanwhile)."""
    return first_token_beside_answers(engine, lambda: _request(1, TextPart(f"tokens:{n}")),
                                      lambda: _request(400, TextPart("tokens:64")), answering, reps)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("model")
    p.add_argument("--layers", type=int, default=None)
    p.add_argument("--prompts", default="16,64,128,240", help="prompt lengths (tokens before the template's)")
    p.add_argument("--answering", type=int, default=8)
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("--fp8-act-min-pairs", type=int, default=None,
                   help="pairs an expert from which FP8 experts take e4m3 activations (kernels/moe_config.py)")
    args = p.parse_args()
    if args.fp8_act_min_pairs is not None:
        moe_config.FP8_ACT_MIN_PAIRS = args.fp8_act_min_pairs
    spec, weights, model = dummy_model(args.model, args.layers)
    engine = make_engine(spec, model, weight_bytes(weights), 512, 400, args.answering + 1, 0, None)
    seconds = engine.warmup()
    chunks = engine.runner.chunks
    print(f"{args.model} ({spec.num_layers} layers): warmup {seconds:.1f} s, chunk graphs {chunks.sizes} "
          f"captured in {chunks.capture_seconds:.2f} s", flush=True)
    lengths = [int(n) for n in args.prompts.split(",")]
    for n in lengths:  # compiles every eager shape these prompts take
        engine.runner.chunks = None
        ttft_alone(engine, n, 1)
        engine.runner.chunks = chunks
    for turn in ("eager", "graphs", "eager", "graphs"):
        engine.runner.chunks = chunks if turn == "graphs" else None
        before = engine.counters()["chunk_graph_steps"]
        for n in lengths:
            alone = ttft_alone(engine, n, args.reps)
            ttft, gap = beside_answers(engine, n, args.answering, args.reps)
            print(f"  {turn:6s} prompt {n:4d} tokens: TTFT alone {alone * 1e3:7.2f} ms; beside {args.answering} "
                  f"answering chats: TTFT {ttft * 1e3:7.2f} ms, their longest gap {gap * 1e3:7.2f} ms", flush=True)
        print(f"  ({engine.counters()['chunk_graph_steps'] - before} chunk-graph steps in this turn)", flush=True)
    engine.runner.chunks = chunks
    engine.shutdown()


if __name__ == "__main__":
    main()
