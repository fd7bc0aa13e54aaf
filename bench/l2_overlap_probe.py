"""The next linear's weights pulled into L2 on a second stream while latency-bound kernels run.

At batch 1 a decode layer alternates weight streams (q/k/v, o_proj, the experts) with kernels that
read almost nothing (decode attention at short contexts, norms, the router), during which HBM
idles. This probe times a batch-1 attention block of gpt-oss-120b's shapes, q/k/v row GEMV ->
decode attention -> o_proj row GEMV, over enough layer copies that L2 holds none of a layer's
weights when its turn comes, with and without a prefetch kernel forked onto a second stream at
the attention's start that asks for o_proj's weights (all or a leading fraction of them) into L2.

    python bench/l2_overlap_probe.py [--ctx 512,4096]

Prefetch kinds: `bulk` (one cp.async.bulk.prefetch.L2 per CHUNK bytes, sm_90), `bulk-keep` (the
same with an evict_last cache policy), `line` (prefetch.global.L2::evict_last per 128-byte line).
"""
from __future__ import annotations

import argparse
import os
import sys

import torch
import triton
import triton.language as tl

sys.path.insert(0, os.path.dirname(__file__))
from bench_attention_splits import paged_kv_rotation  # noqa: E402
from bench_moe_sweep import graph_time_us  # noqa: E402

from localchat.kernels.attention_decode import paged_decode_attention  # noqa: E402
from localchat.kernels.row_gemv import dense_gemv  # noqa: E402

_ASM = {
    0: "{ .reg .pred p; setp.ne.b32 p, $2, 0; @p cp.async.bulk.prefetch.L2.global [$1], CHUNK; mov.b32 $0, 0; }",
    1: "{ .reg .pred p; .reg .b64 pol; setp.ne.b32 p, $2, 0; createpolicy.fractional.L2::evict_last.b64 pol, 1.0; "
       "@p cp.async.bulk.prefetch.L2.global.L2::cache_hint [$1], CHUNK, pol; mov.b32 $0, 0; }",
    2: "{ .reg .pred p; setp.ne.b32 p, $2, 0; @p prefetch.global.L2::evict_last [$1]; mov.b32 $0, 0; }",
}
KINDS = {"bulk": 0, "bulk-keep": 1, "line": 2}


def make_kernel(mode: int, chunk: int):
    asm = tl.constexpr(_ASM[mode].replace("CHUNK", str(chunk)))

    @triton.jit
    def _prefetch_kernel(src_ptr, nbytes, per_program, STEP: tl.constexpr, R: tl.constexpr):
        p = tl.program_id(0)
        base = p.to(tl.int64) * per_program
        for i in range(0, per_program, R * STEP):
            offs = base + i + tl.arange(0, R).to(tl.int64) * STEP
            ok = (offs < nbytes) & (offs < base + per_program)
            addr = (src_ptr + offs).to(tl.uint64, bitcast=True)
            tl.inline_asm_elementwise(asm, "=r,l,r", [addr, ok.to(tl.int32)], dtype=tl.int32, is_pure=False, pack=1)
    return _prefetch_kernel


def prefetch(kernel, buf: torch.Tensor, nbytes: int, step: int, programs: int) -> None:
    per_program = triton.cdiv(triton.cdiv(nbytes, programs), step) * step
    kernel[(programs,)](buf, nbytes, per_program, STEP=step, R=32, num_warps=1)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--ctx", default="512,4096")
    parser.add_argument("--copies", type=int, default=6)
    args = parser.parse_args()
    torch.manual_seed(0)
    hidden, hq, hkv, d = 2880, 64, 8, 64
    dt = torch.bfloat16
    layers = [(torch.randn((hq + 2 * hkv) * d, hidden, device="cuda", dtype=dt) * 0.02,
               torch.randn(hidden, hq * d, device="cuda", dtype=dt) * 0.02) for _ in range(args.copies)]
    x = torch.randn(1, hidden, device="cuda", dtype=dt)
    xo = torch.randn(1, hq * d, device="cuda", dtype=dt)
    sinks = torch.randn(hq, device="cuda")
    side = torch.cuda.Stream()
    kernels = {}
    for ctx in [int(c) for c in args.ctx.split(",")]:
        caches = paged_kv_rotation(args.copies, 1, ctx, hkv, d)
        lens = torch.full((1,), ctx, device="cuda", dtype=torch.int32)

        def block(i, pre=None):
            wqkv, wo = layers[i]
            k, v, tables = caches[i]
            qkv = dense_gemv(x, wqkv)
            main = torch.cuda.current_stream()
            if pre is not None:
                side.wait_stream(main)
                with torch.cuda.stream(side):
                    pre(wo)
            a = paged_decode_attention(qkv[:, :hq * d].view(1, hq, d), k, v, tables, lens, d ** -0.5, sinks)
            if pre is not None:
                main.wait_stream(side)
            return dense_gemv(a.view(1, hq * d), wo)

        n = len(layers)
        base = graph_time_us([lambda i=i: block(i) for i in range(n)])
        print(f"ctx {ctx}: q/k/v -> attention -> o_proj {base:.2f} us per block", flush=True)
        parts = {
            "q/k/v alone": [lambda i=i: dense_gemv(x, layers[i][0]) for i in range(n)],
            "o_proj alone (cold)": [lambda i=i: dense_gemv(xo, layers[i][1])
                                    for i in range(n)],
            "o_proj twice on one weight (2nd from L2), per pair": [
                lambda i=i: (dense_gemv(xo, layers[i][1]),
                             dense_gemv(xo, layers[i][1])) for i in range(n)],
            "attention alone": [lambda i=i: paged_decode_attention(
                xo.view(1, hq, d), *caches[i], lens, d ** -0.5, sinks)
                for i in range(n)],
        }
        for name, fns in parts.items():
            print(f"  {name}: {graph_time_us(fns):.2f} us", flush=True)
        for kind, mode in KINDS.items():
            for chunk in ([128] if mode == 2 else [4096, 16384, 65536]):
                key = (mode, chunk)
                if key not in kernels:
                    kernels[key] = make_kernel(mode, chunk)
                for programs in (8, 32, 132):
                    for frac in (1.0, 0.5):
                        nbytes = int(layers[0][1].numel() * 2 * frac) // 16 * 16

                        def pre(wo, kern=kernels[key], nbytes=nbytes, chunk=chunk, programs=programs):
                            prefetch(kern, wo, nbytes, chunk, programs)
                        try:
                            us = graph_time_us([lambda i=i, pre=pre: block(i, pre) for i in range(n)])
                        except Exception as exc:
                            print(f"  {kind} chunk {chunk}: failed {type(exc).__name__}: {str(exc)[:200]}")
                            break
                        print(f"  + prefetch {kind} chunk {chunk} x {programs} programs, {frac:.0%} of o_proj: "
                              f"{us:.2f} us ({base - us:+.2f})", flush=True)


if __name__ == "__main__":
    main()
