"""Mixture-of-experts block: router, routed experts and (GLM) the shared expert.

On CUDA a decode-sized batch is routed in one launch (kernels/moe_router.py); larger batches run
the router's linear through layers/linear.py and then the routing kernel. The experts go through
the MoE kernels on CUDA, and everything through the kernels' torch references (same signatures)
elsewhere.
"""
from __future__ import annotations

import torch

from ...kernels.moe import MoeExperts, fused_moe, fused_moe_ref, gpt_oss_experts, takes_e4m3_input, takes_half2_input
from ...kernels.moe_router import FUSED_ROUTER_MAX_T, router_glm, router_gpt_oss
from ...kernels.moe_routing import route_glm, route_glm_ref, route_gpt_oss, route_gpt_oss_ref
from ..parallel.context import SINGLE, ParallelContext
from ..spec import ModelSpec
from ..weights.formats import DenseWeight
from .linear import linear, linear_float32
from .mlp import GatedMLP


def local_expert_ids(ids: torch.Tensor, start: int, end: int) -> torch.Tensor:
    """Global expert ids [T, k] -> ids into this rank's experts [start, end); -1 for experts other
    ranks hold (the MoE kernels skip those pairs, so they add nothing here)."""
    local = ids - start
    return torch.where((local >= 0) & (local < end - start), local, torch.full_like(local, -1))


class MoeBlock:
    """Routed experts plus (GLM) the shared expert. The router runs whole on every rank. Under
    tensor parallelism the output is this rank's partial sum, which the model all-reduces: each
    rank holds a slice of every expert's intermediate dim (and of the shared expert's), or, with
    expert parallelism, a contiguous range of whole experts. A shared expert folded into the
    routed stacks (weights/shared_expert.py; the model folds it unless experts are split across
    ranks) is their last expert, which route() gives every token at weight 1."""

    def __init__(self, spec: ModelSpec, weights: dict, prefix: str, ctx: ParallelContext = SINGLE):
        m = self.moe = spec.moe
        ex = f"{prefix}.experts"
        if m.router == "sigmoid_bias":
            # GLM scores experts in float32 (sigmoid of x W^T); the bf16 weight is kept, since the
            # one-launch router and linear_float32 both read it as it is.
            self.router = DenseWeight(weights[f"{prefix}.gate.weight"])
            self.router_bias = weights[f"{prefix}.gate.e_score_correction_bias"]
        else:
            self.router = DenseWeight(weights[f"{prefix}.router.weight"])
            self.router_bias = weights[f"{prefix}.router.bias"]
        if m.activation == "swiglu_clamped":
            # gpt-oss keeps gate and up rows interleaved in one tensor: the experts are views of it.
            self.experts = gpt_oss_experts(weights[f"{ex}.gate_up_proj.weight"], weights[f"{ex}.gate_up_proj.bias"],
                                           weights[f"{ex}.down_proj.weight"], weights[f"{ex}.down_proj.bias"],
                                           m.swiglu_alpha, m.swiglu_limit)
        else:
            self.experts = MoeExperts(weights[f"{ex}.gate_proj.weight"], weights[f"{ex}.up_proj.weight"],
                                      weights[f"{ex}.down_proj.weight"])
        # the shared expert either stacked behind the routed ones (weights/shared_expert.py: one more
        # pair of every token in the same kernels) or its own gated MLP
        folded = bool(m.num_shared_experts) and f"{prefix}.shared_experts.gate_proj.weight" not in weights
        self.shared_slot = m.num_experts if folded else None
        self.shared = GatedMLP(weights, f"{prefix}.shared_experts") if m.num_shared_experts and not folded else None
        self.expert_range = ctx.layout(spec).experts if ctx.expert_parallel else None
        held = self.expert_range[1] - self.expert_range[0] if self.expert_range else m.num_experts
        held += 1 if folded else 0
        if self.experts.num_experts != held:
            raise ValueError(f"{ex} holds {self.experts.num_experts} experts, but rank {ctx.rank} of "
                             f"{ctx.world_size} should hold {held}: the weights were cut for another split")

    def route(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """x [T, H] -> routing weights [T, k] float32 and expert ids [T, k]; [T, k + 1] with the
        shared expert stacked behind the routed ones (its slot at weight 1 in the last column)."""
        m, on_gpu = self.moe, x.is_cuda
        if on_gpu and x.shape[0] <= FUSED_ROUTER_MAX_T and x.stride(-1) == 1:
            if m.router == "sigmoid_bias":
                return router_glm(x, self.router.weight, self.router_bias, m.top_k, m.norm_topk_prob,
                                  m.routed_scaling_factor, m.n_group, m.topk_group, shared_expert=self.shared_slot)
            return router_gpt_oss(x, self.router.weight, self.router_bias, m.top_k)
        if m.router == "sigmoid_bias":
            # The correction bias steers only the choice of experts, not their weights.
            logits = linear_float32(x, self.router)
            route = route_glm if on_gpu else route_glm_ref
            return route(logits, self.router_bias, m.top_k, m.norm_topk_prob, m.routed_scaling_factor,
                         m.n_group, m.topk_group, shared_expert=self.shared_slot)
        logits = linear(x, self.router, self.router_bias)
        return (route_gpt_oss if on_gpu else route_gpt_oss_ref)(logits, m.top_k)

    def takes_half2_input(self, num_tokens: int, dtype: torch.dtype, device: torch.device) -> bool:
        """Whether the experts will run these tokens on the MXFP4 packed-f16 kernels, whose input
        form the norm in front can write (add_rms_norm's half2) to save them a launch."""
        return takes_half2_input(self.experts, num_tokens, self.moe.top_k, dtype, device)

    def takes_e4m3_input(self, num_tokens: int, dtype: torch.dtype, device: torch.device) -> bool:
        """Whether the experts quantise these tokens' rows to e4m3 (FP8 tiles at prefill sizes),
        so the norm in front can write them (its e4m3 output, passed as x_e4m3)."""
        pairs_per_token = self.moe.top_k + (self.shared_slot is not None)
        return takes_e4m3_input(self.experts, num_tokens, pairs_per_token, dtype, device)

    def __call__(self, x: torch.Tensor, x_half2: tuple[torch.Tensor, torch.Tensor] | None = None,
                 x_e4m3: tuple[torch.Tensor, torch.Tensor] | None = None) -> torch.Tensor:
        """x [T, H] -> [T, H]; x_half2: x in the packed-f16 kernels' input form, when
        takes_half2_input said so; x_e4m3: x's rows as e4m3, when takes_e4m3_input said so."""
        weights, ids = self.route(x)
        if self.expert_range is not None:
            ids = local_expert_ids(ids, *self.expert_range)
        if x.is_cuda:
            out = fused_moe(x, self.experts, weights, ids, x_half2=x_half2, x_e4m3=x_e4m3)
        else:
            out = fused_moe_ref(x, self.experts, weights, ids)
        if self.shared is not None:
            out = out + self.shared(x)
        return out
