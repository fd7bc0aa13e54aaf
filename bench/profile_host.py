"""Where a decode step's host time goes: cProfile of the engine thread over the decode steps in
which all `--batch` chats ran, on a registered model at full width with a few layers (random
weights, CUDA graphs on), so the GPU part is short and the host part shows. With decode steps
launched ahead (the default) the host's share runs beside the GPU's; the per-step figure is then
host work per step, not time added to it.

    python bench/profile_host.py glm-4.5v-fp8,gpt-oss-20b --layers 2 --batch 32
"""
import argparse
import cProfile
import io
import pstats
import time

from localchat.app.bench import _finals, _request, dummy_model, make_engine
from localchat.engine.runtime.engine import Engine
from localchat.engine.weights.loader import weight_bytes

p = argparse.ArgumentParser()
p.add_argument("models")
p.add_argument("--layers", type=int, default=2)
p.add_argument("--batch", type=int, default=32)
p.add_argument("--gen-len", type=int, default=48)
p.add_argument("--top", type=int, default=25)
args = p.parse_args()

for name in args.models.split(","):
    spec, weights, model = dummy_model(name, args.layers)
    engine = make_engine(spec, model, weight_bytes(weights), 512, args.gen_len, args.batch, 0)
    engine.warmup()
    profile, steps, wall = cProfile.Profile(), [0], [0.0]
    plain_step = Engine._step

    def profiled_step(self, plan):
        if len(plan) != args.batch or any(n != 1 for _, n in plan):
            return plain_step(self, plan)
        # with decode steps launched ahead, one call runs a whole run of steps
        start, before = time.perf_counter(), self.runner.counters.graph_steps
        profile.enable()
        try:
            return plain_step(self, plan)
        finally:
            profile.disable()
            steps[0] += max(self.runner.counters.graph_steps - before, 1)
            wall[0] += time.perf_counter() - start

    Engine._step = profiled_step
    try:
        _finals([engine.submit(_request(args.gen_len)) for _ in range(args.batch)])
    finally:
        Engine._step = plain_step
        engine.shutdown()
    print(f"{name}: {args.layers} layers, batch {args.batch}: {steps[0]} decode steps, "
          f"{1e3 * wall[0] / max(steps[0], 1):.2f} ms per step (wall, profiler on)")
    for key in ("tottime", "cumulative"):
        out = io.StringIO()
        pstats.Stats(profile, stream=out).sort_stats(key).print_stats(args.top)
        print(out.getvalue())
