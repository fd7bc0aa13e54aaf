"""MoE routing: router logits -> (topk_weights, topk_ids) for GLM-4.5V and gpt-oss.

GLM (Glm4vMoeTextTopkRouter; reference/models.md A.4): scores = sigmoid(fp32 logits); the
e_score_correction_bias is added for *selection* only; the weights are the unbiased scores of
the chosen experts, renormalised to sum 1 (norm_topk_prob) and times routed_scaling_factor.
gpt-oss (models.md C.4): top-k of the logits, softmax over the k chosen logits.

One program per token, a loop of k arg-max passes over the (at most 256) experts: no host
syncs, launch shape fixed by T, so it is safe inside a CUDA graph.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

SCORING_SIGMOID = 0
SCORING_SOFTMAX_TOPK = 1
_TAKEN = tl.constexpr(-(1 << 63))  # below every key: masked or already chosen experts


def with_shared_expert(weights: torch.Tensor, ids: torch.Tensor, expert: int) -> tuple[torch.Tensor, torch.Tensor]:
    """weights [T, k] float32, ids [T, k] -> [T, k + 1] each, the last column `expert` at weight 1:
    a shared expert stacked behind the routed ones runs in the same MoE kernels as one more pair
    of every token (what router_glm's and route_glm's shared_expert write in their own launch)."""
    t = ids.shape[0]
    return (torch.cat([weights, weights.new_ones(t, 1)], dim=1),
            torch.cat([ids, torch.full((t, 1), expert, dtype=ids.dtype, device=ids.device)], dim=1))


@triton.jit
def route_token(logits, e, e_mask, bias_ptr, weights_ptr, ids_ptr, t, scaling, extra_id,
                TOP_K: tl.constexpr, K_PAD: tl.constexpr, SCORING: tl.constexpr, HAS_BIAS: tl.constexpr,
                RENORMALIZE: tl.constexpr, HAS_EXTRA: tl.constexpr):
    """One token's router logits (float32 [E_PAD] over experts e, e_mask the real ones) ->
    its TOP_K weights and expert ids, stored in row t of weights_ptr / ids_ptr; HAS_EXTRA: rows of
    TOP_K + 1, whose last column is expert extra_id at weight 1 (a shared expert stacked behind
    the routed ones)."""
    ROW: tl.constexpr = TOP_K + 1 if HAS_EXTRA else TOP_K
    if SCORING == 0:
        scores = tl.sigmoid(logits)
        choice = scores
        if HAS_BIAS:
            choice = scores + tl.load(bias_ptr + e, mask=e_mask, other=0.0).to(tl.float32)
    else:
        scores = logits
        choice = logits
    # One max per pick over keys that pack the choice (its float32 bits made order-preserving as
    # signed integers; + 0.0 turns -0 into +0 so the two tie) above the inverted expert index: the
    # largest choice wins, the lowest index among equal ones, as three reductions per pick did.
    bits = (choice + 0.0).to(tl.int32, bitcast=True)
    ordered = bits ^ ((bits >> 31) & 0x7FFFFFFF)
    last: tl.constexpr = e.shape[0] - 1
    key = (ordered.to(tl.int64) << 32) | (e * -1 + last).to(tl.int64)
    key = tl.where(e_mask, key, _TAKEN)

    kk = tl.arange(0, K_PAD)
    top_ids = tl.zeros((K_PAD,), dtype=tl.int32)
    for j in tl.static_range(TOP_K):
        idx = last - (tl.max(key, axis=0) & 0xFFFFFFFF).to(tl.int32)
        top_ids = tl.where(kk == j, idx, top_ids)
        key = tl.where(e == idx, _TAKEN, key)
    # the chosen experts' scores (unbiased by the correction) in one pass
    top_vals = tl.sum(tl.where(e[None, :] == top_ids[:, None], scores[None, :], 0.0), axis=1)

    k_mask = kk < TOP_K
    if SCORING == 0:
        w = top_vals
        if RENORMALIZE:
            w = w / (tl.sum(tl.where(k_mask, w, 0.0), axis=0) + 1e-20)
        w = w * scaling
    else:
        z = tl.where(k_mask, top_vals, float("-inf"))
        p = tl.exp(z - tl.max(z, axis=0))
        w = p / tl.sum(p, axis=0)
    tl.store(weights_ptr + t * ROW + kk, w, mask=k_mask)
    tl.store(ids_ptr + t * ROW + kk, top_ids, mask=k_mask)
    if HAS_EXTRA:
        tl.store(weights_ptr + t * ROW + TOP_K, 1.0)
        tl.store(ids_ptr + t * ROW + TOP_K, extra_id)


@triton.jit
def _route_kernel(logits_ptr, stride_lt, bias_ptr, weights_ptr, ids_ptr, E, scaling, extra_id,
                  TOP_K: tl.constexpr, E_PAD: tl.constexpr, K_PAD: tl.constexpr,
                  SCORING: tl.constexpr, HAS_BIAS: tl.constexpr, RENORMALIZE: tl.constexpr,
                  HAS_EXTRA: tl.constexpr = False):
    """Program t: token t's routing into rows of TOP_K (HAS_EXTRA: TOP_K + 1, the last column
    expert extra_id at weight 1)."""
    t = tl.program_id(0)
    e = tl.arange(0, E_PAD)
    e_mask = e < E
    logits = tl.load(logits_ptr + t * stride_lt + e, mask=e_mask, other=0.0).to(tl.float32)
    route_token(logits, e, e_mask, bias_ptr, weights_ptr, ids_ptr, t, scaling, extra_id, TOP_K, K_PAD, SCORING,
                HAS_BIAS, RENORMALIZE, HAS_EXTRA)


def _route(logits: torch.Tensor, top_k: int, scoring: int, bias: torch.Tensor | None,
           renormalize: bool, scaling: float, extra_expert: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    if logits.dim() != 2:
        raise ValueError(f"router logits must be [T, E], got {tuple(logits.shape)}")
    t, e = logits.shape
    if not 1 <= top_k <= e or e > 1024:
        raise ValueError(f"top_k={top_k} must be in 1..E and E={e} at most 1024")
    logits = logits if logits.stride(-1) == 1 else logits.contiguous()
    row = top_k + (extra_expert is not None)
    weights = torch.empty((t, row), dtype=torch.float32, device=logits.device)
    ids = torch.empty((t, row), dtype=torch.int32, device=logits.device)
    if t == 0:
        return weights, ids
    has_bias = bias is not None
    _route_kernel[(t,)](
        logits, logits.stride(0), bias if has_bias else logits, weights, ids, e, float(scaling),
        -1 if extra_expert is None else extra_expert,
        TOP_K=top_k, E_PAD=triton.next_power_of_2(e), K_PAD=triton.next_power_of_2(top_k),
        SCORING=scoring, HAS_BIAS=has_bias, RENORMALIZE=renormalize, HAS_EXTRA=extra_expert is not None)
    return weights, ids


def route_glm(logits: torch.Tensor, correction_bias: torch.Tensor | None, top_k: int,
              renormalize: bool = True, routed_scaling_factor: float = 1.0,
              n_group: int = 1, topk_group: int = 1, shared_expert: int | None = None
              ) -> tuple[torch.Tensor, torch.Tensor]:
    """logits [T, E] (fp32 from the router linear), correction_bias [E] fp32 or None.
    Returns topk_weights [T, k] float32 and topk_ids [T, k] int32, best first; with shared_expert,
    [T, k + 1] whose last column is that expert at weight 1 (as with_shared_expert, in the same
    launch)."""
    if n_group != 1 or topk_group != 1:
        raise NotImplementedError(f"grouped top-k (n_group={n_group}) is not in the kernel; "
                                  "GLM-4.5V uses n_group=1, see route_glm_ref for the grouped math")
    return _route(logits, top_k, SCORING_SIGMOID, correction_bias, renormalize, routed_scaling_factor,
                  shared_expert)


def route_gpt_oss(logits: torch.Tensor, top_k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """logits [T, E] (router linear output, bias included). Returns topk_weights [T, k] float32
    (softmax over the k chosen logits) and topk_ids [T, k] int32, best first."""
    return _route(logits, top_k, SCORING_SOFTMAX_TOPK, None, True, 1.0)


def route_glm_ref(logits: torch.Tensor, correction_bias: torch.Tensor | None, top_k: int,
                  renormalize: bool = True, routed_scaling_factor: float = 1.0,
                  n_group: int = 1, topk_group: int = 1, shared_expert: int | None = None
                  ) -> tuple[torch.Tensor, torch.Tensor]:
    scores = logits.to(torch.float32).sigmoid()
    choice = scores if correction_bias is None else scores + correction_bias.to(torch.float32)
    if n_group > 1:
        t, e = choice.shape
        grouped = choice.view(t, n_group, e // n_group)
        group_scores = grouped.topk(2, dim=-1).values.sum(-1)
        keep = torch.zeros_like(group_scores).scatter_(1, group_scores.topk(topk_group, dim=-1).indices, 1.0)
        choice = choice.masked_fill(~keep.bool().repeat_interleave(e // n_group, dim=1), 0.0)
    ids = choice.topk(top_k, dim=-1).indices
    w = scores.gather(1, ids)
    if renormalize:
        w = w / (w.sum(-1, keepdim=True) + 1e-20)
    w, ids = w * routed_scaling_factor, ids.to(torch.int32)
    return (w, ids) if shared_expert is None else with_shared_expert(w, ids, shared_expert)


def route_gpt_oss_ref(logits: torch.Tensor, top_k: int) -> tuple[torch.Tensor, torch.Tensor]:
    vals, ids = logits.to(torch.float32).topk(top_k, dim=-1)
    return torch.softmax(vals, dim=-1), ids.to(torch.int32)
