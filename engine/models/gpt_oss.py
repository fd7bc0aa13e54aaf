"""gpt-oss (20b, 120b): pre-norm decoder with sink attention (sliding window on alternate
layers), YaRN rotary, and a top-4 softmax-routed MoE with clamped SwiGLU experts."""
from __future__ import annotations

import torch

from ..layers.attention import SelfAttention
from ..layers.moe import MoeBlock
from ..layers.norm import add_rms_norm
from ..layers.rotary import RotaryEmbedding
from ..layers.vocab import VocabEmbedding, VocabHead
from ..parallel.context import SINGLE, ParallelContext
from ..spec import ModelSpec


class GptOssModel:
    """Under tensor parallelism (ctx) every rank runs this same forward on its slices; the
    residual stream is whole on every rank, restored by one all-reduce after attention and one
    after the MoE."""

    family = "gpt_oss"

    def __init__(self, spec: ModelSpec, weights: dict, device: torch.device | str = "cpu",
                 ctx: ParallelContext = SINGLE):
        self.spec, self.ctx = spec, ctx
        self.kv_heads = ctx.layout(spec).num_kv_heads  # per rank: what the KV cache holds
        self.embed_tokens = VocabEmbedding(weights["model.embed_tokens.weight"], spec, ctx)
        self.rotary = RotaryEmbedding(spec.rope, device)
        self.layers = []
        for i in range(spec.num_layers):
            p = f"model.layers.{i}"
            self.layers.append((
                weights[f"{p}.input_layernorm.weight"],
                SelfAttention(spec, weights, f"{p}.self_attn", i, ctx),
                weights[f"{p}.post_attention_layernorm.weight"],
                MoeBlock(spec, weights, f"{p}.mlp", ctx),
            ))
        self.norm = weights["model.norm.weight"]
        self.lm_head = VocabHead(weights["lm_head.weight"], spec, ctx)

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        """input_ids [T] -> [T, hidden]."""
        return self.ctx.all_reduce(self.embed_tokens(input_ids))

    def forward(self, h: torch.Tensor, batch, cache) -> torch.Tensor:
        """h [T, hidden] packed over the ForwardBatch's sequences -> final hidden states [T, hidden]."""
        eps = self.spec.rms_norm_eps
        cos, sin = self.rotary.cos_sin(batch.rope_positions, h.dtype)
        reduce = self.ctx.all_reduce
        # The residual stream runs beside the layers; each norm also adds the previous block's output.
        out, residual = h, None
        # At decode sizes the MXFP4 experts' packed-f16 kernels take the norm's second output.
        half2 = bool(self.layers) and self.layers[0][3].takes_half2_input(h.shape[0], h.dtype, h.device)
        for in_norm, attn, post_norm, mlp in self.layers:
            x, residual = add_rms_norm(out, residual, in_norm, eps, weight_first=True)
            x, residual, *x_half2 = add_rms_norm(reduce(attn(x, cos, sin, batch, cache)), residual, post_norm, eps,
                                                 weight_first=True, half2=half2)
            out = reduce(mlp(x, *x_half2))
        return add_rms_norm(out, residual, self.norm, eps, weight_first=True)[0]

    def logits(self, h: torch.Tensor) -> torch.Tensor:
        """h [T, hidden] -> float32 logits [T, vocab] (gathered from every rank's vocabulary rows)."""
        return self.lm_head(h)
