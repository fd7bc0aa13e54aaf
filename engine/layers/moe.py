"""Mixture-of-experts block: router, routed experts and (GLM) the shared expert.

The torch path loops over the experts that received tokens, dequantizing each one's weights;
it is the CPU path and the reference for the fused kernels.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from ...kernels.moe import MoeExperts, fused_moe, gpt_oss_experts
from ...kernels.moe_routing import route_glm, route_gpt_oss
from ..spec import ModelSpec, MoeSpec
from ..weights.formats import LinearWeight
from .mlp import GatedMLP


def route_sigmoid_bias(x: torch.Tensor, gate_weight: torch.Tensor, correction_bias: torch.Tensor,
                       moe: MoeSpec) -> tuple[torch.Tensor, torch.Tensor]:
    """GLM router. x [T, H] -> (weights [T, k] float32, expert ids [T, k]).

    Scores are sigmoid(x W^T) in float32; the correction bias only steers which experts are
    chosen, the weights are the uncorrected scores renormalised over the chosen k."""
    scores = F.linear(x.to(torch.float32), gate_weight.to(torch.float32)).sigmoid()
    choice = scores + correction_bias.to(torch.float32)
    if moe.n_group > 1:
        t, e = choice.shape
        grouped = choice.view(t, moe.n_group, e // moe.n_group)
        group_score = grouped.topk(2, dim=-1).values.sum(-1)
        keep = torch.zeros_like(group_score).scatter_(1, group_score.topk(moe.topk_group, dim=-1).indices, 1.0)
        choice = choice.masked_fill(~keep.bool().repeat_interleave(e // moe.n_group, dim=1), float("-inf"))
    ids = choice.topk(moe.top_k, dim=-1).indices
    weights = scores.gather(1, ids)
    if moe.norm_topk_prob:
        weights = weights / (weights.sum(-1, keepdim=True) + 1e-20)
    return weights * moe.routed_scaling_factor, ids


def route_softmax_topk(x: torch.Tensor, router_weight: torch.Tensor, router_bias: torch.Tensor,
                       moe: MoeSpec) -> tuple[torch.Tensor, torch.Tensor]:
    """gpt-oss router: top-k of the logits, softmax over those k. Returns float32 weights, ids."""
    logits = F.linear(x, router_weight.to(x.dtype), router_bias.to(x.dtype))
    top, ids = logits.topk(moe.top_k, dim=-1)
    return torch.softmax(top.to(torch.float32), dim=-1), ids


def experts_forward(x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor, moe: MoeSpec,
                    gate_up: LinearWeight | None, gate: LinearWeight | None, up: LinearWeight | None,
                    down: LinearWeight, gate_up_bias: torch.Tensor | None = None,
                    down_bias: torch.Tensor | None = None) -> torch.Tensor:
    """x [T, H]; weights, ids [T, k]. Either gate_up [E, 2I, H] with interleaved rows (gpt-oss)
    or separate gate, up [E, I, H] (GLM); down [E, H, I]. Returns sum_k w_k * expert_k(x)."""
    out = torch.zeros_like(x, dtype=torch.float32)
    for e in ids.unique().tolist():
        token, slot = (ids == e).nonzero(as_tuple=True)
        h = x[token]
        if moe.activation == "swiglu_clamped":
            gu = F.linear(h, gate_up[e].dequantize(x.dtype), None if gate_up_bias is None else gate_up_bias[e].to(x.dtype))
            g = gu[:, 0::2].clamp(max=moe.swiglu_limit)
            u = gu[:, 1::2].clamp(-moe.swiglu_limit, moe.swiglu_limit)
            a = g * torch.sigmoid(moe.swiglu_alpha * g) * (u + 1)
        else:
            a = F.silu(F.linear(h, gate[e].dequantize(x.dtype))) * F.linear(h, up[e].dequantize(x.dtype))
        y = F.linear(a, down[e].dequantize(x.dtype), None if down_bias is None else down_bias[e].to(x.dtype))
        out.index_add_(0, token, y.to(torch.float32) * weights[token, slot, None])
    return out.to(x.dtype)


class MoeBlock:
    def __init__(self, spec: ModelSpec, weights: dict, prefix: str):
        self.moe = spec.moe
        ex = f"{prefix}.experts"
        self.gate_up = weights.get(f"{ex}.gate_up_proj.weight")
        self.gate_up_bias = weights.get(f"{ex}.gate_up_proj.bias")
        self.gate = weights.get(f"{ex}.gate_proj.weight")
        self.up = weights.get(f"{ex}.up_proj.weight")
        self.down = weights[f"{ex}.down_proj.weight"]
        self.down_bias = weights.get(f"{ex}.down_proj.bias")
        if self.moe.router == "sigmoid_bias":
            self.router_weight = weights[f"{prefix}.gate.weight"]
            self.router_bias = weights[f"{prefix}.gate.e_score_correction_bias"]
        else:
            self.router_weight = weights[f"{prefix}.router.weight"]
            self.router_bias = weights[f"{prefix}.router.bias"]
        self.shared = GatedMLP(weights, f"{prefix}.shared_experts") if self.moe.num_shared_experts else None
        self.fused = None
        if self.router_weight.is_cuda:
            m = self.moe
            self.fused = (gpt_oss_experts(self.gate_up, self.gate_up_bias, self.down, self.down_bias,
                                          m.swiglu_alpha, m.swiglu_limit)
                          if m.activation == "swiglu_clamped" else MoeExperts(self.gate, self.up, self.down))

    def _fused(self, x: torch.Tensor) -> torch.Tensor:
        """CUDA: router logits in torch, then the routing and fused-expert kernels."""
        m = self.moe
        if m.router == "sigmoid_bias":
            logits = F.linear(x.to(torch.float32), self.router_weight.to(torch.float32))
            weights, ids = route_glm(logits, self.router_bias, m.top_k, m.norm_topk_prob, m.routed_scaling_factor,
                                     m.n_group, m.topk_group)
        else:
            logits = F.linear(x, self.router_weight.to(x.dtype), self.router_bias.to(x.dtype))
            weights, ids = route_gpt_oss(logits, m.top_k)
        return fused_moe(x, self.fused, weights, ids)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if self.fused is not None:
            out = self._fused(x)
        else:
            route = route_sigmoid_bias if self.moe.router == "sigmoid_bias" else route_softmax_topk
            weights, ids = route(x, self.router_weight, self.router_bias, self.moe)
            out = experts_forward(x, weights, ids, self.moe, self.gate_up, self.gate, self.up, self.down,
                                  self.gate_up_bias, self.down_bias)
        if self.shared is not None:
            out = out + self.shared(x)
        return out
