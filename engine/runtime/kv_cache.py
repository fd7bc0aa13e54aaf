"""A contiguous per-sequence KV cache: the simple path for one sequence at a time."""
from __future__ import annotations

import torch


class ContiguousKVCache:
    """k, v per layer: [max_tokens, kv_heads, head_dim]."""

    def __init__(self, num_layers: int, max_tokens: int, kv_heads: int, head_dim: int,
                 dtype: torch.dtype, device: torch.device | str):
        shape = (num_layers, max_tokens, kv_heads, head_dim)
        self.k = torch.empty(shape, dtype=dtype, device=device)
        self.v = torch.empty(shape, dtype=dtype, device=device)
        self.max_tokens = max_tokens

    def write(self, layer: int, start: int, k: torch.Tensor, v: torch.Tensor) -> None:
        end = start + k.shape[0]
        if end > self.max_tokens:
            raise ValueError(f"the KV cache holds {self.max_tokens} tokens; {end} were asked for")
        self.k[layer, start:end] = k
        self.v[layer, start:end] = v

    def read(self, layer: int, end: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self.k[layer, :end], self.v[layer, :end]
