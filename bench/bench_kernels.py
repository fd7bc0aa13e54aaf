"""Kernel benchmark on one GPU: time (CUDA-graph replay), bytes, GB/s, % of the copy ceiling.

    python bench/bench_kernels.py [--only moe,attention,norm] [--sweep]

Each row also times a plain torch baseline in the same run (dequantise + matmul per expert,
gathered-KV SDPA-style attention, eager norm). Byte counts are the floor: the selected (or,
for a batch, distinct) experts' weights and scales, or the KV cache read, once. MoE and
attention rows keep the 50 MB L2 out of the timing: a MoE row is a CUDA graph of 20 calls, each
with its own routing (bytes: the distinct experts averaged over them), an attention row rotates
through enough KV caches that none is still cached when it comes round again.
"""
from __future__ import annotations

import argparse
import os
import sys
import time

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "tests", "kernels"))
from kernel_checks import cuda_time_us, random_glm_weights, random_gpt_oss_experts, with_aligned_scale_rows  # noqa: E402

sys.path.insert(0, os.path.dirname(__file__))
from bench_attention_splits import paged_kv_rotation  # noqa: E402
from bench_moe_sweep import CALLS, copies_out_of_l2, graph_time_us, random_routings  # noqa: E402

from localchat.engine.weights.formats import Fp8Weight, Mxfp4Weight  # noqa: E402
from localchat.kernels.moe import MoeConfig, MoeExperts, expert_slice, fused_moe  # noqa: E402
from localchat.kernels.moe_routing import route_glm, route_gpt_oss  # noqa: E402

COPY_CEILING_GBS = 4270.0  # measured device-to-device copy on one H200 (DESIGN.md)
ROWS: list[str] = []


def measure_copy_gbs() -> float:
    """Device-to-device copy of 2 GiB, bytes read plus written, launched eagerly and timed with
    events (mean of 10 after one warm-up): the method of the 4.27 TB/s in DESIGN.md. Inside a CUDA
    graph the same copy becomes a memcpy node, which on the H200 ran at ~2.7 TB/s."""
    a = torch.empty(2 << 30, dtype=torch.uint8, device="cuda")
    b = torch.empty_like(a)
    return 2 * a.numel() / event_time_us(lambda: b.copy_(a)) / 1e3


def event_time_us(fn, reps: int = 10) -> float:
    fn()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(reps):
        fn()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) * 1000 / reps


def row(kernel: str, size: str, us: float, nbytes: float, base_us: float | None, note: str = "") -> None:
    gbs = nbytes / us / 1e3
    base = f"{base_us:9.1f}" if base_us is not None else "        -"
    line = (f"| {kernel:<28} | {size:<22} | {us:8.1f} | {nbytes / 1e6:9.2f} | {gbs:7.0f} | "
            f"{gbs / COPY_CEILING_GBS:5.0%} | {base} | {note}")
    ROWS.append(line)
    print(line, flush=True)


def _weight_bytes(w) -> int:
    if isinstance(w, Mxfp4Weight):
        return w.blocks[0].numel() + w.scales[0].numel()
    return w.weight[0].numel() * w.weight.element_size() + w.scale[0].numel() * 4


def _torch_moe_baseline(x, experts, w, ids):
    """Dequantise each selected expert to bf16 and run its three matmuls (a per-expert loop)."""
    k = ids.shape[1]
    flat = ids.reshape(-1).long()
    out = torch.zeros_like(x, dtype=torch.float32)
    for e in flat.unique().tolist():
        pairs = (flat == e).nonzero().flatten()
        xe = x[pairs // k]
        g = xe @ expert_slice(experts.gate, e).dequantize(torch.bfloat16).T
        u = xe @ expert_slice(experts.up, e).dequantize(torch.bfloat16).T
        if experts.gate_bias is not None:
            g, u = g + experts.gate_bias[e], u + experts.up_bias[e]
        if experts.activation == "silu_glu":
            a = torch.nn.functional.silu(g) * u
        else:
            g, u = g.clamp(max=experts.limit), u.clamp(-experts.limit, experts.limit)
            a = g * torch.sigmoid(experts.alpha * g) * (u + 1)
        y = a @ expert_slice(experts.down, e).dequantize(torch.bfloat16).T
        if experts.down_bias is not None:
            y = y + experts.down_bias[e]
        out.index_add_(0, pairs // k, y.float() * w.reshape(-1)[pairs, None])
    return out.to(x.dtype)


def _best(x, experts, w, ids, configs):
    best = None
    for cfg in configs:
        try:
            us = cuda_time_us(lambda: fused_moe(x, experts, w, ids, config=cfg))
        except Exception as exc:  # a config that does not compile (shared memory) is skipped
            print(f"  config {cfg} failed: {type(exc).__name__}: {str(exc)[:120]}")
            continue
        print(f"  {cfg}: {us:.1f} us")
        if best is None or us < best[0]:
            best = (us, cfg)
    return best


def _configs(t: int, fmt: str, sweep: bool) -> list[MoeConfig | None]:
    if not sweep:
        return [None]
    block_ks = [256, 128] if fmt == "mxfp4" else [128, 64]
    out: list[MoeConfig | None] = [None]
    shapes = [(16, 16), (16, 32), (16, 64)] if t == 1 else [(16, 32), (16, 64), (32, 32), (32, 64)]
    for bm, bn in shapes:
        for bk in block_ks:
            for dot_scaled in ([True, False] if fmt == "mxfp4" else [True]):
                out.append(MoeConfig(bm, bn, bk, 4, 4, dot_scaled))
    return out


def bench_moe(sweep: bool) -> None:
    cases = [
        ("GLM-4.5V FP8 channel", "fp8_channel", 128, 8, 4096, 1408),
        ("GLM-4.5V FP8 block", "fp8_block", 128, 8, 4096, 1408),
        ("gpt-oss-120b MXFP4", "mxfp4", 128, 4, 2880, 2880),
        ("gpt-oss-20b MXFP4", "mxfp4", 32, 4, 2880, 2880),
    ]
    for name, fmt, e, k, h, i in cases:
        if fmt == "mxfp4":
            experts = random_gpt_oss_experts(e, i, h, bias_dtype=torch.bfloat16, device="cuda")
        else:
            experts = MoeExperts(*random_glm_weights(fmt, e, i, h, device="cuda"))
        per_expert = sum(_weight_bytes(w) for w in (experts.gate, experts.up, experts.down))
        if fmt == "mxfp4":  # scale rows padded to 16 bytes as the loader stores them (the TMA kernels need it)
            experts = with_aligned_scale_rows(experts)
        for t in (1, 8, 32, 64):
            x = torch.randn(t, h, device="cuda", dtype=torch.bfloat16)
            logits = torch.randn(t, e, device="cuda")
            routings = random_routings(fmt, t, e, k)
            w, ids = routings[0]
            distinct = sum(r_ids.unique().numel() for _, r_ids in routings) / CALLS
            nbytes = per_expert * distinct
            do_sweep = sweep and t in (1, 32) and name in ("GLM-4.5V FP8 block", "gpt-oss-120b MXFP4")
            if do_sweep:  # tile candidates on one routing (L2 partly warm), then the winner rotated
                best = _best(x, experts, w, ids, _configs(t, fmt, do_sweep))
                if best is None:
                    print(f"moe {name} T={t}: no config ran")
                    continue
                cfg = best[1]
            else:
                cfg = None
            us = graph_time_us([lambda w=w, ids=ids: fused_moe(x, experts, w, ids, config=cfg) for w, ids in routings])
            base = event_time_us(lambda: _torch_moe_baseline(x, experts, w, ids), reps=3)
            route_us = cuda_time_us(lambda: route_glm(logits, None, k) if fmt != "mxfp4" else route_gpt_oss(logits, k))
            row(f"moe {name}", f"T={t} E={e} k={k}", us, nbytes, base,
                f"{distinct:.0f} experts; routing {route_us:.1f} us; cfg {cfg or 'default'}")
        del experts
        torch.cuda.empty_cache()


def _torch_decode_baseline(q, k_cache, v_cache, tables, ctx_len, scale, window):
    """Gather the pages into contiguous K/V, then SDPA with GQA (sinks left out: SDPA has none)."""
    bsz, hq, d = q.shape
    keys = min(ctx_len, window or ctx_len)
    j = torch.arange(ctx_len - keys, ctx_len, device=q.device)
    block_size = k_cache.shape[1]
    pages = tables.long()[:, j // block_size]  # [B, keys]
    k = k_cache[pages, j % block_size].transpose(1, 2)  # [B, Hkv, keys, D]
    v = v_cache[pages, j % block_size].transpose(1, 2)
    return torch.nn.functional.scaled_dot_product_attention(q[:, :, None], k, v, scale=scale, enable_gqa=True)


def bench_attention() -> None:
    from localchat.kernels.attention_decode import paged_decode_attention

    cases = [("gpt-oss full", 64, 8, 64, True, None), ("gpt-oss sliding", 64, 8, 64, True, 128),
             ("GLM-4.5V", 96, 8, 128, False, None)]
    block_size = 16
    for name, hq, hkv, d, sinks, window in cases:
        for ctx_len in (8192, 32768):
            for bsz in (1, 8, 32):
                keys = min(ctx_len, window or ctx_len)
                nbytes = 2 * bsz * keys * hkv * d * 2
                # a single cache past 8 GB of KV is far larger than L2 anyway
                copies = copies_out_of_l2(nbytes) if bsz * ctx_len * hkv * d * 4 < 8e9 else 1
                caches = paged_kv_rotation(copies, bsz, ctx_len, hkv, d, block_size)
                ctx = torch.full((bsz,), ctx_len, dtype=torch.int32, device="cuda")
                q = torch.randn(bsz, hq, d, device="cuda", dtype=torch.bfloat16)
                s = torch.randn(hq, device="cuda") if sinks else None
                us = graph_time_us([lambda c=c: paged_decode_attention(q, c[0], c[1], c[2], ctx, d ** -0.5, s, window)
                                    for c in caches])
                k0, v0, t0 = caches[0]
                base = cuda_time_us(lambda: _torch_decode_baseline(q, k0, v0, t0, ctx_len, d ** -0.5, window))
                row(f"decode attn {name}", f"B={bsz} ctx={ctx_len}", us, nbytes, base,
                    f"{hq}/{hkv} heads, d={d}; {copies} caches in rotation")
                del caches, k0, v0, t0
        torch.cuda.empty_cache()


def bench_small() -> None:
    from localchat.kernels.fp8_linear import fp8_linear
    from localchat.kernels.rmsnorm import add_rms_norm

    for t, d in ((1, 4096), (32, 4096), (4096, 4096)):
        x, res = (torch.randn(t, d, device="cuda", dtype=torch.bfloat16) for _ in range(2))
        w = torch.rand(d, device="cuda", dtype=torch.bfloat16)
        us = cuda_time_us(lambda: add_rms_norm(x, res, w, 1e-5))

        def eager():
            h = x + res
            hf = h.float()
            return w * (hf * torch.rsqrt(hf.pow(2).mean(-1, keepdim=True) + 1e-5)).to(h.dtype), h

        row("add_rms_norm", f"T={t} D={d}", us, 4 * t * d * 2, cuda_time_us(eager), "read x,res; write out,res")
    from kernel_checks import quantize_fp8_blocks as qb, quantize_fp8_rows as qr
    n, k = 12288, 4096  # GLM-4.5V q_proj
    w32 = torch.randn(n, k, device="cuda") / 64
    for name, fw in (("channel", Fp8Weight(*qr(w32))), ("block", Fp8Weight(*qb(w32), block=(128, 128)))):
        deq = fw.dequantize(torch.bfloat16)
        for m in (1, 32, 2048):
            x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
            us = cuda_time_us(lambda: fp8_linear(x, fw))
            base = cuda_time_us(lambda: x @ fw.dequantize(torch.bfloat16).T)
            row(f"fp8_linear {name}", f"M={m} N={n} K={k}", us, n * k + 2 * m * (n + k), base,
                f"{2 * m * n * k / us / 1e6:.0f} TFLOP/s; bf16 cuBLAS on a bf16 copy "
                f"{cuda_time_us(lambda: x @ deq.T):.1f} us")
        del deq


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--only", default="moe,attention,norm")
    parser.add_argument("--sweep", action="store_true", help="try several tile configs and keep the best")
    args = parser.parse_args()
    torch.manual_seed(0)
    dev = torch.cuda.get_device_properties(0)
    print(f"# {dev.name}, {dev.multi_processor_count} SMs, torch {torch.__version__}, "
          f"{time.strftime('%Y-%m-%d')}")
    print(f"# measured copy ceiling: {measure_copy_gbs():.0f} GB/s (table uses {COPY_CEILING_GBS:.0f})")
    header = ("| kernel | size | us | MB | GB/s | % copy | torch us | notes |\n"
              "|---|---|---|---|---|---|---|---|")
    print(header)
    only = set(args.only.split(","))
    if "moe" in only:
        bench_moe(args.sweep)
    if "attention" in only:
        bench_attention()
    if "norm" in only:
        bench_small()
    print("\n" + header + "\n" + "\n".join(ROWS))
    out = os.environ.get("OUT")
    if out:
        with open(os.path.join(out, "bench_kernels.md"), "w") as f:
            f.write(header + "\n" + "\n".join(ROWS) + "\n")


if __name__ == "__main__":
    main()
