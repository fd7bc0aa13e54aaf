"""Decode attention (one new query per sequence) over a paged KV cache, split over the sequence.

Cache layout: k_cache, v_cache [num_blocks, block_size, kv_heads, head_dim]; sequence b's
token j lives in block block_tables[b, j // block_size], slot j % block_size. The query is
the token at position context_lens[b] - 1, whose k/v are already in the cache.

Masking: keys 0..i, and with a sliding window only i - window < j (gpt-oss, models.md C.4).
Sinks: one logit per query head added to the softmax denominator with no value.

Flash-decoding: grid (B, kv_heads, num_splits); each program serves all G = Hq / Hkv query
heads of one KV head (the K/V tile is read once for the group) over one slice of the keys and
writes an unnormalised partial (acc, max, sum); a combine kernel merges the slices and adds
the sink. The last split program of each KV head merging them instead (arrival counts, as the
MoE router does) measured 1.5-9x slower at 64 splits, one head after another; with 8-32 splits
and all of them loaded at once it was 0.5-3 us slower than the same splits with the combine
launch from 16 splits, and fewer splits were slower anyway (BENCHMARKS.md, Kernels, 2026-12-04
late). With one split (short key ranges at large batches, sliding-window layers) the program
finishes the rows itself and there is no combine launch. num_splits depends only on static
shapes, so the launch is CUDA-graph safe.

The key loop as the compiler pipelines it (num_stages 2) keeps one shared-memory buffer per tile
for keys and values: tile i + 1's copies start only after tile i has been read from it, behind a
synchronous load of tile i + 1's pages, so every tile waits for two memory round trips one after
the other (bench/NOTES-attention.md). Writing the pipeline by hand (pages two tiles ahead, keys
and values one tile ahead in registers) halved the programs an SM holds and measured 4-25%
slower; it was removed.

rotary_decode_attention also takes over kernels/rotary.py's work for the decode step: each split
program rotates its q heads as it loads them, and the program whose keys include the new token
rotates that key, stores key and value in the cache and adds them to its sums from registers
(the cache slot is not read back in the same launch). One launch and one graph node fewer per
layer: a batch-1 step 1-2% shorter (BENCHMARKS.md).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from .gpu_facts import MEASURED_SMS, sm_count
from .rotary import apply_rotary_ref, rotate_loaded

LOG2E = 1.4426950408889634


@triton.jit
def _tile_pages(table_row, j0, loop_end, block_size, BLOCK_N: tl.constexpr):
    """The cache page of each key j0 + [0, BLOCK_N) of one sequence (int64; 0 past loop_end)."""
    j = j0 + tl.arange(0, BLOCK_N)
    return tl.load(table_row + j // block_size, mask=j < loop_end, other=0).to(tl.int64)


@triton.jit
def _tile_kv(k_ptr, v_ptr, kvh, page, j0, loop_end, block_size, stride_kb, stride_ks, stride_kh, stride_vb, stride_vs,
             stride_vh, d, BLOCK_N: tl.constexpr):
    """Keys and values j0 + [0, BLOCK_N) of KV head kvh ([BLOCK_N, D] each, 0 past loop_end), from
    their pages (_tile_pages)."""
    j = j0 + tl.arange(0, BLOCK_N)
    j_mask = j < loop_end
    slot = j % block_size
    k = tl.load(k_ptr + page[:, None] * stride_kb + slot[:, None] * stride_ks + kvh * stride_kh + d[None, :],
                mask=j_mask[:, None], other=0.0)
    v = tl.load(v_ptr + page[:, None] * stride_vb + slot[:, None] * stride_vs + kvh * stride_vh + d[None, :],
                mask=j_mask[:, None], other=0.0)
    return k, v


@triton.jit
def _attend_tile(q, k, v, j_mask, m, l, acc):
    """Online softmax over one key tile: q [G_PAD, D] (scaled, log2 domain), k / v [BLOCK_N, D],
    j_mask [BLOCK_N] the real keys; running max m, sum l [G_PAD] and acc [G_PAD, D] -> updated."""
    s = tl.dot(q, tl.trans(k))
    s = tl.where(j_mask[None, :], s, float("-inf"))
    m_new = tl.maximum(m, tl.max(s, axis=1))
    alpha = tl.exp2(m - m_new)
    p = tl.exp2(s - m_new[:, None])
    l = l * alpha + tl.sum(p, axis=1)
    acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v)
    return m_new, l, acc


@triton.jit
def _finish_rows(m, l, acc, sinks_ptr, heads, mask, HAS_SINKS: tl.constexpr):
    """Rows whose sums cover every key: running max m, sum l [R] and acc [R, D] (log2 domain) ->
    the attention output [R, D] float32, each head's sink (heads [R]; rows off mask read none)
    added to the denominator."""
    if HAS_SINKS:
        sink = tl.load(sinks_ptr + heads, mask=mask, other=0.0).to(tl.float32) * 1.4426950408889634
        m_all = tl.maximum(m, sink)
        alpha = tl.exp2(m - m_all)
        l = l * alpha + tl.exp2(sink - m_all)
        acc = acc * alpha[:, None]
    return acc / l[:, None]


@triton.jit
def _decode_split_kernel(q_ptr, k_ptr, v_ptr, tables_ptr, lens_ptr, mid_o_ptr, mid_ml_ptr, sinks_ptr, out_ptr,
                         stride_qb, stride_qh, stride_kb, stride_ks, stride_kh, stride_vb, stride_vs, stride_vh,
                         stride_tb, stride_ob, stride_oh, qk_scale, window, block_size, HQ,
                         kn_ptr, vn_ptr, stride_knb, stride_knh, stride_vnb, stride_vnh, cos_ptr, sin_ptr, stride_c,
                         slots_ptr,
                         G: tl.constexpr, G_PAD: tl.constexpr, D: tl.constexpr, BLOCK_N: tl.constexpr,
                         NUM_SPLITS: tl.constexpr, HAS_WINDOW: tl.constexpr, HAS_SINKS: tl.constexpr,
                         ROTARY: tl.constexpr = False, R: tl.constexpr = 2):
    """ROTARY: q is the new token's unrotated projection, kn / vn its key and value; the rotation
    of kernels/rotary.py (angles cos / sin [B, R]) is applied to q here, and the program whose key
    range holds the new token (position ctx - 1) rotates its key, stores key and value in the cache
    at slots[b] (skipped when negative) and adds them to its sums from registers, so no program
    reads that cache slot in this launch and the rotary launch before attention is saved. That
    program counts the new key first, then its cached keys."""
    b = tl.program_id(0)
    kvh = tl.program_id(1)
    split = tl.program_id(2)
    ctx = tl.load(lens_ptr + b)
    lo = 0
    if HAS_WINDOW:
        lo = tl.maximum(ctx - window, 0)
    per_split = tl.cdiv(tl.cdiv(ctx - lo, NUM_SPLITS), BLOCK_N) * BLOCK_N
    start = lo + split * per_split
    end = tl.minimum(start + per_split, ctx)

    g = tl.arange(0, G_PAD)
    d = tl.arange(0, D)
    heads = kvh * G + g
    g_mask = g < G
    q_rows = q_ptr + b * stride_qb + heads[:, None] * stride_qh
    q = tl.load(q_rows + d[None, :], mask=g_mask[:, None], other=0.0)
    loop_end = end
    if ROTARY:
        # rounded to q's dtype as the rotary kernel's output is
        q = rotate_loaded(q, q_rows, d[None, :], g_mask[:, None], cos_ptr + b * stride_c, sin_ptr + b * stride_c,
                          R).to(q_ptr.dtype.element_ty)
        loop_end = tl.minimum(end, ctx - 1)  # the new key joins from registers
    q = (q.to(tl.float32) * qk_scale).to(k_ptr.dtype.element_ty)  # scale folded in, log2 domain

    m = tl.full((G_PAD,), float("-inf"), dtype=tl.float32)
    l = tl.zeros((G_PAD,), dtype=tl.float32)
    acc = tl.zeros((G_PAD, D), dtype=tl.float32)
    if ROTARY:
        # The new key before the cached ones: taken after the loop, its loads and rotation were
        # held in registers through the loop (GLM-4.5V: 154 registers a thread against 120 this
        # way, three programs an SM against four; Triton 3.6, sm_90)
        if (start <= ctx - 1) & (ctx - 1 < end):
            kn_row = kn_ptr + b * stride_knb + kvh * stride_knh
            kn = tl.load(kn_row + d)
            kn = rotate_loaded(kn, kn_row, d, d < D, cos_ptr + b * stride_c, sin_ptr + b * stride_c, R)
            kn = kn.to(k_ptr.dtype.element_ty)
            vn = tl.load(vn_ptr + b * stride_vnb + kvh * stride_vnh + d).to(v_ptr.dtype.element_ty)
            slot = tl.load(slots_ptr + b).to(tl.int64)
            if slot >= 0:
                page, offset = slot // block_size, slot % block_size
                tl.store(k_ptr + page * stride_kb + offset * stride_ks + kvh * stride_kh + d, kn)
                tl.store(v_ptr + page * stride_vb + offset * stride_vs + kvh * stride_vh + d, vn)
            # one key, as a tile of one: the same products and roundings as the dots below
            s_new = tl.sum(q.to(tl.float32) * kn.to(tl.float32)[None, :], axis=1)
            m_new = tl.maximum(m, s_new)
            alpha = tl.exp2(m - m_new)
            p = tl.exp2(s_new - m_new)
            l = l * alpha + p
            acc = acc * alpha[:, None] + p.to(vn.dtype).to(tl.float32)[:, None] * vn.to(tl.float32)[None, :]
            m = m_new

    table_row = tables_ptr + b * stride_tb
    for j0 in range(start, loop_end, BLOCK_N):
        page = _tile_pages(table_row, j0, loop_end, block_size, BLOCK_N)
        k, v = _tile_kv(k_ptr, v_ptr, kvh, page, j0, loop_end, block_size, stride_kb, stride_ks, stride_kh,
                        stride_vb, stride_vs, stride_vh, d, BLOCK_N)
        m, l, acc = _attend_tile(q, k, v, j0 + tl.arange(0, BLOCK_N) < loop_end, m, l, acc)

    if NUM_SPLITS == 1:  # the whole key range: finish as the combine would
        out = _finish_rows(m, l, acc, sinks_ptr, heads, g_mask, HAS_SINKS)
        tl.store(out_ptr + b * stride_ob + heads[:, None] * stride_oh + d[None, :], out.to(out_ptr.dtype.element_ty),
                 mask=g_mask[:, None])
    else:
        row = (b * HQ + heads) * NUM_SPLITS + split
        tl.store(mid_o_ptr + row[:, None] * D + d[None, :], acc, mask=g_mask[:, None])
        tl.store(mid_ml_ptr + row * 2, m, mask=g_mask)
        tl.store(mid_ml_ptr + row * 2 + 1, l, mask=g_mask)


@triton.jit
def _decode_combine_kernel(mid_o_ptr, mid_ml_ptr, sinks_ptr, out_ptr, stride_ob, stride_oh, HQ,
                           D: tl.constexpr, NUM_SPLITS: tl.constexpr, S_PAD: tl.constexpr,
                           HAS_SINKS: tl.constexpr, counts_ptr=None, COUNTED: tl.constexpr = False):
    """COUNTED: counts [rows x HQ] int32 say how many of a row's first splits hold a partial (the
    rest wrote none); 0: the row was finished by its one split, nothing to merge."""
    b = tl.program_id(0)
    h = tl.program_id(1)
    s = tl.arange(0, S_PAD)
    s_mask = s < NUM_SPLITS
    if COUNTED:
        count = tl.load(counts_ptr + b * HQ + h)
        if count == 0:
            return
        s_mask = s < count
    d = tl.arange(0, D)
    row = (b * HQ + h) * NUM_SPLITS + s
    m = tl.load(mid_ml_ptr + row * 2, mask=s_mask, other=float("-inf"))
    l = tl.load(mid_ml_ptr + row * 2 + 1, mask=s_mask, other=0.0)
    o = tl.load(mid_o_ptr + row[:, None] * D + d[None, :], mask=s_mask[:, None], other=0.0)
    m_all = tl.max(m, axis=0)
    if HAS_SINKS:
        sink = tl.load(sinks_ptr + h).to(tl.float32) * 1.4426950408889634
        m_all = tl.maximum(m_all, sink)
    w = tl.where(s_mask & (m > float("-inf")), tl.exp2(m - m_all), 0.0)
    denom = tl.sum(l * w, axis=0)
    if HAS_SINKS:
        denom += tl.exp2(sink - m_all)
    out = tl.sum(o * w[:, None], axis=0) / denom
    tl.store(out_ptr + b * stride_ob + h * stride_oh + d, out.to(out_ptr.dtype.element_ty))


def default_num_splits(batch: int, kv_heads: int, max_context: int, block_n: int,
                       num_sms: int = MEASURED_SMS, head_dim: int = 64) -> int:
    """Up to ~8 (batch x kv head x split) programs per SM at head_dim 64, ~4 at 128 (rounded down:
    about as many as fit in shared memory at once), at most 64 splits and one per key tile.
    Measured on an H200 with the KV cache out of L2 and the key loop in two pipeline stages
    (bench/bench_attention_splits.py): at batch 8, 8K keys, 16 splits ran 42.5 us against 47.8
    us for 9 (gpt-oss, head_dim 64); at batch 1, GLM-4.5V (head_dim 128) ran 64 splits in 17.2 us
    against 19.9 us for 33; at batch 32, ~10 programs per SM (5 splits) ran 10-15% slower than
    either 3 or 8 splits. GLM-4.5V at ~4 programs per SM against ~8: batch 4 / 8 / 16 / 32 at 8K
    keys 44.9 / 76.3 / 138.2 / 257.7 us against 48.2 / 80.6 / 140.4 / 265.6, at 2048 keys 17.7 /
    28.8 / 46.5 / 74.9 against 19.9 / 29.9 / 49.2 / 85.2 (gpt-oss keeps ~8: at batch 32, 8K, 4
    splits 140.1 us against 160.2 for 2)."""
    tiles = triton.cdiv(max_context, block_n)
    if batch * kv_heads >= 64 and tiles <= 2:
        # enough programs without a split; one split finishes its rows without the combine launch
        # (8 sequences, 128 keys: 5.8 -> 5.6 us at head_dim 64, 7.3 -> 6.7 at 128; 32 sequences
        # 8.9 -> 7.3 and 13.3 -> 10.3). At batch 1 two splits stay faster (4.5 against 5.1 us).
        return 1
    per_sm = 8 if head_dim <= 64 else 4
    want = per_sm * num_sms // (batch * kv_heads)
    return max(1, min(want, 64, tiles))


def paged_decode_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                           block_tables: torch.Tensor, context_lens: torch.Tensor, scale: float,
                           sinks: torch.Tensor | None = None, window: int | None = None,
                           num_splits: int | None = None, block_n: int = 64, num_warps: int = 4,
                           num_stages: int = 2, max_registers: int = 0) -> torch.Tensor:
    """q [B, Hq, D]; k_cache/v_cache [num_blocks, block_size, Hkv, D]; block_tables [B, max_blocks]
    int32; context_lens [B] int32 (>= 1, the query's own key included); sinks [Hq] or None;
    window: keys i - window < j <= i. Returns [B, Hq, D] in q.dtype. num_splits, block_n (keys
    per tile), num_warps and num_stages of the split kernel: the compiler's pipeline over the key
    tiles (two stages measured faster than three or four at batch 1-8, bench/bench_attention_splits.py);
    max_registers: registers a thread of the split kernel may hold (the launch's maxnreg; 0: the
    compiler's choice), for more programs an SM."""
    return _decode_attention(q, k_cache, v_cache, block_tables, context_lens, scale, sinks, window, None,
                             num_splits, block_n, num_warps, num_stages, max_registers)


def rotary_decode_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cos: torch.Tensor,
                            sin: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                            slot_mapping: torch.Tensor, block_tables: torch.Tensor, context_lens: torch.Tensor,
                            scale: float, sinks: torch.Tensor | None = None, window: int | None = None,
                            num_splits: int | None = None, block_n: int = 64, num_warps: int = 4,
                            num_stages: int = 2, max_registers: int = 0) -> torch.Tensor:
    """apply_rotary(q, k, cos, sin, v, k_cache, v_cache, slot_mapping) followed by
    paged_decode_attention on the rotated q, in the attention launches alone: q [B, Hq, D], k / v
    [B, Hkv, D] the new token's projections before rotation, cos / sin [B, R] its angles (as
    kernels/rotary.py takes them), slot_mapping [B] its cache slot (negative: not stored). The
    split kernel rotates q as it loads it; the one program per sequence and KV head whose keys
    include the new token rotates the key, stores key and value in the cache and counts them
    from registers. Same results as the two calls, one launch fewer."""
    r = cos.shape[-1]
    if r > q.shape[-1] or r % 2 or cos.shape != sin.shape or cos.stride(-1) != 1 or sin.stride() != cos.stride():
        raise ValueError(f"cos/sin must be [B, R] contiguous with even R <= head_dim {q.shape[-1]}, got "
                         f"{tuple(cos.shape)}")
    if k.stride(-1) != 1 or v.stride(-1) != 1 or k.shape != v.shape or k.shape[1:] != k_cache.shape[2:]:
        raise ValueError(f"k and v [B, Hkv, D] must match the cache's heads and be contiguous along head_dim, got "
                         f"{tuple(k.shape)} / {tuple(v.shape)}")
    return _decode_attention(q, k_cache, v_cache, block_tables, context_lens, scale, sinks, window,
                             (k, v, cos, sin, slot_mapping), num_splits, block_n, num_warps, num_stages, max_registers)


def rotary_decode_attention_ref(q, k, v, cos, sin, k_cache, v_cache, slot_mapping, block_tables, context_lens,
                                scale, sinks=None, window=None, num_splits=None, block_n=64, num_warps=4,
                                num_stages=2, max_registers=0):
    q_rot, _ = apply_rotary_ref(q, k, cos, sin, v, k_cache, v_cache, slot_mapping)
    return paged_decode_attention_ref(q_rot, k_cache, v_cache, block_tables, context_lens, scale, sinks, window)


def _decode_attention(q, k_cache, v_cache, block_tables, context_lens, scale, sinks, window, rotary,
                      num_splits, block_n, num_warps, num_stages, max_registers=0) -> torch.Tensor:
    bsz, hq, d = q.shape
    _, block_size, hkv, dk = k_cache.shape
    if dk != d or hq % hkv or d & (d - 1):
        raise ValueError(f"q [.., {hq}, {d}] vs cache [.., {hkv}, {dk}]: need equal power-of-two head_dim "
                         "and query heads a multiple of KV heads")
    if k_cache.stride(-1) != 1 or v_cache.stride(-1) != 1 or q.stride(-1) != 1:
        raise ValueError("q and the caches must be contiguous along head_dim")
    group = hq // hkv
    if num_splits is None:
        # a windowed layer reads at most `window` keys, however long the table
        keys = block_tables.shape[1] * block_size if window is None else min(window, block_tables.shape[1] * block_size)
        num_splits = default_num_splits(bsz, hkv, keys, block_n, sm_count(q.device), d)
    out = torch.empty((bsz, hq, d), dtype=q.dtype, device=q.device)
    if bsz == 0:
        return out
    direct = num_splits == 1
    mid_o = out if direct else torch.empty((bsz, hq, num_splits, d), dtype=torch.float32, device=q.device)
    mid_ml = out if direct else torch.empty((bsz, hq, num_splits, 2), dtype=torch.float32, device=q.device)
    if rotary is None:
        new_kv = (q, q, 0, 0, 0, 0, q, q, 0, q)  # stand-ins, never read
        rot = dict()
    else:
        k, v, cos, sin, slots = rotary
        new_kv = (k, v, k.stride(0), k.stride(1), v.stride(0), v.stride(1), cos, sin, cos.stride(0), slots)
        rot = dict(ROTARY=True, R=cos.shape[-1])
    _decode_split_kernel[(bsz, hkv, num_splits)](
        q, k_cache, v_cache, block_tables, context_lens, mid_o, mid_ml, sinks if sinks is not None else q, out,
        q.stride(0), q.stride(1), k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        v_cache.stride(0), v_cache.stride(1), v_cache.stride(2), block_tables.stride(0), out.stride(0), out.stride(1),
        scale * LOG2E, window or 0, block_size, hq, *new_kv,
        G=group, G_PAD=max(16, triton.next_power_of_2(group)), D=d, BLOCK_N=block_n,
        NUM_SPLITS=num_splits, HAS_WINDOW=window is not None, HAS_SINKS=sinks is not None, **rot,
        num_warps=num_warps, num_stages=num_stages, **(dict(maxnreg=max_registers) if max_registers else {}))
    if direct:
        return out
    _decode_combine_kernel[(bsz, hq)](
        mid_o, mid_ml, sinks if sinks is not None else q, out, out.stride(0), out.stride(1), hq,
        D=d, NUM_SPLITS=num_splits, S_PAD=triton.next_power_of_2(num_splits), HAS_SINKS=sinks is not None)
    return out


def gather_paged(cache: torch.Tensor, table: torch.Tensor, length: int) -> torch.Tensor:
    """One sequence's first `length` tokens from a paged cache [num_blocks, block_size, Hkv, D]
    (any strides) -> [length, Hkv, D]: its whole pages copied out in one gather of rows (an
    element-wise index per token took ~4x as long on the GPU)."""
    pages = -(-length // cache.shape[1])
    return cache.index_select(0, table[:pages]).flatten(0, 1)[:length]


def masked_scores_ref(q: torch.Tensor, k: torch.Tensor, positions: torch.Tensor, scale: float,
                      window: int | None) -> torch.Tensor:
    """q [T, Hq, D] at positions [T]; k [S, Hkv, D] for positions 0..S-1 -> scaled scores
    [Hq, T, S] fp32, -inf where a query may not see a key (later, or outside the window)."""
    kf = k.float().repeat_interleave(q.shape[1] // k.shape[1], dim=1)
    scores = torch.einsum("thd,shd->hts", q.float(), kf) * scale
    j = torch.arange(k.shape[0], device=q.device)
    allowed = j[None, :] <= positions[:, None]
    if window is not None:
        allowed &= j[None, :] > positions[:, None] - window
    return scores.masked_fill(~allowed, float("-inf"))


def attention_rows_ref(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, positions: torch.Tensor, scale: float,
                       sinks: torch.Tensor | None, window: int | None) -> torch.Tensor:
    """q [T, Hq, D] at positions [T]; k, v [S, Hkv, D] for positions 0..S-1 -> [T, Hq, D] fp32."""
    t, hq, d = q.shape
    vf = v.float().repeat_interleave(hq // v.shape[1], dim=1)
    scores = masked_scores_ref(q, k, positions, scale, window)
    if sinks is not None:
        scores = torch.cat((scores, sinks.float().view(hq, 1, 1).expand(hq, t, 1)), dim=-1)
    probs = torch.softmax(scores, dim=-1)[..., : k.shape[0]]
    return torch.einsum("hts,shd->thd", probs, vf)


def paged_decode_attention_ref(q, k_cache, v_cache, block_tables, context_lens, scale, sinks=None, window=None,
                               num_splits=None, block_n=64, num_warps=4, num_stages=2, max_registers=0) -> torch.Tensor:
    outs = []
    for b in range(q.shape[0]):
        ctx = int(context_lens[b])
        k = gather_paged(k_cache, block_tables[b], ctx)
        v = gather_paged(v_cache, block_tables[b], ctx)
        pos = torch.tensor([ctx - 1], device=q.device)
        outs.append(attention_rows_ref(q[b:b + 1], k, v, pos, scale, sinks, window)[0])
    return torch.stack(outs).to(q.dtype)
