"""A chat answering while a long prompt arrives: the gaps between the answering chat's streamed
tokens while the prompt is read, and the prompt's time to first token, with the steps that carry
decodes held to each budget given (the scheduler's max_batch_tokens_while_decoding) and the
engine's default chunk otherwise. Random weights in the native format, on the GPU.

    python bench/bench_prefill_beside_decodes.py MODEL [--layers N] [--prompt-len 16384] [--caps 2048,8192]

Each budget is timed twice, in turns; the first long prompt (alone) compiles its shapes.
"""
from __future__ import annotations

import argparse
import time

from localchat.app.bench import _finals, _request, dummy_model, make_engine
from localchat.engine.runtime.request import Final, TextPart
from localchat.engine.weights.loader import weight_bytes


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("model")
    p.add_argument("--layers", type=int, default=None)
    p.add_argument("--prompt-len", type=int, default=16384)
    p.add_argument("--caps", default="2048,8192", help="budgets of a step that carries decodes")
    args = p.parse_args()
    spec, weights, model = dummy_model(args.model, args.layers)
    engine = make_engine(spec, model, weight_bytes(weights), args.prompt_len, 600, 2, 0, None)
    engine.warmup()
    long_prompt = TextPart(f"tokens:{args.prompt_len}")
    _finals([engine.submit(_request(4, long_prompt))])  # compiles the long prompt's shapes
    caps = [int(c) for c in args.caps.split(",")]
    for cap in caps * 2:
        engine.scheduler.max_batch_tokens_while_decoding = min(cap, engine.max_batch_tokens)
        answering = iter(engine.submit(_request(600, TextPart("tokens:64"))))
        for _ in range(30):  # well into its answer
            next(answering)
        start = time.perf_counter()
        long = engine.submit(_request(4, long_prompt))
        stamps = [start]
        for item in answering:
            stamps.append(time.perf_counter())
            if isinstance(item, Final) or stamps[-1] - start > 10:
                break
        ttft = _finals([long])[0].timings.ttft
        gaps = [b - a for a, b in zip(stamps, stamps[1:]) if b <= start + ttft]
        print(f"{args.model}: steps beside decodes <= {cap}: the {args.prompt_len}-token prompt's TTFT "
              f"{ttft * 1e3:.0f} ms; the answering chat's gaps meanwhile: max {max(gaps) * 1e3:.0f} ms, mean "
              f"{sum(gaps) / len(gaps) * 1e3:.1f} ms over {len(gaps)} items", flush=True)
        for _ in answering:
            pass
    engine.shutdown()


if __name__ == "__main__":
    main()
