"""moe_align's two paths, launched eagerly as a prefill launches them and timed with events
(mean of 20 after one warm-up): the one-program kernel and the sort (_align_by_sort), each
checked against moe_align_ref. Eager times include the host's launch cost, which is what the
sort's ~15 launches pay.

    python bench/bench_moe_align.py
"""
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(__file__))
from bench_kernels import event_time_us  # noqa: E402

from localchat.kernels import moe_align as ma  # noqa: E402


def main() -> None:
    for e, k, block_m in ((128, 8, 64), (128, 4, 64), (128, 8, 16)):
        for t in (16, 32, 64, 128, 256, 512, 2048):
            ids = torch.stack([torch.randperm(e, device="cuda")[:k] for _ in range(t)]).to(torch.int32)
            pairs = ids.numel()
            p_max, b_max = ma.padded_sizes(pairs, e, block_m)

            def kernel():
                return ma._align_by_kernel(ids, e, block_m, p_max, b_max)

            def by_sort():
                return ma._align_by_sort(ids, e, block_m, p_max, b_max)

            got, ref = by_sort(), ma.moe_align_ref(ids, e, block_m)
            ok = torch.equal(got[0], ref[0]) and torch.equal(got[1], ref[1])
            print(f"E={e} k={k} block_m={block_m} T={t} pairs={pairs}: one-program kernel {event_time_us(kernel, reps=20):.1f} us, "
                  f"sort {event_time_us(by_sort, reps=20):.1f} us, sort == reference {ok}", flush=True)


if __name__ == "__main__":
    main()
