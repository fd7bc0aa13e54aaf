"""Where one decode step's GPU time goes: the kernels of an eager decode step of a registered
model (full width, a few layers, random weights), grouped by name, with counts per layer.
    python bench/profile_step.py gpt-oss-120b --layers 4 --batch 1
"""
import argparse

import torch
from torch.profiler import ProfilerActivity, profile

from localchat.app.bench import dummy_model
from localchat.engine.runtime.forward_batch import ForwardBatch
from localchat.engine.runtime.kv_cache import PagedKVCache

p = argparse.ArgumentParser()
p.add_argument("models")
p.add_argument("--layers", type=int, default=4)
p.add_argument("--batch", type=int, default=1)
p.add_argument("--context", type=int, default=512)
p.add_argument("--trace", action="store_true", help="also list the step's kernels in launch order")
args = p.parse_args()
for name in args.models.split(","):
    spec, _, model = dummy_model(name, args.layers)
    blocks = -(-(args.context + 1) // 16)
    cache = PagedKVCache(spec.num_layers, blocks * args.batch, 16, spec.num_kv_heads, spec.head_dim,
                         torch.bfloat16, "cuda")
    tables = [list(range(i * blocks, (i + 1) * blocks)) for i in range(args.batch)]
    pos = torch.full((args.batch,), args.context)
    if spec.family == "glm4v_moe":
        pos = pos.expand(3, -1)
    batch = ForwardBatch.build([(t, args.context, 1) for t in tables], pos, 16, "cuda")
    ids = torch.randint(1000, 100000, (args.batch,), device="cuda")

    def step():
        return model.logits(model.forward(model.embed(ids), batch, cache))

    with torch.inference_mode():
        for _ in range(3):
            step()
        torch.cuda.synchronize()
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            step()
            torch.cuda.synchronize()
    rows = [e for e in prof.key_averages() if e.device_type.name == "CUDA"]
    rows.sort(key=lambda e: -e.device_time_total)
    total = sum(e.device_time_total for e in rows)
    print(f"{name}: {args.layers} layers, batch {args.batch}: {sum(e.count for e in rows)} kernels, "
          f"{total:.0f} us of kernel time in one eager step")
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
