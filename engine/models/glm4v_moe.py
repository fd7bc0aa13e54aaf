"""GLM-4.5V text decoder: dense layer 0 then sigmoid-routed MoE layers with a shared expert,
partial NeoX rotary with 3-axis M-RoPE positions; image features replace the <|image|> embeddings."""
from __future__ import annotations

import torch

from ..layers.attention import SelfAttention
from ..layers.mlp import GatedMLP
from ..layers.moe import MoeBlock
from ..layers.norm import add_rms_norm
from ..layers.rotary import RotaryEmbedding
from ..layers.vocab import VocabEmbedding, VocabHead
from ..parallel.context import SINGLE, ParallelContext
from ..spec import ModelSpec
from ..weights.shared_expert import fold_shared_experts
from .glm4v_vision import Glm4vVisionTower
from .mrope import mrope_positions


class Glm4vMoeModel:
    """Under tensor parallelism (ctx) every rank runs this same forward on its slices; the
    residual stream is whole on every rank, restored by one all-reduce after attention and one
    after the MLP / MoE.

    The vision tower runs on rank 0 only, and its features reach the other ranks through the
    embedding's all-reduce (rank 0 puts them at the image positions, the others zeros there):
    no extra collective, no pixels sent to other GPUs, and the other ranks would only repeat the
    same work (the tower's weights are loaded everywhere, replicated by the shard plan)."""

    family = "glm4v_moe"

    def __init__(self, spec: ModelSpec, weights: dict, device: torch.device | str = "cpu",
                 ctx: ParallelContext = SINGLE):
        self.spec, self.ctx = spec, ctx
        self.kv_heads = ctx.layout(spec).num_kv_heads  # per rank: what the KV cache holds
        prefix = "model.language_model"
        if not ctx.expert_parallel:
            # restructures the store in place (the old stacks freed as it goes): the shared expert
            # runs as one more pair in the MoE kernels (weights/shared_expert.py)
            fold_shared_experts(spec, weights, prefix)
        self.embed_tokens = VocabEmbedding(weights[f"{prefix}.embed_tokens.weight"], spec, ctx)
        self.rotary = RotaryEmbedding(spec.rope, device)
        self.layers = []
        for i in range(spec.num_layers):
            p = f"{prefix}.layers.{i}"
            mlp = MoeBlock(spec, weights, f"{p}.mlp", ctx) if spec.is_moe_layer(i) else GatedMLP(weights, f"{p}.mlp")
            self.layers.append((
                weights[f"{p}.input_layernorm.weight"],
                SelfAttention(spec, weights, f"{p}.self_attn", i, ctx),
                weights[f"{p}.post_attention_layernorm.weight"],
                mlp,
            ))
        self.norm = weights[f"{prefix}.norm.weight"]
        self.lm_head = VocabHead(weights["lm_head.weight"], spec, ctx)
        self.visual = Glm4vVisionTower(spec.vision, weights, "model.visual")

    def embed(self, input_ids: torch.Tensor, image_features: torch.Tensor | None = None) -> torch.Tensor:
        """input_ids [T] -> [T, hidden]; image_features [n_image_tokens, hidden] fill the
        <|image|> positions in order. Under tensor parallelism rank 0 passes the real features
        and every other rank zeros of the same shape."""
        h = self.embed_tokens(input_ids)
        if image_features is not None:
            mask = input_ids == self.spec.image_tokens.image
            if int(mask.sum()) != image_features.shape[0]:
                raise ValueError(f"the prompt has {int(mask.sum())} image tokens but the images give "
                                 f"{image_features.shape[0]} features")
            h = h.clone()
            h[mask] = image_features.to(h.dtype)
        return self.ctx.all_reduce(h)

    def encode_images(self, pixel_values: torch.Tensor, grid_thw: torch.Tensor) -> torch.Tensor:
        return self.visual(pixel_values, grid_thw)

    def rope_positions(self, input_ids: torch.Tensor, grid_thw: torch.Tensor | None) -> tuple[torch.Tensor, int]:
        """[3, T] M-RoPE positions of a prompt and the offset later tokens add to their slot."""
        return mrope_positions(input_ids, grid_thw, self.spec.image_tokens, self.spec.vision.spatial_merge_size)

    def forward(self, h: torch.Tensor, batch, cache) -> torch.Tensor:
        """h [T, hidden] packed over the ForwardBatch's sequences -> final hidden states [T, hidden]."""
        eps = self.spec.rms_norm_eps
        cos, sin = self.rotary.cos_sin(batch.rope_positions, h.dtype)
        reduce = self.ctx.all_reduce
        # The residual stream runs beside the layers; each norm also adds the previous block's output.
        out, residual = h, None
        # Where the block after a norm quantises its input rows to e4m3 (FP8 GEMMs at prefill
        # sizes), the norm writes them too: alike for every block of a kind, so asked once each.
        e4m3: dict[type, bool] = {}

        def takes_e4m3(block) -> bool:
            if type(block) not in e4m3:
                e4m3[type(block)] = block.takes_e4m3_input(h.shape[0], h.dtype, h.device)
            return e4m3[type(block)]

        for in_norm, attn, post_norm, mlp in self.layers:
            x, residual, *x_e4m3 = add_rms_norm(out, residual, in_norm, eps, e4m3=takes_e4m3(attn))
            attended = reduce(attn(x, cos, sin, batch, cache, *x_e4m3))
            x, residual, *x_e4m3 = add_rms_norm(attended, residual, post_norm, eps, e4m3=takes_e4m3(mlp))
            out = reduce(mlp(x, x_e4m3=x_e4m3[0] if x_e4m3 else None))
        return add_rms_norm(out, residual, self.norm, eps)[0]

    def logits(self, h: torch.Tensor) -> torch.Tensor:
        """h [T, hidden] -> float32 logits [T, vocab] (gathered from every rank's vocabulary rows)."""
        return self.lm_head(h)
