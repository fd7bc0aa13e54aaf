"""Short turns late in long conversations, through the Engine (random weights in the native format,
on the GPU): the engine's choice of attention kernels ("engine's choice": the short-chunk kernel,
kernels/attention_short.py, for full-attention steps of a few queries a sequence, the decode or
short-chunk kernel for the decoding rows beside a long chunk) against the paged prefill kernel for
every prefill step ("paged only"), in one process, in turns (each with its own captured chunk
graphs):
- a turn of N tokens after a conversation of H tokens held in the prefix cache: its first token;
- the same turn arriving while `--answering` chats of H tokens decode: its first token, and the
  longest gap between the answering chats' tokens meanwhile.

    python bench/bench_short_turns.py MODEL [--layers N] [--history 2048,8192,30720] [--turns 16,64]
        [--answering 8] [--reps 3] [--shared on|off]

Medians over --reps turns; every conversation of one history length shares its first H tokens,
so the cache holds them once; each turn's own tokens are new.
"""
from __future__ import annotations

import argparse
import statistics

from localchat.app.bench import _finals, _request, dummy_model, first_token_beside_answers, make_engine
from localchat.engine.layers import attention as attention_layer
from localchat.engine.runtime.chunk_graphs import ChunkGraphs
from localchat.engine.runtime.request import TextPart
from localchat.engine.weights.loader import weight_bytes


def turn(history: int, n: int, gen_len: int = 1):
    """A request: the shared history of `history` tokens, then n new ones."""
    return _request(gen_len, TextPart(f"history:{history}:7"), TextPart(f"tokens:{n}"))


def ttft_alone(engine, history: int, n: int, reps: int) -> float:
    return statistics.median(_finals([engine.submit(turn(history, n))])[0].timings.ttft for _ in range(reps))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("model")
    p.add_argument("--layers", type=int, default=None)
    p.add_argument("--history", default="2048,8192,30720", help="tokens of the conversation before the turn")
    p.add_argument("--turns", default="16,64", help="tokens of the turn")
    p.add_argument("--answering", type=int, default=8)
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("--shared", choices=("on", "off"), default=None,
                   help="SHARED_CAPTURED_STEPS on the engine's side (default: the engine's own): whether graph "
                        "steps past the short-chunk kernel's bound share their sequences between both kernels")
    args = p.parse_args()
    histories = [int(v) for v in args.history.split(",")]
    turns = [int(v) for v in args.turns.split(",")]
    spec, weights, model = dummy_model(args.model, args.layers)
    # the histories once each (shared by every conversation of that length), every chat's own tokens
    # and room for the prefix cache to keep them
    kv_tokens = 2 * sum(histories) + 4 * (args.answering + 1) * (max(turns) + 512)
    engine = make_engine(spec, model, weight_bytes(weights), max(histories) + max(turns), 400,
                         args.answering + 1, 0, None, kv_tokens)
    default = attention_layer.SHORT_CHUNK_KERNEL, attention_layer.MIXED_SPLIT_MIN_KEYS
    # (SHORT_CHUNK_KERNEL, MIXED_SPLIT_MIN_KEYS) of each side: paged only has the switch off and no step cut
    routes = {"short": (True, default[1]), "paged": (False, 1 << 62)}
    attention_layer.SHORT_CHUNK_KERNEL = True  # the warmup's graphs hold the short-chunk kernel
    if args.shared is not None:
        attention_layer.SHARED_CAPTURED_STEPS = args.shared == "on"
    seconds = engine.warmup()
    short_graphs = engine.runner.chunks
    paged_graphs = ChunkGraphs(model, engine.cache, short_graphs.dtype, short_graphs.device, **short_graphs.shape)
    attention_layer.SHORT_CHUNK_KERNEL, attention_layer.MIXED_SPLIT_MIN_KEYS = routes["paged"]
    engine.run_on_engine_thread(paged_graphs.capture_all)
    print(f"{args.model} ({spec.num_layers} layers): warmup {seconds:.1f} s, chunk graphs {short_graphs.sizes}, "
          f"the paged kernel's captured in {paged_graphs.capture_seconds:.2f} s", flush=True)
    for h in histories:  # the history into the prefix cache; compiles every shape the turns take
        for kernel in ("paged", "short"):
            attention_layer.SHORT_CHUNK_KERNEL, attention_layer.MIXED_SPLIT_MIN_KEYS = routes[kernel]
            for n in turns:
                ttft_alone(engine, h, n, 1)
    for kernel in ("paged", "short", "paged", "short"):
        attention_layer.SHORT_CHUNK_KERNEL, attention_layer.MIXED_SPLIT_MIN_KEYS = routes[kernel]
        engine.runner.chunks = short_graphs if kernel == "short" else paged_graphs
        for h in histories:
            for n in turns:
                alone = ttft_alone(engine, h, n, args.reps)
                ttft, gap = first_token_beside_answers(engine, lambda: turn(h, n), lambda: turn(h, 16, 400),
                                                       args.answering, args.reps)
                label = "engine's choice" if kernel == "short" else "paged only"
                print(f"  {label:15s}, {n:3d}-token turn after {h:5d}: first token alone {alone * 1e3:7.2f} ms; "
                      f"beside {args.answering} answering chats of {h}: {ttft * 1e3:7.2f} ms, their longest gap "
                      f"{gap * 1e3:7.2f} ms", flush=True)
    attention_layer.SHORT_CHUNK_KERNEL, attention_layer.MIXED_SPLIT_MIN_KEYS = default
    engine.runner.chunks = short_graphs
    engine.shutdown()


if __name__ == "__main__":
    main()
