"""MoE router in one launch for decode-sized batches: router logits (x @ W^T + b) and the top-k
expert choice of moe_routing.py, without a GEMM launch, its split-K reduction and a routing
launch between them.

A router is small (128 experts x 2880-4096 inputs, 0.7-1 MB in bf16) and read once per MoE layer;
at a few tokens the GEMM that computes its logits is pure latency. Here programs take one K slice
of every expert's row (grid: K splits x token blocks), leave their partial logits in a float32
buffer, and count their arrival per token block; the last program of a block to arrive adds the
slices (one fixed-shape reduction, so the sum does not depend on which program arrives last),
adds the bias, and routes the block's tokens with moe_routing.route_token.

Logits as the references compute them: gpt-oss's linear runs in the activations' dtype, so its
logits are rounded to it once, after the bias (ROUND); GLM scores experts in float32 from the
bf16 weights and activations, whose products float32 holds exactly.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from .arrivals import arrival_counts
from .moe_routing import (SCORING_SIGMOID, SCORING_SOFTMAX_TOPK, route_glm_ref, route_gpt_oss_ref, route_token,
                          with_shared_expert)

FUSED_ROUTER_MAX_T = 32  # above this the GEMM + routing launches take over (route_glm / route_gpt_oss)
# Launch shape: a K slice of 64 per program (gpt-oss 45 slices, GLM-4.5V 64), one token per
# program, two warps. H200, weights out of L2 (bench/bench_router.py), against the linear + routing
# launches: gpt-oss 1 token 8.1 -> 5.0 us, 32 tokens 10.2 -> 8.2; GLM-4.5V 12.7 -> 7.6 and 17.8 ->
# 12.2. Slices of 128 with four warps were within 0.3 us at 1-8 tokens and slower at 32.
BLOCK_K = 64
BLOCK_T = 1  # tokens per program; each block of them has its own arrival count
NUM_WARPS = 2


@triton.jit
def _router_kernel(x_ptr, stride_xt, w_ptr, stride_we, b_ptr, sel_bias_ptr, partial_ptr, arrivals_ptr,
                   weights_ptr, ids_ptr, T, E, K, scaling, extra_id,
                   TOP_K: tl.constexpr, K_PAD: tl.constexpr, E_PAD: tl.constexpr, S_PAD: tl.constexpr,
                   NUM_SPLITS: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_K: tl.constexpr,
                   SCORING: tl.constexpr, HAS_BIAS: tl.constexpr, HAS_SEL_BIAS: tl.constexpr,
                   RENORMALIZE: tl.constexpr, ROUND: tl.constexpr, HAS_EXTRA: tl.constexpr):
    """Program (split, token block): partial logits [E] of the block's tokens over K columns
    split * BLOCK_K + [0, BLOCK_K), stored at partial [NUM_SPLITS, T, E_PAD]; the block's last
    program to arrive sums them and routes the tokens (weights [T, TOP_K] float32, ids int32;
    with HAS_EXTRA [T, TOP_K + 1], the last column expert extra_id at weight 1)."""
    split = tl.program_id(0)
    block = tl.program_id(1)
    e = tl.arange(0, E_PAD)
    e_mask = e < E
    k = split * BLOCK_K + tl.arange(0, BLOCK_K)
    k_mask = k < K
    w = tl.load(w_ptr + e[:, None].to(tl.int64) * stride_we + k[None, :], mask=e_mask[:, None] & k_mask[None, :],
                other=0.0).to(tl.float32)
    for i in tl.static_range(BLOCK_T):
        t = block * BLOCK_T + i
        if t < T:
            xv = tl.load(x_ptr + t.to(tl.int64) * stride_xt + k, mask=k_mask, other=0.0).to(tl.float32)
            part = tl.sum(w * xv[None, :], axis=1)
            tl.store(partial_ptr + (split * T + t).to(tl.int64) * E_PAD + e, part)

    tl.debug_barrier()  # every thread's partial logits are stored before the arrival counts
    slot = arrivals_ptr + block
    arrived = tl.atomic_add(slot, 1, sem="acq_rel", scope="gpu")
    if arrived == NUM_SPLITS - 1:
        s = tl.arange(0, S_PAD)
        for i in tl.static_range(BLOCK_T):
            t = block * BLOCK_T + i
            if t < T:
                rows = (s * T + t).to(tl.int64) * E_PAD
                # written by other programs of this launch: read from L2
                parts = tl.load(partial_ptr + rows[:, None] + e[None, :], mask=(s < NUM_SPLITS)[:, None],
                                other=0.0, cache_modifier=".cg")
                logits = tl.sum(parts, axis=0)
                if HAS_BIAS:
                    logits += tl.load(b_ptr + e, mask=e_mask, other=0.0).to(tl.float32)
                if ROUND:
                    logits = logits.to(x_ptr.dtype.element_ty).to(tl.float32)
                route_token(logits, e, e_mask, sel_bias_ptr, weights_ptr, ids_ptr, t, scaling, extra_id, TOP_K,
                            K_PAD, SCORING, HAS_SEL_BIAS, RENORMALIZE, HAS_EXTRA)
        tl.store(slot, 0)


def _router(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, sel_bias: torch.Tensor | None,
            top_k: int, scoring: int, renormalize: bool, scaling: float, round_logits: bool,
            block_k: int, block_t: int, num_warps: int, extra_expert: int | None = None
            ) -> tuple[torch.Tensor, torch.Tensor]:
    if x.dim() != 2 or weight.dim() != 2 or x.shape[1] != weight.shape[1]:
        raise ValueError(f"router input [T, K] and weight [E, K] expected, got {tuple(x.shape)} and "
                         f"{tuple(weight.shape)}")
    t, k_dim = x.shape
    e = weight.shape[0]
    if not 1 <= top_k <= e or e > 1024:
        raise ValueError(f"top_k={top_k} must be in 1..E and E={e} at most 1024")
    if x.stride(-1) != 1 or weight.stride(-1) != 1:
        raise ValueError("the router input and weight must be contiguous along K")
    row = top_k + (extra_expert is not None)
    weights = torch.empty((t, row), dtype=torch.float32, device=x.device)
    ids = torch.empty((t, row), dtype=torch.int32, device=x.device)
    if t == 0:
        return weights, ids
    splits = triton.cdiv(k_dim, block_k)
    blocks = triton.cdiv(t, block_t)
    e_pad = triton.next_power_of_2(e)
    partial = torch.empty((splits, t, e_pad), dtype=torch.float32, device=x.device)
    _router_kernel[(splits, blocks)](
        x, x.stride(0), weight, weight.stride(0), bias if bias is not None else x,
        sel_bias if sel_bias is not None else x, partial, arrival_counts(x.device, blocks), weights, ids,
        t, e, k_dim, float(scaling), -1 if extra_expert is None else extra_expert,
        TOP_K=top_k, K_PAD=triton.next_power_of_2(top_k), E_PAD=e_pad, S_PAD=triton.next_power_of_2(splits),
        NUM_SPLITS=splits, BLOCK_T=block_t, BLOCK_K=block_k, SCORING=scoring, HAS_BIAS=bias is not None,
        HAS_SEL_BIAS=sel_bias is not None, RENORMALIZE=renormalize, ROUND=round_logits,
        HAS_EXTRA=extra_expert is not None, num_warps=num_warps)
    return weights, ids


def router_gpt_oss(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, top_k: int,
                   block_k: int = BLOCK_K, block_t: int = BLOCK_T, num_warps: int = NUM_WARPS
                   ) -> tuple[torch.Tensor, torch.Tensor]:
    """x [T, K], weight [E, K], bias [E] (x's dtype) -> topk_weights [T, k] float32 (softmax over
    the k largest logits, the logits rounded to x's dtype as the linear leaves them) and topk_ids
    [T, k] int32, best first."""
    return _router(x, weight, bias, None, top_k, SCORING_SOFTMAX_TOPK, True, 1.0, True, block_k, block_t,
                   num_warps)


def router_glm(x: torch.Tensor, weight: torch.Tensor, correction_bias: torch.Tensor | None, top_k: int,
               renormalize: bool = True, routed_scaling_factor: float = 1.0, n_group: int = 1,
               topk_group: int = 1, block_k: int = BLOCK_K, block_t: int = BLOCK_T, num_warps: int = NUM_WARPS,
               shared_expert: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """x [T, K], weight [E, K] (any float dtype; products and sums in float32), correction_bias [E]
    float32 (selection only) -> topk_weights [T, k] float32 and topk_ids [T, k] int32 as route_glm;
    with shared_expert, [T, k + 1] whose last column is that expert at weight 1 (a shared expert
    stacked behind the routed ones, so that the MoE kernels run it with them)."""
    if n_group != 1 or topk_group != 1:
        raise NotImplementedError(f"grouped top-k (n_group={n_group}) is not in the kernel; "
                                  "GLM-4.5V uses n_group=1, see route_glm_ref for the grouped math")
    return _router(x, weight, None, correction_bias, top_k, SCORING_SIGMOID, renormalize, routed_scaling_factor,
                   False, block_k, block_t, num_warps, shared_expert)


def router_gpt_oss_ref(x, weight, bias, top_k, block_k=BLOCK_K, block_t=BLOCK_T, num_warps=NUM_WARPS):
    return route_gpt_oss_ref(F.linear(x, weight.to(x.dtype), None if bias is None else bias.to(x.dtype)), top_k)


def router_glm_ref(x, weight, correction_bias, top_k, renormalize=True, routed_scaling_factor=1.0, n_group=1,
                   topk_group=1, block_k=BLOCK_K, block_t=BLOCK_T, num_warps=NUM_WARPS, shared_expert=None):
    w, ids = route_glm_ref(F.linear(x.to(torch.float32), weight.to(torch.float32)), correction_bias, top_k,
                           renormalize, routed_scaling_factor, n_group, topk_group)
    return (w, ids) if shared_expert is None else with_shared_expert(w, ids, shared_expert)
