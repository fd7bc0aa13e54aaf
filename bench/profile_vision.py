"""GLM-4.5V's vision tower at full size (random weights) on the GPU: time per image for a few
image sizes, the FLOPs of its matmuls and attention and the rate they ran at, then the kernels of
one encode grouped by name. --before FILE also times the tower of another version of
engine/models/glm4v_vision.py (e.g. `git show REV:engine/models/glm4v_vision.py > FILE`) on the same
weights, in the same run, and compares the outputs.
    python bench/profile_vision.py --grids 1x54x74,1x24x32,1x100x136 [--before FILE]
The first grid is also run in float32, and each bf16 form's distance from it printed.
"""
import argparse
import importlib.util
import os
import sys

import torch
from torch.profiler import ProfilerActivity, profile

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "tests", "kernels"))
from kernel_checks import eager_time_ms  # noqa: E402

from localchat.app.bench import spec_for  # noqa: E402
from localchat.engine.models.glm4v_vision import Glm4vVisionTower  # noqa: E402
from localchat.engine.weights.dummy import dummy_weights, to_device  # noqa: E402

p = argparse.ArgumentParser()
p.add_argument("--model", default="glm-4.5v-fp8")
p.add_argument("--grids", default="1x54x74,1x24x32,1x100x136",
               help="t x h x w patch grids (1x54x74: a 1024x768 photo as the processor resizes it)")
p.add_argument("--before", help="another version of glm4v_vision.py to time beside this one")
p.add_argument("--reps", type=int, default=10)
args = p.parse_args()

spec = spec_for(args.model, 1)
weights = {k: w for k, w in dummy_weights(spec, device="cuda", dtype=torch.bfloat16).items()
           if k.startswith("model.visual.")}
towers = [("now", Glm4vVisionTower(spec.vision, weights, "model.visual"))]
if args.before:
    # imported inside the package, so that its relative imports resolve to this checkout's layers
    mod_spec = importlib.util.spec_from_file_location("localchat.engine.models._vision_before", args.before)
    before = importlib.util.module_from_spec(mod_spec)
    mod_spec.loader.exec_module(before)
    towers.append(("before", before.Glm4vVisionTower(spec.vision, weights, "model.visual")))
tower = towers[0][1]
# the same tower in float32, for how far each bf16 form lands from it (first grid only)
tower32 = Glm4vVisionTower(spec.vision, to_device(weights, "cuda", torch.float32), "model.visual")
v = spec.vision
patch_dim = 3 * v.temporal_patch_size * v.patch_size ** 2


def flops(n: int) -> float:
    """Matmul and attention FLOPs of one encode of n patches (2 per multiply-add)."""
    h, i = v.hidden_size, v.intermediate_size
    per_block = 2 * n * (h * 3 * h + h * h + 3 * h * i) + 4 * n * n * h
    m = v.spatial_merge_size ** 2
    tail = 2 * (n // m) * (h * m * v.out_hidden_size + v.out_hidden_size ** 2 + 3 * v.out_hidden_size * i)
    return v.depth * per_block + 2 * n * patch_dim * h + tail


for g in args.grids.split(","):
    t, h, w = (int(x) for x in g.split("x"))
    grid = torch.tensor([[t, h, w]], device="cuda")
    n = t * h * w
    pixels = torch.randn(n, patch_dim, device="cuda", dtype=torch.bfloat16)
    outs = {}
    for label, tw in towers:
        with torch.no_grad():
            ms = eager_time_ms(lambda: tw(pixels, grid), args.reps, warmups=1)
            outs[label] = tw(pixels, grid).float()
        print(f"grid {g} ({n} patches, ~{w * v.patch_size}x{h * v.patch_size} px), {label}: {ms:.1f} ms, "
              f"{flops(n) / ms / 1e9:.0f} TFLOP/s of {flops(n) / 1e12:.1f} TFLOP", flush=True)
    if len(outs) > 1:
        a, b = outs.values()
        print(f"  outputs rel err {((a - b).norm() / b.norm()).item():.2e}")
    if tower32 is not None:
        with torch.no_grad():
            ref = tower32(pixels.float(), grid)
        print("  rel err against float32: " + ", ".join(
            f"{label} {((o - ref).norm() / ref.norm()).item():.2e}" for label, o in outs.items()))
        tower32 = None
        torch.cuda.empty_cache()

g = args.grids.split(",")[0]
t, h, w = (int(x) for x in g.split("x"))
grid = torch.tensor([[t, h, w]], device="cuda")
pixels = torch.randn(t * h * w, patch_dim, device="cuda", dtype=torch.bfloat16)
with torch.no_grad():
    tower(pixels, grid)
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        tower(pixels, grid)
        torch.cuda.synchronize()
print(prof.key_averages().table(sort_by="cuda_time_total", row_limit=20, max_name_column_width=70))
