"""Decode attention at small batches: time per call against the number of sequence splits and
the key tile, with enough distinct KV caches in rotation that the 50 MB L2 serves none of a
call's reads (bench_kernels.py repeats one call, whose 17-34 MB at batch 1 then partly come
from L2).

    python bench/bench_attention_splits.py [--batches 1,8] [--ctx 8192,512] [--splits 0,32,64,128,256] [--block-n 32,64]
        [--warps 4] [--stages 2] [--max-registers 0,128] [--rotary]

Split count 0 is the default (attention_decode.default_num_splits); 1 finishes the rows in the
split kernel (no combine launch). Every candidate's output is checked against the default's before
it is timed. --rotary times rotary_decode_attention, the form the engine's decode step runs (the
new token's rotation and its key and value counted from registers; not stored, so every call
reads the same cache), whose split kernel holds more registers than the plain one's.
"""
from __future__ import annotations

import argparse
import os
import sys

import torch
from triton.runtime.errors import OutOfResources

sys.path.insert(0, os.path.dirname(__file__))
sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "tests", "kernels"))
from bench_moe_sweep import COPY_CEILING_GBS, copies_out_of_l2, graph_time_us  # noqa: E402
from kernel_checks import rel_err  # noqa: E402

from localchat.kernels.attention_decode import (  # noqa: E402
    default_num_splits, paged_decode_attention, rotary_decode_attention,
)

CASES = [("gpt-oss full", 64, 8, 64, True), ("GLM-4.5V", 96, 8, 128, False)]
BLOCK_SIZE = 16


def paged_kv_rotation(copies: int, bsz: int, ctx_len: int, hkv: int, d: int, block_size: int = BLOCK_SIZE):
    """`copies` random bf16 paged KV caches of bsz sequences of ctx_len tokens, each (k, v, block
    tables [bsz, ctx_len / block_size]) with its pages in random order."""
    blocks = bsz * ctx_len // block_size
    caches = []
    for _ in range(copies):
        k = torch.randn(blocks, block_size, hkv, d, device="cuda", dtype=torch.bfloat16)
        tables = torch.randperm(blocks, device="cuda").view(bsz, -1).to(torch.int32)
        caches.append((k, torch.randn_like(k), tables))
    return caches


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batches", default="1,8")
    parser.add_argument("--ctx", default="8192", help="context lengths, comma-separated")
    parser.add_argument("--splits", default="0,32,64,128,256")
    parser.add_argument("--block-n", default="32,64")
    parser.add_argument("--warps", default="4")
    parser.add_argument("--stages", default="2")
    parser.add_argument("--max-registers", default="0", help="the split kernel's maxnreg (0: the compiler's choice)")
    parser.add_argument("--rotary", action="store_true", help="time rotary_decode_attention (the engine's form)")
    args = parser.parse_args()
    torch.manual_seed(0)
    for ctx_len in (int(c) for c in args.ctx.split(",")):
        run_context(args, ctx_len)


def run_context(args, ctx_len: int) -> None:
    for name, hq, hkv, d, sinks in CASES:
        for bsz in (int(b) for b in args.batches.split(",")):
            kv_bytes = 2 * bsz * ctx_len * hkv * d * 2
            caches = paged_kv_rotation(copies_out_of_l2(kv_bytes), bsz, ctx_len, hkv, d)
            ctx = torch.full((bsz,), ctx_len, dtype=torch.int32, device="cuda")
            q = torch.randn(bsz, hq, d, device="cuda", dtype=torch.bfloat16)
            s = torch.randn(hq, device="cuda") if sinks else None
            attend = _rotary_call(bsz, hkv, d) if args.rotary else paged_decode_attention
            ref = attend(q, *caches[0][:2], caches[0][2], ctx, d ** -0.5, s).float()
            variants = {(int(bn), int(nw), int(ns), int(nr)) for bn in args.block_n.split(",")
                        for nw in args.warps.split(",") for ns in args.stages.split(",")
                        for nr in args.max_registers.split(",")}
            for block_n, warps, stages, regs in sorted(variants):
                for splits in (int(v) for v in args.splits.split(",")):
                    n = splits or default_num_splits(bsz, hkv, ctx_len, block_n, head_dim=d)
                    if n > ctx_len // block_n:
                        continue
                    opts = dict(num_splits=n, block_n=block_n, num_warps=warps, num_stages=stages,
                                max_registers=regs)
                    try:
                        err = rel_err(attend(q, *caches[0][:2], caches[0][2], ctx, d ** -0.5, s, **opts), ref)
                    except OutOfResources:  # the stages of this tile do not fit in shared memory
                        continue
                    us = graph_time_us([lambda c=c, o=opts: attend(q, c[0], c[1], c[2], ctx, d ** -0.5, s, **o)
                                        for c in caches])
                    gbs = kv_bytes / us / 1e3
                    tag = " (default)" if not splits else ""
                    form = "rotary " if args.rotary else ""
                    print(f"{form}{name} B={bsz} ctx={ctx_len} block_n={block_n} w{warps} s{stages} r{regs} "
                          f"splits={n}{tag}: {us:.1f} us, {gbs:.0f} GB/s, {gbs / COPY_CEILING_GBS:.0%} of copy, "
                          f"rel err {err:.1e}", flush=True)
            del caches
            torch.cuda.empty_cache()


def _rotary_call(bsz: int, hkv: int, d: int):
    """paged_decode_attention's signature over rotary_decode_attention: a random new key and value
    per sequence, 64 rotated dimensions (GLM-4.5V's 64 of 128, gpt-oss's 64 of 64) and no cache
    slot, so the cache stays as built."""
    k_new = torch.randn(bsz, hkv, d, device="cuda", dtype=torch.bfloat16)
    v_new = torch.randn_like(k_new)
    angles = torch.rand(bsz, 32, device="cuda") * 6.28
    cos, sin = angles.cos().repeat(1, 2).contiguous(), angles.sin().repeat(1, 2).contiguous()
    slots = torch.full((bsz,), -1, dtype=torch.int32, device="cuda")

    def attend(q, k_cache, v_cache, tables, ctx, scale, sinks, **opts):
        return rotary_decode_attention(q, k_new, v_new, cos, sin, k_cache, v_cache, slots, tables, ctx, scale,
                                       sinks, **opts)
    return attend


if __name__ == "__main__":
    main()
