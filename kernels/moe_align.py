"""Group (token, expert) pairs by expert for the grouped MoE GEMMs.

Pair p = t * top_k + j is token t's j-th expert `topk_ids[t, j]`. Each expert's pairs are laid
out contiguously (in pair order) and padded up to a multiple of BLOCK_M, so that one GEMM
program (one M-block) only ever touches one expert's weights. Sizes are worst-case bounds that
depend only on (T, top_k, E, BLOCK_M), which keeps the launch shapes fixed for CUDA graphs.

Decode sizes go through one Triton program (_align_kernel: two passes over the pairs in chunks,
one launch). It walks the pairs serially, so long prefills' pairs take it hundreds of
microseconds a layer (H200: 335 us at 8192 pairs, 660 us at 16384, GLM-4.5V's 2048-token
prompt); from ALIGN_SORT_MIN_PAIRS pairs a stable sort and a few scans in torch (_align_by_sort,
no host synchronisation) do the same grouping instead. The sort's ~15 launches cost more host
time than one launch (0.5-1 ms a call launched eagerly on the H200 machine,
bench/bench_moe_align.py), which only a prefill keeping the GPU busy for milliseconds a layer
hides; hence the high threshold.
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


def _align_by_sort(topk_ids: torch.Tensor, num_experts: int, block_m: int, p_max: int,
                   b_max: int) -> tuple[torch.Tensor, torch.Tensor]:
    """moe_align's result from a stable sort of the pairs by expert (pairs of id -1 last and
    dropped), without reading anything back to the host."""
    ids = topk_ids.reshape(-1).to(torch.int64)
    num_pairs, dev = ids.numel(), ids.device
    key = torch.where(ids >= 0, ids, num_experts)  # the pairs no expert here takes sort last
    order = torch.sort(key, stable=True).indices  # grouped by expert, pair order within each
    counts = torch.zeros(num_experts + 1, dtype=torch.int64, device=dev).scatter_add_(0, key, torch.ones_like(key))
    counts = counts[:num_experts]
    padded = (counts + block_m - 1) // block_m * block_m
    ends = torch.cumsum(padded, 0)
    first_sorted = torch.cumsum(counts, 0) - counts  # where each expert's pairs begin in `order`
    expert = key[order]
    real = expert < num_experts
    e = expert.clamp(max=num_experts - 1)
    rank = torch.arange(num_pairs, device=dev) - first_sorted[e]
    slot = torch.where(real, ends[e] - padded[e] + rank, p_max)  # dropped pairs land past the end
    sorted_ids = torch.full((p_max + 1,), num_pairs, dtype=torch.int32, device=dev)
    sorted_ids.scatter_(0, slot, order.to(torch.int32))
    start = torch.arange(b_max, device=dev) * block_m
    block_expert = torch.searchsorted(ends, start, right=True)
    block_expert = torch.where(start < ends[-1], block_expert, -1).to(torch.int32)
    return sorted_ids[:p_max], block_expert


# From this many pairs the sort replaces the one-program kernel (GLM-4.5V-FP8, 2048-token prompt
# = 16384 pairs: time to first token 240.9 -> 218.7 ms; BENCHMARKS.md)
ALIGN_SORT_MIN_PAIRS = 8192


def _align_by_kernel(topk_ids: torch.Tensor, num_experts: int, block_m: int, p_max: int,
                     b_max: int) -> tuple[torch.Tensor, torch.Tensor]:
    """moe_align's result from the one-program kernel (one launch)."""
    num_pairs, dev = topk_ids.numel(), topk_ids.device
    sorted_ids = torch.empty(p_max, dtype=torch.int32, device=dev)
    block_expert = torch.empty(b_max, dtype=torch.int32, device=dev)
    if num_pairs == 0:
        return sorted_ids, block_expert
    ids = topk_ids.reshape(-1)
    ids = ids if ids.dtype == torch.int32 else ids.to(torch.int32)
    e_pad = triton.next_power_of_2(num_experts)
    chunk = max(16, min(64, 8192 // e_pad))
    _align_kernel[(1,)](ids, sorted_ids, block_expert, num_pairs, num_experts, p_max, b_max,
                        BLOCK_M=block_m, E_PAD=e_pad, CHUNK=chunk, num_warps=8)
    return sorted_ids, block_expert


def moe_align(topk_ids: torch.Tensor, num_experts: int, block_m: int) -> tuple[torch.Tensor, torch.Tensor]:
    """topk_ids [T, k] int -> sorted_ids [P_MAX] int32 (pair indices grouped by expert, padding
    slots hold P = T*k), block_expert [B_MAX] int32 (expert of each BLOCK_M slice, -1 unused)."""
    num_pairs = topk_ids.numel()
    p_max, b_max = padded_sizes(num_pairs, num_experts, block_m)
    align = _align_by_sort if num_pairs >= ALIGN_SORT_MIN_PAIRS else _align_by_kernel
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
