"""What cuDNN's prefill attention costs on a shape it has not seen: torch builds and caches one
cuDNN graph per shape (sequence lengths included), and every new prompt length or cached-prefix
length is a new shape. Times, for GLM-4.5V's and gpt-oss's heads, the first call of
cudnn_prefill_attention at a few new (queries, prefix) shapes against the second call at the same
shape and the paged Triton kernel (whose lengths are runtime arguments: nothing to build).
    python bench/cudnn_shape_probe.py [--shapes QUERIES:PREFIX,...] [--only GLM-4.5V]
"""
from __future__ import annotations

import argparse
import os
import sys
import time

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "tests", "kernels"))
from kernel_checks import paged_cache  # noqa: E402

from localchat.kernels.attention_cudnn import cudnn_prefill_attention  # noqa: E402
from localchat.kernels.attention_decode import gather_paged  # noqa: E402
from localchat.kernels.attention_prefill import paged_prefill_attention  # noqa: E402

CASES = [("GLM-4.5V", 96, 8, 128, False), ("gpt-oss", 64, 8, 64, True)]
SHAPES = [(2048, 8192), (2048, 10240), (2048, 12288), (300, 8500), (301, 8500), (2048, 0), (1999, 0)]


def wall_ms(fn) -> float:
    torch.cuda.synchronize()
    start = time.perf_counter()
    fn()
    torch.cuda.synchronize()
    return (time.perf_counter() - start) * 1e3


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--shapes", default=",".join(f"{q}:{n}" for q, n in SHAPES), help="queries:prefix pairs")
    p.add_argument("--only", default=None, help="one case by name (GLM-4.5V or gpt-oss)")
    args = p.parse_args()
    shapes = [tuple(int(x) for x in pair.split(":")) for pair in args.shapes.split(",")]
    for name, hq, hkv, d, sinks in CASES:
        if args.only and name != args.only:
            continue
        for queries, prefix in shapes:
            ctx = prefix + queries
            k, v, tables, lens = paged_cache([ctx], hkv, d, 16, torch.bfloat16)
            q = torch.randn(queries, hq, d, device="cuda", dtype=torch.bfloat16)
            cu = torch.tensor([0, queries], dtype=torch.int32, device="cuda")
            s = torch.randn(hq, device="cuda") if sinks else None
            a = (q, k, v, tables, lens, cu, queries, d ** -0.5, s, None)
            own = {}
            if prefix == 0:
                own = dict(new_keys=gather_paged(k, tables[0], ctx), new_values=gather_paged(v, tables[0], ctx))
            run = lambda: cudnn_prefill_attention(*a, context_lens_host=[ctx], query_start_host=[0, queries], **own)  # noqa: E731
            first, second, third = wall_ms(run), wall_ms(run), wall_ms(run)
            paged = [wall_ms(lambda: paged_prefill_attention(*a)) for _ in range(3)]
            print(f"{name}, {queries} queries after {prefix} keys: cuDNN first call {first:8.2f} ms, then "
                  f"{second:.2f} / {third:.2f} ms; paged kernel {paged[0]:.2f}, then {paged[1]:.2f} / {paged[2]:.2f} ms",
                  flush=True)


if __name__ == "__main__":
    main()
