"""Prefill attention through torch's FlashAttention-2 on keys gathered out of the paged cache.

Prefill attention is bound by arithmetic, not bytes: gathering a sequence's keys and values out of
their 16-token pages into one contiguous run costs under 1% of the call (GLM-4.5V, the last
2048-query chunk of a 32K prompt: 2 x 134 MB, ~63 us at 4.27 TB/s, against ~11 ms of attention)
and lets a tuned kernel take the rest. torch ships FlashAttention-2 (`aten._flash_attention_forward`: packed
sequences, GQA, a causal mask aligned to the last key, a left window) and returns each row's
log-sum-exp, through which gpt-oss's sinks are added to the softmax denominator afterwards:
with a sink s for head h, softmax over (scores, s) = softmax(scores) * 1 / (1 + exp(s - lse)).

`flash_varlen` is the FlashAttention call, `flash_varlen_ref` its torch reference (same
signature); `gathered_prefill_attention` has the signature of paged_prefill_attention plus the
host-side lengths and the attention function to use. The engine's prefill keeps the paged Triton
kernel until this measures faster on the GPU (bench/NOTES-attention.md).
"""
from __future__ import annotations

import functools

import torch

from .attention_decode import masked_scores_ref


def flash_varlen(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_q: torch.Tensor, cu_k: torch.Tensor,
                 max_q: int, max_k: int, scale: float, window: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """q [Tq, Hq, D], k/v [Tk, Hkv, D] packed by cu_q / cu_k [B+1] int32; each sequence's queries
    are its last keys' positions (causal from the last key), a query at p sees keys j <= p (and
    p - window < j). Returns (out [Tq, Hq, D] in q.dtype, lse [Hq, Tq] float32, natural log)."""
    out, lse = torch.ops.aten._flash_attention_forward(
        q, k, v, cu_q, cu_k, max_q, max_k, 0.0, True, False, scale=scale,
        window_size_left=-1 if window is None else window - 1, window_size_right=-1 if window is None else 0)[:2]
    return out, lse[:, : q.shape[0]]


def flash_varlen_ref(q, k, v, cu_q, cu_k, max_q, max_k, scale, window=None) -> tuple[torch.Tensor, torch.Tensor]:
    out = torch.empty_like(q)
    lse = torch.empty(q.shape[1], q.shape[0], dtype=torch.float32, device=q.device)
    for b in range(cu_q.numel() - 1):
        qs, qe, ks, ke = int(cu_q[b]), int(cu_q[b + 1]), int(cu_k[b]), int(cu_k[b + 1])
        vf = v[ks:ke].float().repeat_interleave(q.shape[1] // k.shape[1], dim=1)
        pos = torch.arange(ke - ks - (qe - qs), ke - ks, device=q.device)
        scores = masked_scores_ref(q[qs:qe], k[ks:ke], pos, scale, window)
        lse[:, qs:qe] = torch.logsumexp(scores, dim=-1)
        out[qs:qe] = torch.einsum("hts,shd->thd", torch.softmax(scores, dim=-1), vf).to(q.dtype)
    return out, lse


def gather_slots(block_tables: torch.Tensor, context_lens_host: list[int], block_size: int) -> torch.Tensor:
    """Cache slots (block * block_size + offset) of every sequence's keys 0..len-1, packed in
    sequence order -> [sum(lens)] int64."""
    offsets = torch.arange(block_size, device=block_tables.device)
    runs = []
    for b, length in enumerate(context_lens_host):
        blocks = -(-length // block_size)
        runs.append((block_tables[b, :blocks].long()[:, None] * block_size + offsets).flatten()[:length])
    return torch.cat(runs)


def gather_keys(cache: torch.Tensor, slots: torch.Tensor) -> torch.Tensor:
    """cache [num_blocks, block_size, Hkv, D] (any strides), slots [S] -> [S, Hkv, D] contiguous."""
    block_size = cache.shape[1]
    return cache[slots // block_size, slots % block_size]


def gathered_prefill_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                               block_tables: torch.Tensor, context_lens: torch.Tensor, cu_seqlens_q: torch.Tensor,
                               max_q_len: int, scale: float, sinks: torch.Tensor | None = None,
                               window: int | None = None, *, context_lens_host: list[int],
                               attend=flash_varlen) -> torch.Tensor:
    """As paged_prefill_attention (q [Tq, Hq, D] packed by cu_seqlens_q [B+1] int32, caches
    [num_blocks, block_size, Hkv, D], block_tables [B, max_blocks], context_lens [B] int32), with
    the context lengths also on the host: each sequence's keys are copied out of the pages into
    one packed run, then `attend` (flash_varlen or its reference) runs on them. Returns
    [Tq, Hq, D] in q.dtype."""
    if q.shape[0] == 0:
        return torch.empty_like(q)
    slots = gather_slots(block_tables, context_lens_host, k_cache.shape[1])
    k, v = gather_keys(k_cache, slots), gather_keys(v_cache, slots)
    cu_k = torch.nn.functional.pad(context_lens.cumsum(0, dtype=torch.int32), (1, 0))
    out, lse = attend(q, k, v, cu_seqlens_q, cu_k, max_q_len, max(context_lens_host), scale, window)
    if sinks is None:
        return out
    share = torch.sigmoid(lse - sinks.float()[:, None])  # 1 / (1 + exp(s - lse)), [Hq, Tq]
    return (out.float() * share.t()[:, :, None]).to(q.dtype)


@functools.lru_cache(maxsize=None)
def flash_works(device_index: int, head_dim: int, dtype: torch.dtype) -> bool:
    """Whether this torch has FlashAttention-2 for this GPU, head size and dtype and it computes
    a small packed GQA product and its log-sum-exp right (against flash_varlen_ref);
    tried once per device, head size and dtype."""
    dev = torch.device("cuda", device_index)
    gen = torch.Generator(device=dev).manual_seed(0)
    q = torch.randn(40, 4, head_dim, device=dev, generator=gen).to(dtype)
    k = torch.randn(70, 2, head_dim, device=dev, generator=gen).to(dtype)
    v = torch.randn(70, 2, head_dim, device=dev, generator=gen).to(dtype)
    cu_q = torch.tensor([0, 24, 40], dtype=torch.int32, device=dev)
    cu_k = torch.tensor([0, 30, 70], dtype=torch.int32, device=dev)
    try:
        out, lse = flash_varlen(q, k, v, cu_q, cu_k, 24, 40, head_dim ** -0.5)
        ref, ref_lse = flash_varlen_ref(q, k, v, cu_q, cu_k, 24, 40, head_dim ** -0.5)
    except (RuntimeError, NotImplementedError, TypeError):
        return False
    return matches_reference(out, lse, ref, ref_lse)


def matches_reference(out: torch.Tensor, lse: torch.Tensor, ref: torch.Tensor, ref_lse: torch.Tensor) -> bool:
    """An attention call's output and log-sum-exp against its reference's, within bf16's reach
    (a probe's check: a wrong layout or mask is off by far more)."""
    if lse.shape != ref_lse.shape or (lse - ref_lse).abs().max() > 1e-2:
        return False
    return bool(((out.float() - ref.float()).norm() / ref.float().norm()) <= 2e-2)
