"""Prefill attention: a chunk of new queries per sequence over its paged KV cache (prefix + chunk).

Sequence b's queries are q[cu_seqlens_q[b]:cu_seqlens_q[b+1]] at positions
context_lens[b] - q_len_b .. context_lens[b] - 1; their own k/v are already in the cache (the
rotary kernel writes them), so a cached prefix from an earlier turn is attended like any key.
Causal, optional sliding window (i - window < j <= i) and per-head sinks, cache layout as in
attention_decode.py. FlashAttention-2 style: one program per (head, sequence, query tile), the
longest tiles first; key tiles wholly before a query tile's first position skip the causal test; a
sink is the softmax's starting state (running max = sink, running sum = 1), as it adds exp(sink)
to the denominator without a value. Tiles by head size: prefill_tile.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from .attention_decode import LOG2E, _tile_kv, _tile_pages, attention_rows_ref, gather_paged
from .gpu_facts import gpu_arch

# Shared memory a program needs for the wide tiles below (128 keys of 128 dims in two stages):
# Hopper's 227 KiB, not Ampere's 163 or Ada's 99
WIDE_TILE_SHARED_MEMORY = 200 * 1024


def prefill_tile(head_dim: int, window: int | None, shared_memory: int) -> tuple[int, int, int, int]:
    """(block_m, block_n, num_warps, num_stages) by head size. H100, 2048 queries after 0 / 6144 /
    30720 keys (bench/bench_prefill_attention.py): GLM-4.5V (head_dim 128) 128x128 on 8 warps 483 /
    2600 / 11093 us against 630 / 3458 / 14934 for 64x64 on 4; gpt-oss (64, sinks) 128x64 on 8
    warps in 3 stages 183 / 905 / 3804 against 258 / 1211 / 4956. Sliding-window layers (a few key
    tiles a query tile) stay on 64x64: no other tile was clearly faster."""
    if window is not None:
        return 64, 64, 4, 2
    if head_dim >= 128:
        return (128, 128, 8, 2) if shared_memory >= WIDE_TILE_SHARED_MEMORY else (64, 64, 4, 2)
    return 128, 64, 8, 3


@triton.jit
def _attend_keys(q, m, l, acc, k_ptr, v_ptr, table_row, kvh, j0, hi, pos, window, block_size,
                 stride_ks, stride_kb, stride_kh, stride_vb, stride_vs, stride_vh, d,
                 BLOCK_N: tl.constexpr, MASKED: tl.constexpr, HAS_WINDOW: tl.constexpr):
    """One key tile j0 + [0, BLOCK_N) of the online softmax: q [BLOCK_M, D] (scaled, log2
    domain), running max m, sum l [BLOCK_M] and acc [BLOCK_M, D] -> updated. MASKED: some keys of
    the tile are past hi, after a query's position or (window) too far before it; unmasked tiles
    skip those tests."""
    page = _tile_pages(table_row, j0, hi, block_size, BLOCK_N)
    k, v = _tile_kv(k_ptr, v_ptr, kvh, page, j0, hi, block_size, stride_kb, stride_ks, stride_kh, stride_vb,
                    stride_vs, stride_vh, d, BLOCK_N)
    s = tl.dot(q, tl.trans(k))
    if MASKED:
        j = j0 + tl.arange(0, BLOCK_N)
        allowed = (j < hi)[None, :] & (j[None, :] <= pos[:, None])
        if HAS_WINDOW:
            allowed &= j[None, :] > pos[:, None] - window
        s = tl.where(allowed, s, float("-inf"))
    m_new = tl.maximum(m, tl.max(s, axis=1))
    m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)  # rows with nothing allowed yet
    alpha = tl.exp2(m - m_safe)
    p = tl.exp2(s - m_safe[:, None])
    l = l * alpha + tl.sum(p, axis=1)
    acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v)
    return m_new, l, acc


@triton.jit
def _prefill_kernel(q_ptr, k_ptr, v_ptr, out_ptr, tables_ptr, lens_ptr, cu_ptr, sinks_ptr,
                    stride_qt, stride_qh, stride_ot, stride_oh, stride_kb, stride_ks, stride_kh,
                    stride_vb, stride_vs, stride_vh, stride_tb, qk_scale, window, block_size, skip_up_to,
                    G: tl.constexpr, D: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                    HAS_SINKS: tl.constexpr, HAS_WINDOW: tl.constexpr):
    """Program (head, sequence, query tile), the tiles last first: under the causal mask the last
    tiles have the most keys, and starting them first leaves the short ones for the tail."""
    h = tl.program_id(0)
    b = tl.program_id(1)
    tile = tl.num_programs(2) - 1 - tl.program_id(2)
    q_start = tl.load(cu_ptr + b)
    q_len = tl.load(cu_ptr + b + 1) - q_start
    if tile * BLOCK_M >= q_len or q_len <= skip_up_to:
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
    first = ctx - q_len + tile * BLOCK_M  # the tile's first query position
    hi = tl.minimum(first + BLOCK_M, ctx)
    table_row = tables_ptr + b * stride_tb
    lo = 0
    unmasked_end = 0
    if HAS_WINDOW:
        lo = tl.maximum(first - window + 1, 0) // BLOCK_N * BLOCK_N
    else:
        # keys up to `first` are visible to every query of the tile: whole tiles of them need no mask
        unmasked_end = (first + 1) // BLOCK_N * BLOCK_N
    for j0 in range(lo, unmasked_end, BLOCK_N):
        m, l, acc = _attend_keys(q, m, l, acc, k_ptr, v_ptr, table_row, kvh, j0, hi, pos, window, block_size,
                                 stride_ks, stride_kb, stride_kh, stride_vb, stride_vs, stride_vh, d,
                                 BLOCK_N, False, HAS_WINDOW)
    for j0 in range(tl.maximum(lo, unmasked_end), hi, BLOCK_N):
        m, l, acc = _attend_keys(q, m, l, acc, k_ptr, v_ptr, table_row, kvh, j0, hi, pos, window, block_size,
                                 stride_ks, stride_kb, stride_kh, stride_vb, stride_vs, stride_vh, d,
                                 BLOCK_N, True, HAS_WINDOW)
    out = acc / l[:, None]
    tl.store(out_ptr + rows[:, None] * stride_ot + h * stride_oh + d[None, :], out.to(out_ptr.dtype.element_ty),
             mask=i_mask[:, None])


def paged_prefill_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                            block_tables: torch.Tensor, context_lens: torch.Tensor, cu_seqlens_q: torch.Tensor,
                            max_q_len: int, scale: float, sinks: torch.Tensor | None = None,
                            window: int | None = None, block_m: int | None = None, block_n: int | None = None,
                            num_warps: int | None = None, num_stages: int | None = None,
                            out: torch.Tensor | None = None, skip_up_to: int = 0) -> torch.Tensor:
    """q [Tq, Hq, D] (sequences packed by cu_seqlens_q [B+1] int32), caches [num_blocks,
    block_size, Hkv, D], block_tables [B, max_blocks] int32, context_lens [B] int32 (prefix +
    chunk), max_q_len: the longest chunk (host int). Returns [Tq, Hq, D] in q.dtype (written into
    `out` when given). block_m / block_n: queries / keys a tile; num_warps, num_stages: the
    launch's; each left None takes prefill_tile's choice. skip_up_to: sequences of at most this
    many queries are left to another call (their rows of `out` untouched), decided on the device,
    so a captured graph can share its batch between two kernels."""
    tq, hq, d = q.shape
    tile = prefill_tile(d, window, gpu_arch(q.device).shared_memory)
    block_m, block_n, num_warps, num_stages = (given if given is not None else chosen for given, chosen in
                                               zip((block_m, block_n, num_warps, num_stages), tile))
    _, block_size, hkv, _ = k_cache.shape
    if hq % hkv or d & (d - 1) or q.stride(-1) != 1 or k_cache.stride(-1) != 1 or v_cache.stride(-1) != 1:
        raise ValueError("need query heads a multiple of KV heads, a power-of-two head_dim and "
                         "q/caches contiguous along head_dim")
    out = torch.empty_like(q) if out is None else out
    bsz = cu_seqlens_q.numel() - 1
    if tq == 0 or bsz == 0:
        return out
    _prefill_kernel[(hq, bsz, triton.cdiv(max_q_len, block_m))](
        q, k_cache, v_cache, out, block_tables, context_lens, cu_seqlens_q, sinks if sinks is not None else q,
        q.stride(0), q.stride(1), out.stride(0), out.stride(1), k_cache.stride(0), k_cache.stride(1),
        k_cache.stride(2), v_cache.stride(0), v_cache.stride(1), v_cache.stride(2), block_tables.stride(0),
        scale * LOG2E, window or 0, block_size, skip_up_to, G=hq // hkv, D=d, BLOCK_M=block_m, BLOCK_N=block_n,
        HAS_SINKS=sinks is not None, HAS_WINDOW=window is not None, num_warps=num_warps, num_stages=num_stages)
    return out


def paged_prefill_attention_ref(q, k_cache, v_cache, block_tables, context_lens, cu_seqlens_q, max_q_len, scale,
                                sinks=None, window=None, block_m=None, block_n=None, num_warps=None,
                                num_stages=None, out=None, skip_up_to=0) -> torch.Tensor:
    out = torch.empty_like(q) if out is None else out
    for b in range(cu_seqlens_q.numel() - 1):
        s, e = int(cu_seqlens_q[b]), int(cu_seqlens_q[b + 1])
        if e - s <= skip_up_to:
            continue
        ctx = int(context_lens[b])
        k, v = gather_paged(k_cache, block_tables[b], ctx), gather_paged(v_cache, block_tables[b], ctx)
        pos = torch.arange(ctx - (e - s), ctx, device=q.device)
        out[s:e] = attention_rows_ref(q[s:e], k, v, pos, scale, sinks, window).to(q.dtype)
    return out
