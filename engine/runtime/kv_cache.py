"""Paged KV cache: fixed-size blocks of token slots shared by all sequences.

A token's K and V live at slot `block * block_size + offset` of every layer; a sequence owns an
ordered list of blocks (its block table). Which blocks are free is the block pool's business.
"""
from __future__ import annotations

import torch


class PagedKVCache:
    """k[layer], v[layer]: [num_blocks, block_size, kv_heads, head_dim]."""

    def __init__(self, num_layers: int, num_blocks: int, block_size: int, kv_heads: int, head_dim: int,
                 dtype: torch.dtype, device: torch.device | str):
        shape = (num_layers, num_blocks, block_size, kv_heads, head_dim)
        self.k = torch.zeros(shape, dtype=dtype, device=device)
        self.v = torch.zeros(shape, dtype=dtype, device=device)
        self.num_blocks, self.block_size = num_blocks, block_size

    @staticmethod
    def bytes_per_block(num_layers: int, block_size: int, kv_heads: int, head_dim: int, dtype: torch.dtype) -> int:
        return 2 * num_layers * block_size * kv_heads * head_dim * torch.empty((), dtype=dtype).element_size()

    def write(self, layer: int, slot_mapping: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        """k, v [T, kv_heads, head_dim] go to slots [T]."""
        kf = self.k[layer].view(-1, *self.k.shape[-2:])
        vf = self.v[layer].view(-1, *self.v.shape[-2:])
        kf.index_copy_(0, slot_mapping, k.to(kf.dtype))
        vf.index_copy_(0, slot_mapping, v.to(vf.dtype))
