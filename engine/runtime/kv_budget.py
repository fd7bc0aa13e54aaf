"""How many KV blocks to allocate: what the caller asked for, or what fits in the GPU memory
left after the weights (minus headroom for activations), or a modest default on CPU.

With sliding-window layers (gpt-oss) the cache has two groups (kv_cache.py). The sliding group
only needs the blocks its running sequences' windows and chunks span (the scheduler releases the
rest): at most ceil((window - 1) / block_size) + 2 blocks per running sequence plus the blocks of
one step's tokens, plus as much again per sequence for the prefix cache's released windows. It
gets that (never more than the full group, and at most half of the memory budget); the full
group, whose blocks hold only the full-attention layers, gets the rest. A block count asked for
(num_blocks or max_kv_tokens) sizes the full group, which bounds every conversation's context.
"""
from __future__ import annotations

import os
from dataclasses import dataclass

import torch

from ..spec import ModelSpec
from .kv_cache import PagedKVCache, sliding_layers

GIB = 1 << 30
CPU_DEFAULT_TOKENS = 16384


class KVMemoryError(RuntimeError):
    pass


def activation_headroom(spec: ModelSpec, max_batch_tokens: int, max_running: int, total_bytes: int) -> int:
    """Bytes kept free for one step's temporaries: a fixed reserve (allocator slack, CUDA
    workspaces), hidden-size buffers for every token of a chunk, and the sampled rows' logits."""
    hidden = max_batch_tokens * spec.hidden_size * 4 * 16
    logits = max_running * spec.vocab_size * 4 * 4
    return max(GIB + GIB // 2, total_bytes // 20) + hidden + logits


@dataclass(frozen=True)
class KVPlan:
    """num_blocks: the full group's pool (every layer's, without sliding layers); num_sliding_blocks:
    the sliding group's pool (0: one group)."""

    num_blocks: int
    num_sliding_blocks: int = 0


def sliding_blocks_in_use(window: int, block_size: int, max_running: int, max_batch_tokens: int) -> int:
    """The most sliding-group blocks running sequences hold at once. A sequence fed a chunk of n
    tokens from position s holds the blocks spanning [s - window + 1, s + n), at most
    ceil((window - 1) / bs) + ceil(n / bs) + 1 <= ceil((window - 1) / bs) + 2 + n / bs, and one
    step's chunks add up to at most max_batch_tokens."""
    return max_running * (-(-(window - 1) // block_size) + 2) + -(-max_batch_tokens // block_size)


def plan_kv_blocks(spec: ModelSpec, dtype: torch.dtype, device: torch.device, block_size: int, *,
                   max_context: int, max_batch_tokens: int, max_running: int,
                   num_blocks: int | None = None, max_kv_tokens: int | None = None,
                   num_sliding_blocks: int | None = None, headroom_bytes: int | None = None,
                   mem_info: tuple[int, int] | None = None, kv_heads: int | None = None) -> KVPlan:
    """mem_info: (free, total) bytes, read from the device when None (tests pass numbers; under
    tensor parallelism, the GPU with the least free memory). kv_heads: the KV heads one GPU holds
    (default: all of the model's). num_blocks / max_kv_tokens: the full group's size;
    num_sliding_blocks: the sliding group's (default: what its windows need, see above; 0: no
    sliding group, every layer keeps its whole context in one group)."""
    heads = kv_heads or spec.num_kv_heads
    windowed = len(sliding_layers(spec)) if num_sliding_blocks != 0 else 0
    per_full = PagedKVCache.bytes_per_block(spec.num_layers - windowed, block_size, heads, spec.head_dim, dtype)
    per_sliding = PagedKVCache.bytes_per_block(windowed, block_size, heads, spec.head_dim, dtype)
    want_sliding = 0
    if windowed:
        in_use = sliding_blocks_in_use(spec.sliding_window, block_size, max_running, max_batch_tokens)
        cached = max_running * (-(-(spec.sliding_window - 1) // block_size) + 1)
        want_sliding = num_sliding_blocks if num_sliding_blocks is not None else in_use + cached

    def plan(n: int, sliding: int) -> KVPlan:
        if not windowed:
            return KVPlan(int(n))
        if num_sliding_blocks is None:  # a sequence never holds more sliding than full blocks
            sliding = min(sliding, n)
        # One chat alone must fit its window and a prefill chunk, or it would wait forever.
        one = min(-(-(spec.sliding_window - 1 + max_batch_tokens) // block_size) + 1, n)
        if sliding < one:
            raise ValueError(f"{sliding} KV blocks for the sliding-window layers cannot hold one chat's window "
                             f"and prefill chunk ({one} blocks of {block_size} tokens); give num_sliding_blocks "
                             "at least that, a smaller max_batch_tokens, or leave num_sliding_blocks unset")
        return KVPlan(int(n), int(sliding))

    if num_blocks is not None:
        return plan(num_blocks, want_sliding)
    if max_kv_tokens is not None:
        return plan(-(-int(max_kv_tokens) // block_size), want_sliding)
    # Never more than every running sequence at full context could use.
    cap = -(-max_context * max_running // block_size)
    if device.type == "cuda":
        free, total = mem_info or torch.cuda.mem_get_info(device)
        headroom = headroom_bytes if headroom_bytes is not None else activation_headroom(
            spec, max_batch_tokens, max_running, total)
        budget = free - headroom
        sliding = min(want_sliding, max(budget, 0) // 2 // per_sliding) if windowed else 0
        n = (budget - sliding * per_sliding) // per_full
        if n < sliding and num_sliding_blocks is None:  # a small budget: as many of each
            n = sliding = budget // (per_full + per_sliding)
        need = -(-min(max_context, 4096) // block_size)
        if n < need:
            raise KVMemoryError(
                f"only {free / GIB:.1f} GiB of GPU memory is free after loading the weights; with "
                f"{headroom / GIB:.1f} GiB kept for activations that leaves room for {max(n, 0) * block_size} "
                f"KV tokens ({(per_full * need + per_sliding * sliding) / GIB:.2f} GiB needed for "
                f"{need * block_size}). Use a quantised checkpoint (FP8 / MXFP4), more GPUs, or a smaller "
                "--max-context")
        return plan(min(n, cap), sliding)
    tokens = min(2 * max_context, CPU_DEFAULT_TOKENS)
    n = min(-(-tokens // block_size), cap)
    try:  # a quarter of the free RAM at most
        avail = os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
        n = min(n, max(avail // 4 // (per_full + per_sliding), 1))
    except (ValueError, OSError, AttributeError):
        pass
    return plan(n, want_sliding)

