"""GLM's shared expert moved into its layer's routed-expert stacks, as expert E.

A GLM MoE layer runs one shared expert (the routed experts' shape, models.md A.2) on every token
beside the k routed ones. As its own gated MLP it costs two linears, the gated product and an add
(four launches, ~14 us a layer at one token on an H200, most of it latency); stacked behind the
routed experts it is one more (token, expert) pair of weight 1 in the MoE kernels, whose launches
stream it with the others (bench/profile_step.py; BENCHMARKS.md).

The stacks are copied once at load time, one projection at a time, and the store's entries
replaced, so the old stack is freed before the next is built: the extra memory is one projection's
stack of one layer, and what the old stacks held goes back to the device at the end. Not for
expert parallelism, where the routed experts are split whole across ranks but the shared expert is
cut like a dense MLP.
"""
from __future__ import annotations

import torch

from ..spec import ModelSpec
from .formats import DenseWeight, Fp8Weight, LinearWeight

PROJECTIONS = ("gate_proj", "up_proj", "down_proj")


def _stackable(stack: LinearWeight, one: LinearWeight) -> bool:
    """Whether one [N, K] can join stack [E, N, K] in one record: same format, dtype, scale
    layout and shape."""
    if stack.shape[1:] != one.shape:
        return False
    if isinstance(stack, DenseWeight) and isinstance(one, DenseWeight):
        return stack.weight.dtype == one.weight.dtype
    return (isinstance(stack, Fp8Weight) and isinstance(one, Fp8Weight) and stack.block == one.block
            and one.scale.numel() == stack.scale[0].numel())


def _stacked_with(stack: LinearWeight, one: LinearWeight) -> LinearWeight:
    """stack [E, N, K] and a _stackable one [N, K] -> [E + 1, N, K], one last (a copy)."""
    if isinstance(stack, DenseWeight):
        return DenseWeight(torch.cat([stack.weight, one.weight[None]]))
    scale = one.scale.reshape(stack.scale.shape[1:]).to(stack.scale.dtype)
    return Fp8Weight(torch.cat([stack.weight, one.weight[None]]), torch.cat([stack.scale, scale[None]]), stack.block)


def fold_shared_experts(spec: ModelSpec, weights: dict, prefix: str = "model.language_model") -> list[int]:
    """Moves each MoE layer's shared expert ("<layer>.mlp.shared_experts.*") into its routed stacks
    ("<layer>.mlp.experts.*.weight", [E, ...] -> [E + 1, ...]) in place; the layers whose formats do
    not allow it, and those already folded, are left as they are. -> the layers folded."""
    moe = spec.moe
    if moe is None or moe.num_shared_experts != 1:
        return []
    folded = []
    for i in range(spec.num_layers):
        p = f"{prefix}.layers.{i}.mlp"
        names = [(f"{p}.experts.{proj}.weight", f"{p}.shared_experts.{proj}.weight") for proj in PROJECTIONS]
        if not spec.is_moe_layer(i) or any(s not in weights or e not in weights for e, s in names):
            continue
        if any(weights[e].shape[0] != moe.num_experts for e, _ in names):
            continue
        # every projection checked before any is replaced, so a layer is folded whole or not at all
        if not all(_stackable(weights[e], weights[s]) for e, s in names):
            continue
        for e, s in names:
            weights[e] = _stacked_with(weights[e], weights.pop(s))
        folded.append(i)
    if folded and torch.cuda.is_available() and torch.cuda.is_initialized():
        # The old stacks' memory sits in torch's cache, where the new (one expert larger) stacks
        # cannot reuse it; handed back, it counts as free to the KV cache's budget
        # (torch.cuda.mem_get_info) instead of being lost to it.
        torch.cuda.empty_cache()
    return folded
