"""Rotary position embedding: default and YaRN frequencies, 1-D and 3-axis (M-RoPE) positions,
applied NeoX style (the rotated dims are split in halves) to the first rotary_dim dims."""
from __future__ import annotations

import math

import torch

from ..spec import RopeSpec


def inverse_frequencies(rope: RopeSpec) -> tuple[torch.Tensor, float]:
    """Returns inv_freq [rotary_dim / 2] (float32) and the factor that scales cos and sin."""
    dim = rope.rotary_dim
    exponents = torch.arange(0, dim, 2, dtype=torch.float32) / dim
    pos_freqs = rope.theta ** exponents
    if rope.kind == "default":
        return 1.0 / pos_freqs, 1.0
    # YaRN (Peng et al. 2023, arXiv:2309.00071): interpolate low frequencies by `factor`, keep
    # high ones, with a linear ramp between the dims that complete beta_fast and beta_slow turns
    # over the original context.
    def correction_dim(turns: float) -> float:
        return dim * math.log(rope.original_max_position / (turns * 2 * math.pi)) / (2 * math.log(rope.theta))

    low, high = correction_dim(rope.beta_fast), correction_dim(rope.beta_slow)
    if rope.truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001
    ramp = ((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low)).clamp(0, 1)
    extrapolation = 1.0 - ramp
    inv_freq = (1.0 / (rope.factor * pos_freqs)) * (1 - extrapolation) + (1.0 / pos_freqs) * extrapolation
    attention_factor = rope.attention_factor
    if attention_factor is None:
        attention_factor = 0.1 * math.log(rope.factor) + 1.0 if rope.factor > 1 else 1.0
    return inv_freq, float(attention_factor)


class RotaryEmbedding:
    def __init__(self, rope: RopeSpec, device: torch.device | str = "cpu"):
        self.rope = rope
        inv_freq, self.scale = inverse_frequencies(rope)
        self.inv_freq = inv_freq.to(device)

    def cos_sin(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """positions [T] (1-D) or [3, T] (t, h, w for M-RoPE) -> cos, sin [T, rotary_dim]."""
        freqs = positions.to(torch.float32)[..., None] * self.inv_freq  # [T, d/2] or [3, T, d/2]
        if positions.dim() == 2:
            if self.rope.mrope_section is None:
                raise ValueError("3-axis positions need an mrope_section")
            # Chunk i of the frequencies takes its angle from axis i % 3 (t, h, w).
            chunks = freqs.split(list(self.rope.mrope_section), dim=-1)
            freqs = torch.cat([c[i % 3] for i, c in enumerate(chunks)], dim=-1)
        emb = torch.cat((freqs, freqs), dim=-1)
        return (emb.cos() * self.scale).to(dtype), (emb.sin() * self.scale).to(dtype)


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [T, H, D]; cos, sin [T, R] with R <= D. Rotates x[..., :R] by halves; the rest passes."""
    r = cos.shape[-1]
    rot, rest = x[..., :r], x[..., r:]
    x1, x2 = rot[..., : r // 2], rot[..., r // 2:]
    c, s = cos[:, None, :], sin[:, None, :]
    rotated = rot * c + torch.cat((-x2, x1), dim=-1) * s
    return torch.cat((rotated, rest), dim=-1) if rest.shape[-1] else rotated
