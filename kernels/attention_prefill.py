"""Prefill attention: a chunk of new queries per sequence over its paged KV cache (prefix + chunk).

Sequence b's queries are q[cu_seqlens_q[b]:cu_seqlens_q[b+1]] at positions
context_lens[b] - q_len_b .. context_lens[b] - 1; their own k/v are already in the cache (the
rotary kernel writes them), so a cached prefix from an earlier turn is attended like any key.
Causal, optional sliding window (i - window < j <= i) and per-head sinks, cache layout as in
attention_decode.py. FlashAttention-2 style: one program per (query tile, sequence, head); a
sink is the softmax's starting state (running max = sink, running sum = 1), as it adds exp(sink)
to the denominator without a value.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from .attention_decode import LOG2E, attention_rows_ref, gather_paged


@triton.jit
def _prefill_kernel(q_ptr, k_ptr, v_ptr, out_ptr, tables_ptr, lens_ptr, cu_ptr, sinks_ptr,
                    stride_qt, stride_qh, stride_ot, stride_oh, stride_kb, stride_ks, stride_kh,
                    stride_vb, stride_vs, stride_vh, stride_tb, qk_scale, window, block_size,
                    G: tl.constexpr, D: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                    HAS_SINKS: tl.constexpr, HAS_WINDOW: tl.constexpr):
    tile = tl.program_id(0)
    b = tl.program_id(1)
    h = tl.program_id(2)
    q_start = tl.load(cu_ptr + b)
    q_len = tl.load(cu_ptr + b + 1) - q_start
    if tile * BLOCK_M >= q_len:
        return
    ctx = tl.load(lens_ptr + b)
    kvh = h // G
    i = tile * BLOCK_M + tl.arange(0, BLOCK_M)
    i_mask = i < q_len
    pos = ctx - q_len + i
    d = tl.arange(0, D)
    rows = (q_start + i).to(tl.int64)
    q = tl.load(q_ptr + rows[:, None] * stride_qt + h * stride_qh + d[None, :], mask=i_mask[:, None], other=0.0)
    q = (q.to(tl.float32) * qk_scale).to(k_ptr.dtype.element_ty)

    if HAS_SINKS:
        m = tl.zeros((BLOCK_M,), dtype=tl.float32) + tl.load(sinks_ptr + h).to(tl.float32) * 1.4426950408889634
        l = tl.full((BLOCK_M,), 1.0, dtype=tl.float32)
    else:
        m = tl.full((BLOCK_M,), float("-inf"), dtype=tl.float32)
        l = tl.zeros((BLOCK_M,), dtype=tl.float32)
    acc = tl.zeros((BLOCK_M, D), dtype=tl.float32)
    first = ctx - q_len + tile * BLOCK_M
    hi = tl.minimum(first + BLOCK_M, ctx)
    lo = 0
    if HAS_WINDOW:
        lo = tl.maximum(first - window + 1, 0) // BLOCK_N * BLOCK_N
    for j0 in range(lo, hi, BLOCK_N):
        j = j0 + tl.arange(0, BLOCK_N)
        j_mask = j < hi
        page = tl.load(tables_ptr + b * stride_tb + j // block_size, mask=j_mask, other=0).to(tl.int64)
        slot = j % block_size
        k = tl.load(k_ptr + page[:, None] * stride_kb + slot[:, None] * stride_ks + kvh * stride_kh + d[None, :],
                    mask=j_mask[:, None], other=0.0)
        v = tl.load(v_ptr + page[:, None] * stride_vb + slot[:, None] * stride_vs + kvh * stride_vh + d[None, :],
                    mask=j_mask[:, None], other=0.0)
        s = tl.dot(q, tl.trans(k))
        allowed = j_mask[None, :] & (j[None, :] <= pos[:, None])
        if HAS_WINDOW:
            allowed &= j[None, :] > pos[:, None] - window
        s = tl.where(allowed, s, float("-inf"))
        m_new = tl.maximum(m, tl.max(s, axis=1))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)  # rows with nothing allowed yet
        alpha = tl.exp2(m - m_safe)
        p = tl.exp2(s - m_safe[:, None])
        l = l * alpha + tl.sum(p, axis=1)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v)
        m = m_new
    out = acc / l[:, None]
    tl.store(out_ptr + rows[:, None] * stride_ot + h * stride_oh + d[None, :], out.to(out_ptr.dtype.element_ty),
             mask=i_mask[:, None])


def paged_prefill_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                            block_tables: torch.Tensor, context_lens: torch.Tensor, cu_seqlens_q: torch.Tensor,
                            max_q_len: int, scale: float, sinks: torch.Tensor | None = None,
                            window: int | None = None, block_m: int = 64, block_n: int = 64) -> torch.Tensor:
    """q [Tq, Hq, D] (sequences packed by cu_seqlens_q [B+1] int32), caches [num_blocks,
    block_size, Hkv, D], block_tables [B, max_blocks] int32, context_lens [B] int32 (prefix +
    chunk), max_q_len: the longest chunk (host int). Returns [Tq, Hq, D] in q.dtype."""
    tq, hq, d = q.shape
    _, block_size, hkv, _ = k_cache.shape
    if hq % hkv or d & (d - 1) or q.stride(-1) != 1 or k_cache.stride(-1) != 1 or v_cache.stride(-1) != 1:
        raise ValueError("need query heads a multiple of KV heads, a power-of-two head_dim and "
                         "q/caches contiguous along head_dim")
    out = torch.empty_like(q)
    bsz = cu_seqlens_q.numel() - 1
    if tq == 0 or bsz == 0:
        return out
    _prefill_kernel[(triton.cdiv(max_q_len, block_m), bsz, hq)](
        q, k_cache, v_cache, out, block_tables, context_lens, cu_seqlens_q, sinks if sinks is not None else q,
        q.stride(0), q.stride(1), out.stride(0), out.stride(1), k_cache.stride(0), k_cache.stride(1),
        k_cache.stride(2), v_cache.stride(0), v_cache.stride(1), v_cache.stride(2), block_tables.stride(0),
        scale * LOG2E, window or 0, block_size, G=hq // hkv, D=d, BLOCK_M=block_m, BLOCK_N=block_n,
        HAS_SINKS=sinks is not None, HAS_WINDOW=window is not None, num_warps=4, num_stages=2)
    return out


def paged_prefill_attention_ref(q, k_cache, v_cache, block_tables, context_lens, cu_seqlens_q, max_q_len, scale,
                                sinks=None, window=None, block_m=64, block_n=64) -> torch.Tensor:
    out = torch.empty_like(q)
    for b in range(cu_seqlens_q.numel() - 1):
        s, e = int(cu_seqlens_q[b]), int(cu_seqlens_q[b + 1])
        ctx = int(context_lens[b])
        k, v = gather_paged(k_cache, block_tables[b], ctx), gather_paged(v_cache, block_tables[b], ctx)
        pos = torch.arange(ctx - (e - s), ctx, device=q.device)
        out[s:e] = attention_rows_ref(q[s:e], k, v, pos, scale, sinks, window).to(q.dtype)
    return out
