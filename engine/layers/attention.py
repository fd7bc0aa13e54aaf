"""Causal self-attention with GQA, optional attention sinks and sliding window.

The torch path here is the reference the kernels are checked against and the CPU path. Keys and
values live in a paged cache (engine/runtime/kv_cache.py); a ForwardBatch says which slots.
"""
from __future__ import annotations

import torch

from ...kernels.attention_decode import paged_decode_attention
from ...kernels.attention_prefill import paged_prefill_attention
from ..spec import ModelSpec
from .linear import linear
from .rotary import apply_rotary


def causal_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, q_positions: torch.Tensor,
                     scale: float, sinks: torch.Tensor | None = None, window: int | None = None) -> torch.Tensor:
    """q [T, Hq, D]; k, v [S, Hkv, D] holding positions 0..S-1; q_positions [T] (each < S).

    Query at position p sees keys j <= p, and with a window only p - window < j. A sink adds
    exp(sinks[h]) to the softmax denominator of head h without contributing a value.
    Returns [T, Hq, D] in q.dtype; the softmax runs in float32.
    """
    t, hq, d = q.shape
    s, hkv, _ = k.shape
    group = hq // hkv
    qf = q.to(torch.float32).view(t, hkv, group, d)
    scores = torch.einsum("tkgd,skd->kgts", qf, k.to(torch.float32)) * scale  # [Hkv, G, T, S]
    j = torch.arange(s, device=q.device)
    allowed = j[None, :] <= q_positions[:, None]
    if window is not None:
        allowed &= j[None, :] > q_positions[:, None] - window
    scores = scores.masked_fill(~allowed, float("-inf"))
    if sinks is not None:
        sink = sinks.to(torch.float32).view(hkv, group, 1, 1).expand(hkv, group, t, 1)
        scores = torch.cat((scores, sink), dim=-1)
    probs = torch.softmax(scores, dim=-1)
    if sinks is not None:
        probs = probs[..., :-1]
    out = torch.einsum("kgts,skd->tkgd", probs, v.to(torch.float32))
    return out.reshape(t, hq, d).to(q.dtype)


def paged_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, batch,
                    scale: float, sinks: torch.Tensor | None = None, window: int | None = None) -> torch.Tensor:
    """q [T, Hq, D] packed over the batch's sequences; k_cache, v_cache [blocks, block_size,
    Hkv, D]. Each sequence's new tokens are the last ones of its context. Returns [T, Hq, D]."""
    if q.is_cuda:
        tables, lens32 = batch.block_tables.to(torch.int32), batch.context_lens.to(torch.int32)
        if batch.is_decode:
            return paged_decode_attention(q, k_cache, v_cache, tables, lens32, scale, sinks, window)
        starts = batch.query_start_host
        longest = max(b - a for a, b in zip(starts, starts[1:]))
        return paged_prefill_attention(q, k_cache, v_cache, tables, lens32, batch.query_start.to(torch.int32),
                                       longest, scale, sinks, window)
    block_size = k_cache.shape[1]
    out = torch.empty_like(q)
    qs, lens = batch.query_start_host, batch.context_lens_host
    for b in range(len(lens)):
        n_blocks = -(-lens[b] // block_size)
        table = batch.block_tables[b, :n_blocks]
        keys = k_cache[table].flatten(0, 1)[: lens[b]]
        values = v_cache[table].flatten(0, 1)[: lens[b]]
        n_new = qs[b + 1] - qs[b]
        positions = torch.arange(lens[b] - n_new, lens[b], device=q.device)
        out[qs[b]:qs[b + 1]] = causal_attention(q[qs[b]:qs[b + 1]], keys, values, positions, scale, sinks, window)
    return out


class SelfAttention:
    """One decoder layer's attention; weights from the flat store under `prefix`."""

    def __init__(self, spec: ModelSpec, weights: dict, prefix: str, layer: int):
        self.layer = layer
        self.heads, self.kv_heads, self.head_dim = spec.num_heads, spec.num_kv_heads, spec.head_dim
        self.scale = spec.head_dim ** -0.5
        self.window = spec.sliding_window if spec.layer_types[layer] == "sliding" else None
        self.q, self.k, self.v, self.o = (weights[f"{prefix}.{n}_proj.weight"] for n in "qkvo")
        self.q_b, self.k_b, self.v_b, self.o_b = (weights.get(f"{prefix}.{n}_proj.bias") for n in "qkvo")
        self.sinks = weights.get(f"{prefix}.sinks") if spec.attention_sinks else None

    def __call__(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, batch, cache) -> torch.Tensor:
        """x [T, hidden] packed over the batch; cos/sin [T, rotary_dim] carry the rotary angles."""
        t = x.shape[0]
        q = linear(x, self.q, self.q_b).view(t, self.heads, self.head_dim)
        k = linear(x, self.k, self.k_b).view(t, self.kv_heads, self.head_dim)
        v = linear(x, self.v, self.v_b).view(t, self.kv_heads, self.head_dim)
        q, k = apply_rotary(q, cos, sin), apply_rotary(k, cos, sin)
        cache.write(self.layer, batch.slot_mapping, k, v)
        out = paged_attention(q, cache.k[self.layer], cache.v[self.layer], batch, self.scale, self.sinks, self.window)
        return linear(out.reshape(t, -1), self.o, self.o_b)
