"""Where one decode step's GPU time goes: the kernels of an eager decode step of a registered
model (full width, a few layers, random weights), grouped by name, with counts per layer;
--prefill N profiles the prefill of one N-token prompt instead (--context C: a chunk of N after
C cached tokens, as a long prompt's later chunks run; --no-cudnn keeps such a chunk's attention on
the paged kernel instead of cuDNN's).
    python bench/profile_step.py gpt-oss-120b --layers 4 --batch 1
    python bench/profile_step.py glm-4.5v-fp8 --layers 4 --prefill 2048
    python bench/profile_step.py glm-4.5v-fp8 --layers 4 --prefill 2048 --context 30720 [--no-cudnn]
--wall also times eager steps with the profiler off (wall time a step, and the host's time to
issue one while the GPU is held busy, so that neither waits for the other): a step whose host
time reaches its wall time is bound by launches, not kernels; a host time near the busy spell
means something in the step waited for the GPU. --host-profile N prints the N functions with the
most host time (cProfile) of one step issued that way.
"""
import argparse
import cProfile
import io
import pstats
import time

import torch
from torch.profiler import ProfilerActivity, profile

from localchat.app.bench import dummy_model
from localchat.engine.layers import attention as attention_layer
from localchat.engine.runtime.forward_batch import ForwardBatch
from localchat.engine.runtime.kv_cache import PagedKVCache

p = argparse.ArgumentParser()
p.add_argument("models")
p.add_argument("--layers", type=int, default=4)
p.add_argument("--batch", type=int, default=1)
p.add_argument("--context", type=int, default=None,
               help="tokens already cached per sequence (default: 512 for a decode step, 0 for a prefill)")
p.add_argument("--trace", action="store_true", help="also list the step's kernels in launch order")
p.add_argument("--prefill", type=int, default=0, help="profile one prompt of this many tokens instead")
p.add_argument("--wall", action="store_true", help="also time steps with the profiler off (wall and host time)")
p.add_argument("--host-profile", type=int, default=0, help="print this many functions of a step's cProfile")
p.add_argument("--no-cudnn", action="store_true", help="prefill attention on the paged kernel even after a long prefix")
args = p.parse_args()
if args.no_cudnn:
    attention_layer._takes_cudnn = lambda *a, **k: False
for name in args.models.split(","):
    spec, _, model = dummy_model(name, args.layers)
    prompt = args.prefill
    seqs, new = (1, prompt) if prompt else (args.batch, 1)
    cached = args.context if args.context is not None else (0 if prompt else 512)
    blocks = -(-(cached + new) // 16)
    cache = PagedKVCache(spec.num_layers, blocks * seqs, 16, spec.num_kv_heads, spec.head_dim,
                         torch.bfloat16, "cuda")
    tables = [list(range(i * blocks, (i + 1) * blocks)) for i in range(seqs)]
    pos = torch.arange(cached, cached + prompt) if prompt else torch.full((seqs,), cached)
    if spec.family == "glm4v_moe":
        pos = pos.expand(3, -1)
    batch = ForwardBatch.build([(t, cached, new) for t in tables], pos, 16, "cuda")
    ids = torch.randint(1000, 100000, (seqs * new,), device="cuda")

    def step():  # a prefill's logits are the last token's only, as the engine takes them
        h = model.forward(model.embed(ids), batch, cache)
        return model.logits(h[-1:] if prompt else h)

    with torch.inference_mode():
        for _ in range(3):
            step()
        torch.cuda.synchronize()
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            step()
            torch.cuda.synchronize()
        if args.wall:
            reps, busy_ms = 10, 200
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            for _ in range(reps):
                step()
            end.record()
            torch.cuda.synchronize()
            wall_us = start.elapsed_time(end) * 1e3 / reps
            host_us = []
            for _ in range(3):
                torch.cuda._sleep(int(busy_ms * 1e-3 * 1.5e9))  # ~busy_ms of GPU cycles at H100/H200 clocks
                t0 = time.perf_counter()
                step()
                host_us.append((time.perf_counter() - t0) * 1e6)
                torch.cuda.synchronize()
        if args.host_profile:
            torch.cuda._sleep(int(0.5 * 1.5e9))
            host = cProfile.Profile()
            host.enable()
            step()
            host.disable()
            torch.cuda.synchronize()
            text = io.StringIO()
            table = pstats.Stats(host).stats  # (file, line, name) -> (calls, calls, own s, cumulative s, callers)
            for title, col in (("own", 2), ("cumulative", 3)):
                print(f"host time by function ({title}, us under cProfile, which adds to it):", file=text)
                for (file, line, fn), row in sorted(table.items(), key=lambda kv: -kv[1][col])[:args.host_profile]:
                    where = "/".join(file.split("/")[-2:])
                    print(f"  {row[3] * 1e6:8.0f} cum {row[2] * 1e6:8.0f} own  x{row[1]:4d}  {where}:{line}({fn})", file=text)
    rows = [e for e in prof.key_averages() if e.device_type.name == "CUDA"]
    rows.sort(key=lambda e: -e.device_time_total)
    total = sum(e.device_time_total for e in rows)
    what = f"a {prompt}-token prefill" if prompt else f"batch {args.batch}"
    what += f" after {cached} cached tokens" if cached else ""
    print(f"{name}: {args.layers} layers, {what}: {sum(e.count for e in rows)} kernels, "
          f"{total:.0f} us of kernel time in one eager step")
    if args.wall:
        print(f"  profiler off: {wall_us:.0f} us wall a step ({wall_us / args.layers:.0f} a layer), "
              f"{min(host_us):.0f} us of host time to issue one (GPU held busy {busy_ms} ms; "
              f"runs {', '.join(f'{h:.0f}' for h in host_us)}), kernels sum {total:.0f} us")
    if args.host_profile:
        print(text.getvalue())
    for e in rows[:25]:
        print(f"  {e.device_time_total:8.1f} us {100 * e.device_time_total / total:5.1f}%  x{e.count:4d} "
              f"({e.count / args.layers:5.1f}/layer)  {e.key[:90]}")
    if args.trace:
        kernels = sorted((e for e in prof.events() if e.device_type.name == "CUDA"), key=lambda e: e.time_range.start)
        t0 = kernels[0].time_range.start if kernels else 0
        for e in kernels:
            print(f"    {e.time_range.start - t0:9.1f} us  {e.time_range.elapsed_us():7.1f} us  {e.name[:80]}")
    del model
    torch.cuda.empty_cache()
