"""gpt-oss (20b, 120b): pre-norm decoder with sink attention (sliding window on alternate
layers), YaRN rotary, and a top-4 softmax-routed MoE with clamped SwiGLU experts."""
from __future__ import annotations

import torch

from ..layers.attention import SelfAttention
from ..layers.linear import linear
from ..layers.moe import MoeBlock
from ..layers.norm import add_rms_norm
from ..layers.rotary import RotaryEmbedding
from ..spec import ModelSpec


class GptOssModel:
    family = "gpt_oss"

    def __init__(self, spec: ModelSpec, weights: dict, device: torch.device | str = "cpu"):
        self.spec = spec
        self.embed_tokens = weights["model.embed_tokens.weight"]
        self.rotary = RotaryEmbedding(spec.rope, device)
        self.layers = []
        for i in range(spec.num_layers):
            p = f"model.layers.{i}"
            self.layers.append((
                weights[f"{p}.input_layernorm.weight"],
                SelfAttention(spec, weights, f"{p}.self_attn", i),
                weights[f"{p}.post_attention_layernorm.weight"],
                MoeBlock(spec, weights, f"{p}.mlp"),
            ))
        self.norm = weights["model.norm.weight"]
        self.lm_head = weights["lm_head.weight"]

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        """input_ids [T] -> [T, hidden]."""
        return self.embed_tokens[input_ids]

    def forward(self, h: torch.Tensor, batch, cache) -> torch.Tensor:
        """h [T, hidden] packed over the ForwardBatch's sequences -> final hidden states [T, hidden]."""
        eps = self.spec.rms_norm_eps
        cos, sin = self.rotary.cos_sin(batch.rope_positions, h.dtype)
        # The residual stream runs beside the layers; each norm also adds the previous block's output.
        out, residual = h, None
        for in_norm, attn, post_norm, mlp in self.layers:
            x, residual = add_rms_norm(out, residual, in_norm, eps, weight_first=True)
            x, residual = add_rms_norm(attn(x, cos, sin, batch, cache), residual, post_norm, eps, weight_first=True)
            out = mlp(x)
        return add_rms_norm(out, residual, self.norm, eps, weight_first=True)[0]

    def logits(self, h: torch.Tensor) -> torch.Tensor:
        """h [T, hidden] -> float32 logits [T, vocab]."""
        return linear(h, self.lm_head).to(torch.float32)
