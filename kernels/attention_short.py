"""Prefill attention for chunks of a few queries after long contexts: the query heads of a KV head
packed into one tile's rows, the keys split over programs.

The paged prefill kernel (attention_prefill.py) gives each query head its own programs, each with
a tile of 64-128 query rows. A chunk of a few tokens after a long context (a short turn late in a
long chat) leaves most of those rows empty, and each of a KV head's G query heads walks the same
keys (bench/NOTES-attention.md, "Short chunks after long contexts"). Here row r of a tile is query
r // G of head kvh * G + r % G, so a chunk of n tokens fills n * G rows a KV head; and the keys up
to a tile's last query are split into parts of at least `split_keys` keys (at most NUM_SPLITS;
longer where the batch has work enough for every program), as the decode kernel splits them
(attention_decode.py), whose combine launch merges the parts' partial maxima, sums and rows and
adds gpt-oss's sinks. A tile of one part finishes its rows itself.

The grid is a fixed number of programs a KV head, each walking every P-th (sequence, tile, part)
work item of the batch, which it lists from the query starts and context lengths on the device.
So a captured graph holds the launch for any lengths, its unused sequence slots cost nothing, and
a short context takes one part where a long one takes many.

`short_prefill_attention` has paged_prefill_attention's signature (plus its own tile options);
`short_prefill_attention_ref` is the same reference. The engine (engine/layers/attention.py) gives
it full-attention steps of a few queries a sequence (`short_prefill_queries`; in chunk graphs
whatever the context, eagerly past SHORT_SPLIT_KEYS keys), and the leading sequences of a few
queries at long contexts of a step that also reads a long chunk where they are not all single
queries (those take the decode kernel). With `longest_taken` it shares a batch with the paged
kernel (its `skip_up_to`), each taking its own sequences, decided on the device.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from .attention_decode import LOG2E, _decode_combine_kernel, _finish_rows
from .attention_prefill import _attend_keys, paged_prefill_attention_ref
from .gpu_facts import sm_count

# (program, KV head) pairs launched an SM (programs of 4 warps: 32 x 64 tiles on 4 warps, 8 an SM,
# ran up to 25% faster than 64 x 32 on 8 warps, 4 an SM; BENCHMARKS.md, "Short chunks after long
# contexts")
PROGRAMS_PER_SM = 8
# Where the engine takes this kernel over the paged one: chunks whose queries fill up to
# SHORT_MAX_ROWS (query, head) rows a KV head (64 of gpt-oss's queries, 8 heads a KV head; 42 of
# GLM-4.5V's 12: its 64-query chunks ran 0-50% slower here than on the paged kernel, whose wider
# tiles do better once the rows fill them), the keys split in parts of at least SHORT_SPLIT_KEYS
# (512: up to 35% faster than parts of 1024 after 512-8192 keys, as fast after 30K, 3-12% slower in
# two cases of 32-64 queries), at most SHORT_MAX_SPLITS parts (BENCHMARKS.md, "Short chunks after
# long contexts").
SHORT_MAX_ROWS = 512
SHORT_SPLIT_KEYS = 512
SHORT_MAX_SPLITS = 16
# A step whose leading sequences have a few queries each (decoding chats) and whose later ones
# have more (a prompt's chunk) gives the leading ones to this kernel (or, one query each, to the
# decode kernel) when one has this many keys: one query after 8192 keys took 28-31 us here and
# 10-16 us on the decode kernel against the paged kernel's 177 / 256 (gpt-oss / GLM-4.5V heads,
# H100; BENCHMARKS.md, "Short chunks after long contexts").
MIXED_SPLIT_MIN_KEYS = 8192
# Whether a batch with work enough for every program takes longer parts than SHORT_SPLIT_KEYS: an
# even share of its (row tile x key) work over the programs left once each tile has one, so the
# work items are no more than the programs and fewer parts are combined (a step of 8 decoding
# chats and a short turn after 30K keys took 16 parts a tile, 1.7 rounds of the programs). On an
# H200, kernel alone from CUDA graphs: such steps (16-32 queries beside 8 one-query sequences after
# 8K-30K keys) 4-9% shorter (GLM-4.5V 667 -> 614 us at 16 queries after 30K, gpt-oss 417 -> 400),
# 32 GLM-4.5V queries alone 6% shorter, the rest within 1 us (BENCHMARKS.md, "Short chunks after
# long contexts").
EVEN_PARTS = True


def short_prefill_splits(max_context: int) -> int:
    """num_splits of short_prefill_attention (with split_keys SHORT_SPLIT_KEYS) for a batch whose
    longest context is max_context keys (a captured graph: the bound it holds)."""
    return max(1, min(SHORT_MAX_SPLITS, -(-max_context // SHORT_SPLIT_KEYS)))


def short_prefill_queries(num_heads: int, num_kv_heads: int) -> int:
    """The most queries a sequence for which the engine takes this kernel: SHORT_MAX_ROWS over the
    query heads a KV head."""
    return max(1, SHORT_MAX_ROWS // (num_heads // num_kv_heads))


@triton.jit
def _short_tile(q_ptr, k_ptr, v_ptr, table_row, mid_o_ptr, mid_ml_ptr, sinks_ptr, out_ptr, counts_ptr,
                q_start, q_len, ctx, kvh, tile, split, used, stride_qt, stride_qh, stride_kb, stride_ks, stride_kh,
                stride_vb, stride_vs, stride_vh, stride_ot, stride_oh, HQ, qk_scale, window, block_size,
                G: tl.constexpr, D: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                NUM_SPLITS: tl.constexpr, HAS_WINDOW: tl.constexpr, HAS_SINKS: tl.constexpr):
    """One work item: split `split` of `used` over the keys of row tile `tile` of one sequence's
    chunk (q_len queries, the last of its ctx tokens) and KV head kvh."""
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
    per_split = tl.cdiv(tl.cdiv(hi - lo, used), BLOCK_N) * BLOCK_N
    start = lo + split * per_split
    end = tl.minimum(start + per_split, hi)

    m = tl.full((BLOCK_M,), float("-inf"), dtype=tl.float32)
    l = tl.zeros((BLOCK_M,), dtype=tl.float32)
    acc = tl.zeros((BLOCK_M, D), dtype=tl.float32)
    for j0 in range(start, end, BLOCK_N):
        m, l, acc = _attend_keys(q, m, l, acc, k_ptr, v_ptr, table_row, kvh, j0, end, pos, window, block_size,
                                 stride_ks, stride_kb, stride_kh, stride_vb, stride_vs, stride_vh, d,
                                 BLOCK_N, True, HAS_WINDOW)

    if used == 1:  # the whole key range: finish as the combine would
        out = _finish_rows(m, l, acc, sinks_ptr, heads, r_mask, HAS_SINKS)
        tl.store(out_ptr + rows[:, None] * stride_ot + heads[:, None] * stride_oh + d[None, :],
                 out.to(out_ptr.dtype.element_ty), mask=r_mask[:, None])
        if NUM_SPLITS > 1:
            tl.store(counts_ptr + rows * HQ + heads, 0, mask=r_mask)
    else:
        # the decode combine's layout, with the chunk's token rows as its sequences
        part = (rows * HQ + heads) * NUM_SPLITS + split
        tl.store(mid_o_ptr + part[:, None] * D + d[None, :], acc, mask=r_mask[:, None])
        tl.store(mid_ml_ptr + part * 2, m, mask=r_mask)
        tl.store(mid_ml_ptr + part * 2 + 1, l, mask=r_mask)
        if split == 0:
            tl.store(counts_ptr + rows * HQ + heads, used, mask=r_mask)


@triton.jit
def _short_prefill_kernel(q_ptr, k_ptr, v_ptr, tables_ptr, lens_ptr, cu_ptr, mid_o_ptr, mid_ml_ptr, sinks_ptr,
                          out_ptr, counts_ptr, stride_qt, stride_qh, stride_kb, stride_ks, stride_kh, stride_vb,
                          stride_vs, stride_vh, stride_tb, stride_ot, stride_oh, HQ, qk_scale, window, block_size,
                          num_seqs, split_keys, longest_taken, G: tl.constexpr, D: tl.constexpr,
                          BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, NUM_SPLITS: tl.constexpr, B_PAD: tl.constexpr,
                          HAS_WINDOW: tl.constexpr, HAS_SINKS: tl.constexpr, BALANCED: tl.constexpr):
    """Program (p, KV head): the work items p, p + P, p + 2P, ... of the whole batch (P programs).

    Every program lists the items from the query starts and context lengths alone: sequence b has
    cdiv(q_len * G, BLOCK_M) row tiles (none past longest_taken queries: another call's), each
    split `used_b` ways (its keys over the part length, at least 1, at most NUM_SPLITS; the part
    length is split_keys or, where more, the batch's tile-keys over the P programs less one a tile;
    split_keys 0: NUM_SPLITS), and items are numbered sequence by sequence, tile by tile. So the
    grid depends on no length: a CUDA graph holds it, sequences with no queries cost nothing, and a
    short context takes one split that finishes its own rows."""
    kvh = tl.program_id(1)
    seq = tl.arange(0, B_PAD)
    in_batch = seq < num_seqs
    starts = tl.load(cu_ptr + seq, mask=in_batch, other=0)
    q_lens = tl.load(cu_ptr + seq + 1, mask=in_batch, other=0) - starts
    ctxs = tl.load(lens_ptr + seq, mask=in_batch, other=0)
    keys = ctxs
    if HAS_WINDOW:
        keys = tl.minimum(ctxs, window + q_lens - 1)
    tiles = tl.where(q_lens <= longest_taken, tl.cdiv(q_lens * G, BLOCK_M), 0)
    used = tl.full((B_PAD,), NUM_SPLITS, tl.int32)
    if split_keys > 0:
        # parts of at least split_keys keys, and no shorter than an even share of the batch's keys
        # over the programs left once every tile has one: then the items are no more than the
        # programs unless the tiles alone are (no second round for a few programs), and a batch with
        # plenty of work takes fewer parts (less to combine)
        part = split_keys
        if BALANCED:
            work = tl.sum(tiles.to(tl.int64) * keys, 0)
            free = tl.maximum(tl.num_programs(0) - tl.sum(tiles, 0), 1)
            part = tl.maximum(tl.cdiv(work, free), split_keys)
        used = tl.minimum(tl.maximum(tl.cdiv(keys, part), 1), NUM_SPLITS).to(tl.int32)
    items = tiles * used
    ends = tl.cumsum(items, 0)
    for w in range(tl.program_id(0), tl.sum(items, 0), tl.num_programs(0)):
        b = tl.sum((ends <= w).to(tl.int32), 0)
        this = seq == b
        u = tl.sum(tl.where(this, used, 0), 0)
        j = w - tl.sum(tl.where(this, ends - items, 0), 0)
        _short_tile(q_ptr, k_ptr, v_ptr, tables_ptr + b.to(tl.int64) * stride_tb, mid_o_ptr, mid_ml_ptr,
                    sinks_ptr, out_ptr, counts_ptr, tl.sum(tl.where(this, starts, 0), 0),
                    tl.sum(tl.where(this, q_lens, 0), 0), tl.sum(tl.where(this, ctxs, 0), 0), kvh, j // u, j % u,
                    u, stride_qt, stride_qh, stride_kb, stride_ks, stride_kh, stride_vb, stride_vs, stride_vh,
                    stride_ot, stride_oh, HQ, qk_scale, window, block_size, G, D, BLOCK_M, BLOCK_N, NUM_SPLITS,
                    HAS_WINDOW, HAS_SINKS)


def short_prefill_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                            block_tables: torch.Tensor, context_lens: torch.Tensor, cu_seqlens_q: torch.Tensor,
                            max_q_len: int, scale: float, sinks: torch.Tensor | None = None,
                            window: int | None = None, num_splits: int = 8, split_keys: int = 0, block_m: int = 32,
                            block_n: int = 64, num_warps: int = 4, num_stages: int = 2,
                            programs: int | None = None, out: torch.Tensor | None = None,
                            longest_taken: int | None = None, balanced_parts: bool | None = None) -> torch.Tensor:
    """q [Tq, Hq, D] (sequences packed by cu_seqlens_q [B+1] int32), caches [num_blocks, block_size,
    Hkv, D], block_tables [B, max_blocks] int32, context_lens [B] int32 (prefix + chunk), max_q_len:
    the longest chunk (host int). Returns [Tq, Hq, D] in q.dtype (written into `out` when given).
    num_splits: parts a row tile's keys are split into at most; split_keys: keys a part takes at
    least (a tile of fewer keys takes fewer parts, and so does a batch with work enough for all
    P programs; 0: always num_splits); block_m: (query, head) rows a tile; block_n: keys a step;
    programs: P, programs launched a KV head, each taking every P-th work item (default:
    PROGRAMS_PER_SM an SM over all KV heads). longest_taken: sequences of more queries are left to
    another call (their rows of `out` untouched; max_q_len then bounds only the sequences taken).
    balanced_parts: whether parts lengthen to an even share of the batch's work where that is more
    than split_keys (default EVEN_PARTS). The launches depend only on the shapes and max_q_len, so
    a CUDA graph can hold them."""
    tq, hq, d = q.shape
    _, block_size, hkv, _ = k_cache.shape
    if hq % hkv or d & (d - 1) or q.stride(-1) != 1 or k_cache.stride(-1) != 1 or v_cache.stride(-1) != 1:
        raise ValueError("need query heads a multiple of KV heads, a power-of-two head_dim and "
                         "q/caches contiguous along head_dim")
    group = hq // hkv
    out = torch.empty_like(q) if out is None else out
    bsz = cu_seqlens_q.numel() - 1
    if tq == 0 or bsz == 0:
        return out
    parts = tq * hq * num_splits if num_splits > 1 else 1
    mid_o = torch.empty((parts, d), dtype=torch.float32, device=q.device)
    mid_ml = torch.empty((parts, 2), dtype=torch.float32, device=q.device)
    # rows of sequences left to another call must read as finished (0) in the combine
    counts = (torch.empty if longest_taken is None else torch.zeros)((tq * hq if num_splits > 1 else 1,),
                                                                     dtype=torch.int32, device=q.device)
    sinks_arg = sinks if sinks is not None else q
    # no more programs than the batch can have work items
    most_items = bsz * triton.cdiv(max_q_len * group, block_m) * num_splits
    if programs is None:
        programs = max(1, min(PROGRAMS_PER_SM * sm_count(q.device) // hkv, most_items))
    _short_prefill_kernel[(programs, hkv)](
        q, k_cache, v_cache, block_tables, context_lens, cu_seqlens_q, mid_o, mid_ml, sinks_arg, out,
        counts, q.stride(0), q.stride(1), k_cache.stride(0), k_cache.stride(1), k_cache.stride(2), v_cache.stride(0),
        v_cache.stride(1), v_cache.stride(2), block_tables.stride(0), out.stride(0), out.stride(1), hq,
        scale * LOG2E, window or 0, block_size, bsz, split_keys,
        max_q_len if longest_taken is None else longest_taken, G=group, D=d, BLOCK_M=block_m, BLOCK_N=block_n,
        NUM_SPLITS=num_splits, B_PAD=max(16, triton.next_power_of_2(bsz)), HAS_WINDOW=window is not None,
        HAS_SINKS=sinks is not None, BALANCED=EVEN_PARTS if balanced_parts is None else balanced_parts,
        num_warps=num_warps, num_stages=num_stages)
    if num_splits > 1:
        _decode_combine_kernel[(tq, hq)](mid_o, mid_ml, sinks_arg, out, out.stride(0), out.stride(1), hq, D=d,
                                         NUM_SPLITS=num_splits, S_PAD=triton.next_power_of_2(num_splits),
                                         HAS_SINKS=sinks is not None, counts_ptr=counts, COUNTED=True,
                                         num_warps=4)
    return out


def short_prefill_attention_ref(q, k_cache, v_cache, block_tables, context_lens, cu_seqlens_q, max_q_len, scale,
                                sinks=None, window=None, num_splits=8, split_keys=0, block_m=32, block_n=64,
                                num_warps=4, num_stages=2, programs=None, out=None, longest_taken=None,
                                balanced_parts=None) -> torch.Tensor:
    out = torch.empty_like(q) if out is None else out
    if longest_taken is None:
        return paged_prefill_attention_ref(q, k_cache, v_cache, block_tables, context_lens, cu_seqlens_q, max_q_len,
                                           scale, sinks, window, out=out)
    full = paged_prefill_attention_ref(q, k_cache, v_cache, block_tables, context_lens, cu_seqlens_q, max_q_len,
                                       scale, sinks, window)
    for s, e in zip(cu_seqlens_q[:-1].tolist(), cu_seqlens_q[1:].tolist()):
        if e - s <= longest_taken:
            out[s:e] = full[s:e]
    return out
