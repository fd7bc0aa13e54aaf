"""Group (token, expert) pairs by expert for the grouped MoE GEMMs.

Pair p = t * top_k + j is token t's j-th expert `topk_ids[t, j]`. Each expert's pairs are laid
out contiguously (in pair order) and padded up to a multiple of BLOCK_M, so that one GEMM
program (one M-block) only ever touches one expert's weights. Sizes are worst-case bounds that
depend only on (T, top_k, E, BLOCK_M), which keeps the launch shapes fixed for CUDA graphs.

Decode sizes go through one Triton program (_align_kernel: two passes over the pairs in chunks,
one launch). It walks the pairs serially, so its time grows with their number (H200: 50 us at
1024 pairs, 335 us at 8192, 660 us at 16384, GLM-4.5V's 2048-token prompt). From
ALIGN_CHUNKS_MIN_PAIRS pairs (fewer inside a CUDA graph, where launches cost no host time) two
launches spread that walk over programs of a chunk of pairs each (_align_by_chunks): the first
counts each chunk's pairs per expert, the second has every program derive the expert segments
from those counts and place its own chunk's pairs, plus a disjoint share of the padding slots and
of block_expert, so no slot has two writers and the result is the reference's without atomics
(7-18 us at 1024-32768 pairs). A stable sort in torch
did the same in ~15 launches and 140 us of GPU time from 8192 pairs, slower at every size
measured (bench/bench_moe_align.py). Neither path reads anything back to the host.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl


def padded_sizes(num_pairs: int, num_experts: int, block_m: int) -> tuple[int, int]:
    """(P_MAX, B_MAX): at most min(E, P) experts are non-empty, each wasting < block_m slots."""
    p_max = num_pairs + min(num_experts, num_pairs) * (block_m - 1)
    b_max = triton.cdiv(p_max, block_m)
    return b_max * block_m, b_max


@triton.jit
def _align_kernel(ids_ptr, sorted_ptr, block_expert_ptr, P, E, P_MAX, B_MAX,
                  BLOCK_M: tl.constexpr, E_PAD: tl.constexpr, CHUNK: tl.constexpr):
    e = tl.arange(0, E_PAD)
    offs = tl.arange(0, CHUNK)

    counts = tl.zeros((E_PAD,), dtype=tl.int32)
    for c0 in range(0, P, CHUNK):
        p = c0 + offs
        ids = tl.load(ids_ptr + p, mask=p < P, other=E_PAD)  # E_PAD matches no expert
        counts += tl.sum((ids[:, None] == e[None, :]).to(tl.int32), axis=0)
    padded = (counts + BLOCK_M - 1) // BLOCK_M * BLOCK_M
    ends = tl.cumsum(padded, axis=0)
    starts = ends - padded
    total = tl.sum(padded, axis=0)

    for q0 in range(0, P_MAX, CHUNK):
        q = q0 + offs
        tl.store(sorted_ptr + q, tl.zeros((CHUNK,), dtype=tl.int32) + P, mask=q < P_MAX)
    # the scatter below overwrites some of these slots from other threads of this program
    tl.debug_barrier()

    running = starts
    for c0 in range(0, P, CHUNK):
        p = c0 + offs
        ids = tl.load(ids_ptr + p, mask=p < P, other=E_PAD)
        onehot = (ids[:, None] == e[None, :]).to(tl.int32)
        before = tl.cumsum(onehot, axis=0) - onehot  # same-expert pairs earlier in this chunk
        pos = tl.sum((before + running[None, :]) * onehot, axis=1)
        tl.store(sorted_ptr + pos, p, mask=(p < P) & (ids >= 0))  # id -1: a pair no expert here takes
        running += tl.sum(onehot, axis=0)

    for b0 in range(0, B_MAX, CHUNK):
        b = b0 + offs
        start = b * BLOCK_M
        # segments are in expert order, so the expert owning `start` is the number of
        # segments that end at or before it (empty experts end where the previous one does)
        expert = tl.sum((ends[None, :] <= start[:, None]).to(tl.int32), axis=1)
        expert = tl.where(start < total, expert, -1)
        tl.store(block_expert_ptr + b, expert, mask=b < B_MAX)


@triton.jit
def _align_count_kernel(ids_ptr, counts_ptr, P, E,
                        E_PAD: tl.constexpr, CHUNK: tl.constexpr, SUB: tl.constexpr):
    """counts[c, e] = pairs of chunk c (pairs [c*CHUNK, (c+1)*CHUNK)) on expert e; one program a
    chunk, counts [num_chunks, E] int32, every entry written (no pre-filling needed)."""
    c = tl.program_id(0)
    e = tl.arange(0, E_PAD)
    offs = tl.arange(0, SUB)
    counts = tl.zeros((E_PAD,), dtype=tl.int32)
    for s in range(0, CHUNK, SUB):
        p = c * CHUNK + s + offs
        ids = tl.load(ids_ptr + p, mask=p < P, other=-1)  # -1 matches no expert
        counts += tl.sum((ids[:, None] == e[None, :]).to(tl.int32), axis=0)
    tl.store(counts_ptr + c * E + e, counts, mask=e < E)


@triton.jit
def _align_scatter_kernel(ids_ptr, counts_ptr, sorted_ptr, block_expert_ptr, P, E, P_MAX, B_MAX,
                          NUM_CHUNKS, SLOTS_PER_PROGRAM, BLOCKS_PER_PROGRAM,
                          BLOCK_M: tl.constexpr, BM_PAD: tl.constexpr, E_PAD: tl.constexpr,
                          CHUNK: tl.constexpr, SUB: tl.constexpr, ROWS: tl.constexpr,
                          PAD_COLS: tl.constexpr, SLOTS: tl.constexpr, BLOCKS: tl.constexpr):
    """Program c of NUM_CHUNKS: places chunk c's pairs in sorted_ids [P_MAX] from the per-chunk
    counts [NUM_CHUNKS, E] of _align_count_kernel, and writes its share of the rest: the padding
    slots of experts e with e % NUM_CHUNKS == c, the slots past the last segment within
    [c, c+1) * SLOTS_PER_PROGRAM, and block_expert [B_MAX] within [c, c+1) * BLOCKS_PER_PROGRAM.
    Every slot of sorted_ids and block_expert has exactly one writer in the launch."""
    c = tl.program_id(0)
    e = tl.arange(0, E_PAD)

    # every program derives the same segments from the same counts: the expert totals, and the
    # pairs of each expert in the chunks before this one (where its pairs go in the segment)
    counts = tl.zeros((E_PAD,), dtype=tl.int32)
    before = tl.zeros((E_PAD,), dtype=tl.int32)
    rows = tl.arange(0, ROWS)
    for r0 in range(0, NUM_CHUNKS, ROWS):
        r = r0 + rows
        cnt = tl.load(counts_ptr + r[:, None] * E + e[None, :], mask=(r[:, None] < NUM_CHUNKS) & (e[None, :] < E),
                      other=0)
        counts += tl.sum(cnt, axis=0)
        before += tl.sum(tl.where(r[:, None] < c, cnt, 0), axis=0)
    padded = (counts + BLOCK_M - 1) // BLOCK_M * BLOCK_M
    ends = tl.cumsum(padded, axis=0)
    starts = ends - padded
    total = tl.sum(padded, axis=0)

    offs = tl.arange(0, SUB)
    running = starts + before
    for s in range(0, CHUNK, SUB):
        p = c * CHUNK + s + offs
        ids = tl.load(ids_ptr + p, mask=p < P, other=-1)
        # rank among the same expert's pairs earlier in this sub-chunk from a [SUB, SUB] comparison:
        # reductions only, where _align_kernel's cumsum of the one-hot is a scan (slower on the H200)
        earlier = tl.sum(((ids[:, None] == ids[None, :]) & (offs[None, :] < offs[:, None])).to(tl.int32), axis=1)
        onehot = ids[:, None] == e[None, :]
        pos = tl.sum(tl.where(onehot, running[None, :], 0), axis=1) + earlier
        tl.store(sorted_ptr + pos, p, mask=(p < P) & (ids >= 0) & (ids < E))  # others: no expert here
        running += tl.sum(onehot.to(tl.int32), axis=0)

    # Padding inside segments: slots [starts + counts, ends), fewer than BLOCK_M an expert, none
    # of which a pair goes to; experts dealt round the programs.
    mine = ((e % NUM_CHUNKS) == c) & (e < E)
    cols = tl.arange(0, PAD_COLS)
    for j0 in range(0, BM_PAD, PAD_COLS):
        q = (starts + counts)[:, None] + j0 + cols[None, :]
        tl.store(sorted_ptr + q, tl.zeros((E_PAD, PAD_COLS), dtype=tl.int32) + P,
                 mask=mine[:, None] & (q < ends[:, None]))

    # Slots past the last segment ([total, P_MAX)): each program a stripe of [0, P_MAX), whose
    # slots below `total` belong to pairs and padding above
    slot_offs = tl.arange(0, SLOTS)
    for i0 in range(0, SLOTS_PER_PROGRAM, SLOTS):
        i = i0 + slot_offs
        q = c * SLOTS_PER_PROGRAM + i
        tl.store(sorted_ptr + q, tl.zeros((SLOTS,), dtype=tl.int32) + P,
                 mask=(i < SLOTS_PER_PROGRAM) & (q >= total) & (q < P_MAX))

    block_offs = tl.arange(0, BLOCKS)
    for i0 in range(0, BLOCKS_PER_PROGRAM, BLOCKS):
        i = i0 + block_offs
        b = c * BLOCKS_PER_PROGRAM + i
        start = b * BLOCK_M
        # the expert owning `start` is the number of segments ending at or before it (see _align_kernel)
        expert = tl.sum((ends[None, :] <= start[:, None]).to(tl.int32), axis=1)
        expert = tl.where(start < total, expert, -1)
        tl.store(block_expert_ptr + b, expert, mask=(i < BLOCKS_PER_PROGRAM) & (b < B_MAX))


# From this many pairs the chunked kernels replace the one-program kernel, whose serial walk
# over the pairs grows with their number. Inside a CUDA graph the launches cost no host time and
# the chunks are faster from 256 pairs (H200: 10-15 against 19-24 us there, 10-12 against 49-52
# us at 1024); launched eagerly (prefill) their two launches cost 60-115 us of host time against
# the one kernel's 28-50 us, which its serial walk overtakes from ~2048 pairs (90 us, 172 at 4096;
# bench/bench_moe_align.py). Same result either way.
ALIGN_CHUNKS_MIN_PAIRS = 2048
ALIGN_CHUNKS_MIN_PAIRS_IN_GRAPH = 256
# Pairs per chunk program: at least ALIGN_CHUNK_PAIRS (a program's time grows with its pairs),
# more where that would make over ALIGN_MAX_CHUNKS chunks (every program reads every chunk's
# counts, so the second launch's time grows with their number too). H200, graph replay, 128
# experts: 7 us at 1024 pairs, 10 us at 8192, 13 us at 16384 (chunks of 64 always: 20 us there)
ALIGN_CHUNK_PAIRS = 64
ALIGN_MAX_CHUNKS = 128


def _outputs_and_ids(topk_ids: torch.Tensor, p_max: int, b_max: int):
    """-> (sorted_ids [P_MAX], block_expert [B_MAX]) int32, unfilled, and the ids flat as int32."""
    sorted_ids = torch.empty(p_max, dtype=torch.int32, device=topk_ids.device)
    block_expert = torch.empty(b_max, dtype=torch.int32, device=topk_ids.device)
    ids = topk_ids.reshape(-1)
    return sorted_ids, block_expert, ids if ids.dtype == torch.int32 else ids.to(torch.int32)


def _align_by_kernel(topk_ids: torch.Tensor, num_experts: int, block_m: int, p_max: int,
                     b_max: int) -> tuple[torch.Tensor, torch.Tensor]:
    """moe_align's result from the one-program kernel (one launch)."""
    sorted_ids, block_expert, ids = _outputs_and_ids(topk_ids, p_max, b_max)
    num_pairs = ids.numel()
    if num_pairs == 0:
        return sorted_ids, block_expert
    e_pad = triton.next_power_of_2(num_experts)
    chunk = max(16, min(64, 8192 // e_pad))
    _align_kernel[(1,)](ids, sorted_ids, block_expert, num_pairs, num_experts, p_max, b_max,
                        BLOCK_M=block_m, E_PAD=e_pad, CHUNK=chunk, num_warps=8)
    return sorted_ids, block_expert


def _align_by_chunks(topk_ids: torch.Tensor, num_experts: int, block_m: int, p_max: int,
                     b_max: int) -> tuple[torch.Tensor, torch.Tensor]:
    """moe_align's result from two launches over chunks of pairs (ALIGN_CHUNK_PAIRS or more, a
    power of two): the per-chunk expert counts [num_chunks, E] (_align_count_kernel), then each
    chunk's pairs placed from them (_align_scatter_kernel). Grids and sizes depend only on
    (pairs, E, block_m)."""
    sorted_ids, block_expert, ids = _outputs_and_ids(topk_ids, p_max, b_max)
    num_pairs, dev = ids.numel(), ids.device
    if num_pairs == 0:
        return sorted_ids, block_expert
    e_pad = triton.next_power_of_2(num_experts)
    chunk = max(ALIGN_CHUNK_PAIRS, triton.next_power_of_2(triton.cdiv(num_pairs, ALIGN_MAX_CHUNKS)))
    num_chunks = triton.cdiv(num_pairs, chunk)
    sub = min(chunk, max(16, min(64, 8192 // e_pad)))  # pairs a step: [sub, E_PAD] and [sub, sub] tiles
    tile = max(1, 4096 // e_pad)  # rows of the other [rows, E_PAD] tiles
    bm_pad = triton.next_power_of_2(block_m)
    slots_per_program, blocks_per_program = triton.cdiv(p_max, num_chunks), triton.cdiv(b_max, num_chunks)
    counts = torch.empty((num_chunks, num_experts), dtype=torch.int32, device=dev)
    _align_count_kernel[(num_chunks,)](ids, counts, num_pairs, num_experts, E_PAD=e_pad, CHUNK=chunk, SUB=sub,
                                       num_warps=4)
    _align_scatter_kernel[(num_chunks,)](
        ids, counts, sorted_ids, block_expert, num_pairs, num_experts, p_max, b_max, num_chunks,
        slots_per_program, blocks_per_program, BLOCK_M=block_m, BM_PAD=bm_pad, E_PAD=e_pad, CHUNK=chunk, SUB=sub,
        ROWS=min(tile, triton.next_power_of_2(num_chunks)), PAD_COLS=min(bm_pad, tile),
        SLOTS=min(1024, triton.next_power_of_2(slots_per_program)),
        BLOCKS=min(max(16, tile), triton.next_power_of_2(blocks_per_program)), num_warps=4)
    return sorted_ids, block_expert


def moe_align(topk_ids: torch.Tensor, num_experts: int, block_m: int) -> tuple[torch.Tensor, torch.Tensor]:
    """topk_ids [T, k] int -> sorted_ids [P_MAX] int32 (pair indices grouped by expert, padding
    slots hold P = T*k), block_expert [B_MAX] int32 (expert of each BLOCK_M slice, -1 unused)."""
    num_pairs = topk_ids.numel()
    p_max, b_max = padded_sizes(num_pairs, num_experts, block_m)
    capturing = topk_ids.is_cuda and torch.cuda.is_current_stream_capturing()
    min_pairs = ALIGN_CHUNKS_MIN_PAIRS_IN_GRAPH if capturing else ALIGN_CHUNKS_MIN_PAIRS
    align = _align_by_chunks if num_pairs >= min_pairs else _align_by_kernel
    return align(topk_ids, num_experts, block_m, p_max, b_max)


def moe_align_ref(topk_ids: torch.Tensor, num_experts: int, block_m: int) -> tuple[torch.Tensor, torch.Tensor]:
    num_pairs = topk_ids.numel()
    p_max, b_max = padded_sizes(num_pairs, num_experts, block_m)
    flat = topk_ids.reshape(-1).to(torch.int64).cpu()
    sorted_ids = torch.full((p_max,), num_pairs, dtype=torch.int32)
    block_expert = torch.full((b_max,), -1, dtype=torch.int32)
    pos = 0
    for ex in range(num_experts):
        pairs = (flat == ex).nonzero().flatten()
        if len(pairs) == 0:
            continue
        sorted_ids[pos:pos + len(pairs)] = pairs.to(torch.int32)
        n_blocks = triton.cdiv(len(pairs), block_m)
        block_expert[pos // block_m: pos // block_m + n_blocks] = ex
        pos += n_blocks * block_m
    return sorted_ids.to(topk_ids.device), block_expert.to(topk_ids.device)
