"""The one-launch MoE router (kernels/moe_router.py) against the router linear + routing launches
it replaces, per token count, for gpt-oss (128 experts x 2880, top-4, bf16 logits) and GLM-4.5V
(128 x 4096, top-8, float32 scores). Timed like the MoE kernels: a CUDA graph over 96 routers
(weights rotated out of L2, as in a decode step where the experts' bytes pass between two routers),
median of 10 replays, us per router.

    python bench/bench_router.py [--ts 1,4,8,32] [--tiles 64:1:4,128:1:4,...]   (block_k:block_t:warps)

--prefill times GLM-4.5V's router at prefill sizes instead (eight routers a graph): the float32
linear of float32 copies of the activations and the bf16 weight, as the engine ran it, against
linear_float32 (a 16-bit GEMM writing float32), each followed by the routing launch.
    python bench/bench_router.py --prefill --ts 256,1024,2048,4096
"""
import argparse
import os
import sys

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(__file__))
from bench_moe_sweep import graph_time_us  # noqa: E402

from localchat.engine.layers.linear import linear, linear_float32  # noqa: E402
from localchat.engine.weights.formats import DenseWeight  # noqa: E402
from localchat.kernels.moe_router import router_glm, router_gpt_oss  # noqa: E402
from localchat.kernels.moe_routing import route_glm, route_gpt_oss  # noqa: E402

COPIES = 96
MODELS = {"gpt-oss": (2880, 4), "glm-4.5v": (4096, 8)}


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--ts", default="1,4,8,32")
    p.add_argument("--prefill", action="store_true", help="GLM-4.5V's router at prefill sizes (see above)")
    p.add_argument("--tiles", default="32:1:4,64:1:4,64:1:2,128:1:4,128:1:8,256:1:8,64:2:4,64:4:4,128:4:8")
    args = p.parse_args()
    if args.prefill:
        return prefill(int(v) for v in args.ts.split(","))
    tiles = [tuple(int(v) for v in s.split(":")) for s in args.tiles.split(",")]
    for model, (k_dim, top_k) in MODELS.items():
        ws = [(torch.randn(128, k_dim, device="cuda") / 50).to(torch.bfloat16) for _ in range(COPIES)]
        bs = [(torch.randn(128, device="cuda") / 10).to(torch.bfloat16) for _ in range(COPIES)]
        glm = model.startswith("glm")
        dense = [DenseWeight(w.float() if glm else w) for w in ws]  # what the linear path held
        for t in (int(v) for v in args.ts.split(",")):
            x = torch.randn(t, k_dim, device="cuda").to(torch.bfloat16)
            if glm:
                old = [lambda w=w, b=b: route_glm(linear(x.float(), w), b.float(), top_k) for w, b in zip(dense, bs)]
            else:
                old = [lambda w=w, b=b: route_gpt_oss(linear(x, w, b), top_k) for w, b in zip(dense, bs)]
            base = graph_time_us(old)
            row = [f"{model} T={t}: linear + route {base:.2f} us"]
            best = None
            for bk, bt, warps in tiles:
                if glm:
                    fns = [lambda w=w, b=b: router_glm(x, w, b.float(), top_k, block_k=bk, block_t=bt, num_warps=warps)
                           for w, b in zip(ws, bs)]
                else:
                    fns = [lambda w=w, b=b: router_gpt_oss(x, w, b, top_k, block_k=bk, block_t=bt, num_warps=warps)
                           for w, b in zip(ws, bs)]
                us = graph_time_us(fns)
                row.append(f"{bk}:{bt}:{warps} {us:.2f}")
                if best is None or us < best[0]:
                    best = (us, f"{bk}:{bt}:{warps}")
            # correctness of the best tile against the old path on the last router
            w, b = ws[-1], bs[-1]
            bk, bt, warps = (int(v) for v in best[1].split(":"))
            if glm:
                nw, nids = router_glm(x, w, b.float(), top_k, block_k=bk, block_t=bt, num_warps=warps)
                ow, oids = route_glm(F.linear(x.float(), w.float()), b.float(), top_k)
            else:
                nw, nids = router_gpt_oss(x, w, b, top_k, block_k=bk, block_t=bt, num_warps=warps)
                ow, oids = route_gpt_oss(F.linear(x, w, b), top_k)
            same = (nids.sort(-1).values == oids.sort(-1).values).all(-1).float().mean().item()
            print(" | ".join(row) + f" || best {best[1]} {best[0]:.2f} us ({base / best[0]:.2f}x), "
                  f"tokens with the same experts as the old path: {same:.0%}", flush=True)


def prefill(token_counts):
    k_dim, top_k = MODELS["glm-4.5v"]
    copies = 8
    ws = [DenseWeight((torch.randn(128, k_dim, device="cuda") / 50).to(torch.bfloat16)) for _ in range(copies)]
    bias = (torch.randn(128, device="cuda") / 10).float()
    for t in token_counts:
        x = torch.randn(t, k_dim, device="cuda").to(torch.bfloat16)
        old = [lambda w=w: route_glm(linear(x.to(torch.float32), w), bias, top_k) for w in ws]
        new = [lambda w=w: route_glm(linear_float32(x, w), bias, top_k) for w in ws]
        t_old, t_new = graph_time_us(old), graph_time_us(new)
        ref = x.double() @ ws[0].weight.double().T
        err = {name: ((fn(x, ws[0]).double() - ref).abs().max() / ref.abs().max()).item()
               for name, fn in (("float32 copies", lambda x, w: linear(x.float(), w)), ("linear_float32", linear_float32))}
        _, old_ids = route_glm(linear(x.float(), ws[0]), bias, top_k)
        _, new_ids = route_glm(linear_float32(x, ws[0]), bias, top_k)
        same = (old_ids.sort(-1).values == new_ids.sort(-1).values).all(-1).float().mean().item()
        print(f"glm-4.5v router T={t}: float32 copies + route {t_old:.1f} us, linear_float32 + route {t_new:.1f} us "
              f"({t_old / t_new:.2f}x); logits' max error from float64 {err['float32 copies']:.1e} / "
              f"{err['linear_float32']:.1e}; tokens with the same experts {same:.1%}", flush=True)


if __name__ == "__main__":
    main()
