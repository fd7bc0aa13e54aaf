"""How many KV blocks to allocate: what the caller asked for, or what fits in the GPU memory
left after the weights (minus headroom for activations), or a modest default on CPU."""
from __future__ import annotations

import os

import torch

from ..spec import ModelSpec
from .kv_cache import PagedKVCache

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


def plan_num_blocks(spec: ModelSpec, dtype: torch.dtype, device: torch.device, block_size: int, *,
                    max_context: int, max_batch_tokens: int, max_running: int,
                    num_blocks: int | None = None, max_kv_tokens: int | None = None,
                    headroom_bytes: int | None = None, mem_info: tuple[int, int] | None = None,
                    kv_heads: int | None = None) -> int:
    """mem_info: (free, total) bytes, read from the device when None (tests pass numbers; under
    tensor parallelism, the GPU with the least free memory). kv_heads: the KV heads one GPU holds
    (default: all of the model's)."""
    per_block = PagedKVCache.bytes_per_block(spec.num_layers, block_size, kv_heads or spec.num_kv_heads,
                                             spec.head_dim, dtype)
    if num_blocks is not None:
        return int(num_blocks)
    if max_kv_tokens is not None:
        return -(-int(max_kv_tokens) // block_size)
    # Never more than every running sequence at full context could use.
    cap = -(-max_context * max_running // block_size)
    if device.type == "cuda":
        free, total = mem_info or torch.cuda.mem_get_info(device)
        headroom = headroom_bytes if headroom_bytes is not None else activation_headroom(
            spec, max_batch_tokens, max_running, total)
        n = (free - headroom) // per_block
        need = -(-min(max_context, 4096) // block_size)
        if n < need:
            raise KVMemoryError(
                f"only {free / GIB:.1f} GiB of GPU memory is free after loading the weights; with "
                f"{headroom / GIB:.1f} GiB kept for activations that leaves room for {max(n, 0) * block_size} "
                f"KV tokens ({per_block * need / GIB:.2f} GiB needed for {need * block_size}). Use a "
                "quantised checkpoint (FP8 / MXFP4), more GPUs, or a smaller --max-context")
        return int(min(n, cap))
    tokens = min(2 * max_context, CPU_DEFAULT_TOKENS)
    n = min(-(-tokens // block_size), cap)
    try:  # a quarter of the free RAM at most
        avail = os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
        n = min(n, max(avail // 4 // per_block, 1))
    except (ValueError, OSError, AttributeError):
        pass
    return int(n)
