"""Prefill attention for chunks of a few queries after long contexts: the query heads of a KV head
packed into one tile's rows, the keys split over programs.

The paged prefill kernel (attention_prefill.py) gives each query head its own programs, each with
a tile of 64-128 query rows. A chunk of a few tokens after a long context (a short turn late in a
long chat) leaves most of those rows empty, and each of a KV head's G query heads walks the same
keys (bench/NOTES-attention.md, "Short chunks after long contexts"). Here row r of a tile is query
r // G of head kvh * G + r % G, so a chunk of n tokens fills n * G rows a KV head; and the keys up
to a tile's last query are split NUM_SPLITS ways, as the decode kernel splits them
(attention_decode.py), whose combine launch merges the splits' partial maxima, sums and rows and
adds gpt-oss's sinks. With one split the kernel finishes its rows itself.

`short_prefill_attention` has paged_prefill_attention's signature (plus its own tile options);
`short_prefill_attention_ref` is the same reference. Not yet taken by the engine: the sizes where
it beats the paged kernel are for the GPU to say (`bench/bench_prefill_attention.py`).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from .attention_decode import LOG2E, _decode_combine_kernel, _finish_rows
from .attention_prefill import _attend_keys, paged_prefill_attention_ref


@triton.jit
def _short_prefill_kernel(q_ptr, k_ptr, v_ptr, tables_ptr, lens_ptr, cu_ptr, mid_o_ptr, mid_ml_ptr, sinks_ptr,
                          out_ptr, stride_qt, stride_qh, stride_kb, stride_ks, stride_kh, stride_vb, stride_vs,
                          stride_vh, stride_tb, stride_ot, stride_oh, HQ, qk_scale, window, block_size,
                          G: tl.constexpr, D: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                          NUM_SPLITS: tl.constexpr, HAS_WINDOW: tl.constexpr, HAS_SINKS: tl.constexpr):
    """Program (sequence, KV head, row tile x split)."""
    b = tl.program_id(0)
    kvh = tl.program_id(1)
    tile = tl.program_id(2) // NUM_SPLITS
    split = tl.program_id(2) % NUM_SPLITS
    q_start = tl.load(cu_ptr + b)
    q_len = tl.load(cu_ptr + b + 1) - q_start
    if tile * BLOCK_M >= q_len * G:
        return
    ctx = tl.load(lens_ptr + b)
    r = tile * BLOCK_M + tl.arange(0, BLOCK_M)
    r_mask = r < q_len * G
    i = r // G
    heads = kvh * G + r % G
    pos = ctx - q_len + i  # each row's query position
    d = tl.arange(0, D)
    rows = (q_start + i).to(tl.int64)
    q = tl.load(q_ptr + rows[:, None] * stride_qt + heads[:, None] * stride_qh + d[None, :], mask=r_mask[:, None],
                other=0.0)
    q = (q.to(tl.float32) * qk_scale).to(k_ptr.dtype.element_ty)  # scale folded in, log2 domain

    # the keys any row of the tile sees: up to its last query, from its first query's window
    last_query = (tl.minimum(tile * BLOCK_M + BLOCK_M, q_len * G) - 1) // G
    hi = ctx - q_len + last_query + 1
    lo = 0
    if HAS_WINDOW:
        lo = tl.maximum(ctx - q_len + tile * BLOCK_M // G - window + 1, 0)
    per_split = tl.cdiv(tl.cdiv(hi - lo, NUM_SPLITS), BLOCK_N) * BLOCK_N
    start = lo + split * per_split
    end = tl.minimum(start + per_split, hi)

    m = tl.full((BLOCK_M,), float("-inf"), dtype=tl.float32)
    l = tl.zeros((BLOCK_M,), dtype=tl.float32)
    acc = tl.zeros((BLOCK_M, D), dtype=tl.float32)
    table_row = tables_ptr + b * stride_tb
    for j0 in range(start, end, BLOCK_N):
        m, l, acc = _attend_keys(q, m, l, acc, k_ptr, v_ptr, table_row, kvh, j0, end, pos, window, block_size,
                                 stride_ks, stride_kb, stride_kh, stride_vb, stride_vs, stride_vh, d,
                                 BLOCK_N, True, HAS_WINDOW)

    if NUM_SPLITS == 1:  # the whole key range: finish as the combine would
        out = _finish_rows(m, l, acc, sinks_ptr, heads, r_mask, HAS_SINKS)
        tl.store(out_ptr + rows[:, None] * stride_ot + heads[:, None] * stride_oh + d[None, :],
                 out.to(out_ptr.dtype.element_ty), mask=r_mask[:, None])
    else:
        # the decode combine's layout, with the chunk's token rows as its sequences
        part = ((q_start + i).to(tl.int64) * HQ + heads) * NUM_SPLITS + split
        tl.store(mid_o_ptr + part[:, None] * D + d[None, :], acc, mask=r_mask[:, None])
        tl.store(mid_ml_ptr + part * 2, m, mask=r_mask)
        tl.store(mid_ml_ptr + part * 2 + 1, l, mask=r_mask)


def short_prefill_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                            block_tables: torch.Tensor, context_lens: torch.Tensor, cu_seqlens_q: torch.Tensor,
                            max_q_len: int, scale: float, sinks: torch.Tensor | None = None,
                            window: int | None = None, num_splits: int = 8, block_m: int = 64, block_n: int = 64,
                            num_warps: int = 4, num_stages: int = 2) -> torch.Tensor:
    """q [Tq, Hq, D] (sequences packed by cu_seqlens_q [B+1] int32), caches [num_blocks, block_size,
    Hkv, D], block_tables [B, max_blocks] int32, context_lens [B] int32 (prefix + chunk), max_q_len:
    the longest chunk (host int). Returns [Tq, Hq, D] in q.dtype. num_splits: programs a row tile's
    keys are split over; block_m: (query, head) rows a tile; block_n: keys a step."""
    tq, hq, d = q.shape
    _, block_size, hkv, _ = k_cache.shape
    if hq % hkv or d & (d - 1) or q.stride(-1) != 1 or k_cache.stride(-1) != 1 or v_cache.stride(-1) != 1:
        raise ValueError("need query heads a multiple of KV heads, a power-of-two head_dim and "
                         "q/caches contiguous along head_dim")
    group = hq // hkv
    out = torch.empty_like(q)
    bsz = cu_seqlens_q.numel() - 1
    if tq == 0 or bsz == 0:
        return out
    parts = tq * hq * num_splits if num_splits > 1 else 1
    mid_o = torch.empty((parts, d), dtype=torch.float32, device=q.device)
    mid_ml = torch.empty((parts, 2), dtype=torch.float32, device=q.device)
    sinks_arg = sinks if sinks is not None else q
    _short_prefill_kernel[(bsz, hkv, triton.cdiv(max_q_len * group, block_m) * num_splits)](
        q, k_cache, v_cache, block_tables, context_lens, cu_seqlens_q, mid_o, mid_ml, sinks_arg, out,
        q.stride(0), q.stride(1), k_cache.stride(0), k_cache.stride(1), k_cache.stride(2), v_cache.stride(0),
        v_cache.stride(1), v_cache.stride(2), block_tables.stride(0), out.stride(0), out.stride(1), hq,
        scale * LOG2E, window or 0, block_size, G=group, D=d, BLOCK_M=block_m, BLOCK_N=block_n,
        NUM_SPLITS=num_splits, HAS_WINDOW=window is not None, HAS_SINKS=sinks is not None,
        num_warps=num_warps, num_stages=num_stages)
    if num_splits > 1:
        _decode_combine_kernel[(tq, hq)](mid_o, mid_ml, sinks_arg, out, out.stride(0), out.stride(1), hq, D=d,
                                         NUM_SPLITS=num_splits, S_PAD=triton.next_power_of_2(num_splits),
                                         HAS_SINKS=sinks is not None, num_warps=4)
    return out


def short_prefill_attention_ref(q, k_cache, v_cache, block_tables, context_lens, cu_seqlens_q, max_q_len, scale,
                                sinks=None, window=None, num_splits=8, block_m=64, block_n=64, num_warps=4,
                                num_stages=2) -> torch.Tensor:
    return paged_prefill_attention_ref(q, k_cache, v_cache, block_tables, context_lens, cu_seqlens_q, max_q_len,
                                       scale, sinks, window)
