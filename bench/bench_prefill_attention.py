"""Prefill attention at the engine's chunk size (2048 queries) over a paged prefix: the last chunk
of a 2K, 8K and 32K prompt, for GLM-4.5V (96 query / 8 KV heads of 128) and gpt-oss (64 / 8 of 64,
sinks; also a sliding-window layer), in several tiles; --before FILE also times another version of
kernels/attention_prefill.py (e.g. `git show REV:kernels/attention_prefill.py > FILE`), and torch's
SDPA on the same keys laid out contiguously (causal from the first key, so the first chunk only;
it has no sinks) is the baseline. --cudnn also times cuDNN's fused attention on keys gathered out of
the pages, in two parts, prefix and chunk, gathers and merge included (kernels/attention_cudnn.py),
and with no prefix also on the chunk's own keys where the engine has them (no gather).
--chunks sets the queries (several: each timed over every prefix). --short S[:BM[:K[:BN[:W[:P[:ST[:E]]]]]]],...
also times the short-chunk kernel (kernels/attention_short.py: query heads packed into BM-row
tiles, default 64, the keys split S ways, or fewer where a split would get under K keys, BN keys a
step, default 64, W warps, default 4, P programs an SM, default the kernel's, ST pipeline stages,
default 2, E 1: parts no shorter than an even share of the batch's work, 0: of K keys whatever the
batch, default the kernel's EVEN_PARTS), for a few queries after long
prefixes; there a one-query chunk is also timed on the decode kernel. --decoding N puts N more
sequences of one query each (decoding chats, after the same prefix) in front of the chunk, as a
mixed step holds them, and also times the decode kernel on those rows beside the chunk's own call;
--empty N puts N sequences of no query after it (the unused slots of a captured graph's batch):
    python bench/bench_prefill_attention.py --tiles "" --chunks 1,16,64 --prefixes 8192,30720 --short 4,8,16,32
    python bench/bench_prefill_attention.py --tiles "" --chunks 16 --prefixes 30720 --short 8,16 --decoding 8
The Triton kernels are timed in replays of a CUDA graph of 20 calls (--eager: eager calls, host
launch time included, as cuDNN and SDPA always are). TFLOP/s count the causal half: 4 x queries x
mean keys x heads x dim.
    python bench/bench_prefill_attention.py [--before FILE] [--tiles 64:64:4:2,128:64:8:2,...] [--cudnn]
    python bench/bench_prefill_attention.py --tiles "" --cudnn --chunks 256,1024,2048 --prefixes 0,2048,4096
"""
from __future__ import annotations

import argparse
import importlib.util
import os
import sys

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "tests", "kernels"))
from kernel_checks import cuda_time_us, eager_time_ms, prefill_case, rel_err  # noqa: E402

from localchat.kernels.attention_cudnn import cudnn_prefill_attention  # noqa: E402
from localchat.kernels.attention_decode import gather_paged, paged_decode_attention  # noqa: E402
from localchat.kernels.attention_prefill import paged_prefill_attention  # noqa: E402
from localchat.kernels.attention_short import EVEN_PARTS, PROGRAMS_PER_SM, short_prefill_attention  # noqa: E402
from localchat.kernels.gpu_facts import sm_count  # noqa: E402

CASES = [("GLM-4.5V", 96, 8, 128, False, None), ("gpt-oss", 64, 8, 64, True, None),
         ("gpt-oss sliding", 64, 8, 64, True, 128)]


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--before")
    p.add_argument("--tiles", default="64:64:4:2,128:64:8:2,128:64:8:3,128:128:8:2,64:128:4:3,128:32:4:3")
    p.add_argument("--chunks", default="2048")
    p.add_argument("--prefixes", default="0,6144,30720")
    p.add_argument("--cudnn", action="store_true", help="also time cuDNN's attention on gathered keys (prefix, then chunk)")
    p.add_argument("--short", default="", help="S[:BM[:K[:BN[:W[:P[:ST[:E]]]]]]],...: forms of the short-chunk "
                   "kernel to time")
    p.add_argument("--decoding", type=int, default=0, help="sequences of one query each beside the chunk")
    p.add_argument("--eager", action="store_true", help="time eager calls (host launch time included) instead "
                   "of replays of a CUDA graph of 20 calls")
    p.add_argument("--empty", type=int, default=0, help="sequences of no query after the chunk (a captured "
                   "graph's unused slots)")
    args = p.parse_args()
    forms = []
    if args.before:
        spec = importlib.util.spec_from_file_location("localchat.kernels._prefill_before", args.before)
        before = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(before)
        forms.append(("before 64x64 w4 s2", lambda *a: before.paged_prefill_attention(*a)))
    forms.append(("default (prefill_tile)", lambda *a: paged_prefill_attention(*a)))
    for t in filter(None, args.tiles.split(",")):
        bm, bn, w, s = (int(v) for v in t.split(":"))
        forms.append((f"{bm}x{bn} w{w} s{s}", lambda *a, bm=bm, bn=bn, w=w, s=s: paged_prefill_attention(
            *a, block_m=bm, block_n=bn, num_warps=w, num_stages=s)))
    shorts = []
    for v in filter(None, args.short.split(",")):
        given = [int(x) for x in v.split(":")]
        defaults = [64, 0, 64, 4, PROGRAMS_PER_SM, 2, int(EVEN_PARTS)]
        n, bm, sk, bn, w, per_sm, st, even = given + defaults[len(given) - 1:]
        shorts.append((f"{n} splits" + (f" of >= {sk} keys" if sk else "") + f", {bm}x{bn} tiles, {w} warps"
                       + (f", {per_sm} programs an SM" if per_sm != PROGRAMS_PER_SM else "")
                       + (f", {st} stages" if st != 2 else "") + (", parts evened" if even else ""),
                       dict(num_splits=n, split_keys=sk, block_m=bm, block_n=bn, num_warps=w, num_stages=st,
                            per_sm=per_sm, balanced_parts=bool(even))))

    def short_form(*a, per_sm, **kw):
        """short_prefill_attention with per_sm programs an SM over the case's KV heads"""
        programs = max(1, per_sm * sm_count(a[0].device) // a[1].shape[2])
        return short_prefill_attention(*a, programs=programs, **kw)
    for label, kw in shorts:
        forms.append((f"short-chunk kernel, {label}", lambda *a, kw=kw: short_form(*a, **kw)))
    dec = args.decoding
    cases = [(c, int(chunk), prefix) for c in CASES for chunk in args.chunks.split(",")
             for prefix in (int(v) for v in args.prefixes.split(","))]
    for (name, hq, hkv, d, sinks, window), chunk, prefix in cases:
        ctx = prefix + chunk
        a = prefill_case([prefix + 1] * dec + [ctx] + [1] * args.empty, [1] * dec + [chunk] + [0] * args.empty,
                         hkv, hq // hkv, d, 16, torch.bfloat16, sinks, window)
        q, k, v, tables, lens, cu, _, _, s, _ = a
        keys = prefix + chunk / 2 if window is None else min(window, ctx)
        flops = 4 * (chunk * keys + dec * min(prefix + 1, window or ctx)) * hq * d
        print(f"{name}, {chunk} queries after {prefix} keys" + (f", beside {dec} decoding" if dec else "")
              + (f", {args.empty} empty sequences" if args.empty else "") + ":", flush=True)
        first = None
        extra_forms = []
        if shorts and dec == 0 and chunk == 1:
            extra_forms.append(("decode kernel", lambda *a: paged_decode_attention(
                a[0], a[1], a[2], a[3], a[4], a[7], a[8], a[9])))
        if dec:  # the decoding rows on the decode (or short-chunk) kernel, the chunk on its own call
            def split_call(rows_fn, chunk_fn, q, k, v, tables, lens, cu, max_q, scale, s, window):
                out = torch.empty_like(q)
                rows_fn(q[:dec], k, v, tables[:dec], lens[:dec], cu[:dec + 1], 1, scale, s, window, out=out[:dec])
                chunk_fn(q[dec:], k, v, tables[dec:], lens[dec:], cu[dec:] - dec, max_q, scale, s, window,
                         out=out[dec:])
                return out

            def decode_rows(q, k, v, tables, lens, cu, max_q, scale, s, window, out):
                out.copy_(paged_decode_attention(q, k, v, tables, lens, scale, s, window))
            extra_forms.append(("decode kernel + paged kernel",
                                lambda *a: split_call(decode_rows, paged_prefill_attention, *a)))
            for label, kw in shorts:
                short = lambda *b, kw=kw, **o: short_form(*b, **kw, **o)  # noqa: E731
                extra_forms.append((f"short kernel + paged kernel, {label}",
                                    lambda *a, short=short: split_call(short, paged_prefill_attention, *a)))
                extra_forms.append((f"decode kernel + short kernel, {label}",
                                    lambda *a, short=short: split_call(decode_rows, short, *a)))
        for label, fn in forms + extra_forms:
            try:
                out = fn(*a)
                ms = eager_time_ms(lambda: fn(*a)) if args.eager else cuda_time_us(lambda: fn(*a)) / 1e3
            except Exception as e:  # a tile over this GPU's shared memory, say
                print(f"  {label}: failed ({type(e).__name__}: {str(e)[:100]})")
                continue
            first = out if first is None else first
            print(f"  {label}: {ms * 1e3:8.0f} us  {flops / ms / 1e9:5.0f} TFLOP/s  "
                  f"(rel diff from the first form {rel_err(out, first):.1e})", flush=True)
        if args.cudnn and window is None and not dec:
            try:
                extra = dict(context_lens_host=lens.tolist(), query_start_host=[0, chunk])
                out = cudnn_prefill_attention(*a, **extra)
                ms = eager_time_ms(lambda: cudnn_prefill_attention(*a, **extra))
                print(f"  cuDNN on gathered keys, two parts: {ms * 1e3:8.0f} us  {flops / ms / 1e9:5.0f} TFLOP/s  "
                      f"(rel diff from the first form {rel_err(out, first):.1e})", flush=True)
            except Exception as e:
                print(f"  cuDNN on gathered keys, two parts: failed ({type(e).__name__}: {str(e)[:160]})")
        own = ([gather_paged(x, tables[0], ctx) for x in (k, v)] if prefix == 0 and window is None and not dec
               else None)
        if args.cudnn and own is not None:  # [T, Hkv, D], as the layer holds them
            extra = dict(context_lens_host=lens.tolist(), query_start_host=[0, chunk],
                         new_keys=own[0], new_values=own[1])
            out = cudnn_prefill_attention(*a, **extra)
            ms = eager_time_ms(lambda: cudnn_prefill_attention(*a, **extra))
            print(f"  cuDNN on the chunk's own keys (no gather): {ms * 1e3:8.0f} us  "
                  f"{flops / ms / 1e9:5.0f} TFLOP/s  (rel diff from the first form {rel_err(out, first):.1e})",
                  flush=True)
        if own is not None:
            kc, vc = (x.transpose(0, 1)[None].contiguous() for x in own)
            qs = q.transpose(0, 1)[None]
            ms = eager_time_ms(lambda: F.scaled_dot_product_attention(qs, kc, vc, is_causal=True, enable_gqa=True))
            print(f"  torch SDPA (contiguous keys, no sinks): {ms * 1e3:8.0f} us  {flops / ms / 1e9:5.0f} TFLOP/s",
                  flush=True)


if __name__ == "__main__":
    main()
