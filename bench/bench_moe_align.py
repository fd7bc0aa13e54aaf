"""moe_align's two paths, launched eagerly as a prefill launches them and timed with events
(mean of 20 after one warm-up), and in a CUDA graph (device time without the host's launch
cost): the one-program kernel and the chunked kernels (_align_by_chunks, two launches), both
checked against moe_align_ref.

    python bench/bench_moe_align.py
"""
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(__file__))
from bench_kernels import event_time_us  # noqa: E402
from bench_moe_sweep import graph_time_us  # noqa: E402

from localchat.kernels import moe_align as ma  # noqa: E402


def main() -> None:
    for e, k, block_m in ((128, 8, 64), (128, 4, 64), (128, 8, 16)):
        for t in (16, 32, 64, 128, 256, 512, 1024, 2048, 4096):
            ids = torch.stack([torch.randperm(e, device="cuda")[:k] for _ in range(t)]).to(torch.int32)
            pairs = ids.numel()
            p_max, b_max = ma.padded_sizes(pairs, e, block_m)

            def kernel():
                return ma._align_by_kernel(ids, e, block_m, p_max, b_max)

            def chunks():
                return ma._align_by_chunks(ids, e, block_m, p_max, b_max)

            ref = ma.moe_align_ref(ids, e, block_m)
            same = {name: torch.equal(got[0], ref[0]) and torch.equal(got[1], ref[1])
                    for name, got in (("kernel", kernel()), ("chunks", chunks()))}
            print(f"E={e} k={k} block_m={block_m} T={t} pairs={pairs}: one-program kernel "
                  f"{event_time_us(kernel, reps=20):.1f} us eager, {graph_time_us([kernel]):.1f} us in a graph; "
                  f"chunks {event_time_us(chunks, reps=20):.1f} us eager, {graph_time_us([chunks]):.1f} us in a graph; "
                  f"equal to the reference: {same}", flush=True)


if __name__ == "__main__":
    main()
