"""Prefill attention through cuDNN's fused attention on keys gathered out of the paged cache.

On Hopper, torch's SDPA runs cuDNN's fused attention kernel, which took a prompt's first 2048-query
chunk at 422-455 TFLOP/s on an H100 against the paged Triton kernel's ~290 (GLM-4.5V's shapes,
bench/NOTES-attention.md). torch exposes it (`aten._scaled_dot_product_cudnn_attention`, GQA by
head counts, each row's log-sum-exp on request) with a causal mask aligned to the first key only:
query i sees keys <= i. A chunk's Tq queries are the last of its sequence's Tk keys, so query i
must see keys <= Tk - Tq + i. Each sequence is therefore attended in two calls: its queries
against the cached prefix (keys 0 .. Tk-Tq-1, all of them visible: no mask) and against its own Tq
keys (a square, where the first-key causal mask is the right one). The two partial softmaxes are
merged through their log-sum-exps in one pass that also adds gpt-oss's sinks to the denominator
and writes the output's rows (kernels/attention_merge.py). The keys are copied out of the pages
whole (one gather of rows a sequence) and handed to cuDNN with their heads strided, not transposed.

No window: sliding-window layers (gpt-oss, 128 keys) stay on the paged kernel, where they are short.
`sdpa_with_lse` is the cuDNN call, `sdpa_with_lse_ref` its torch reference (same signature);
`cudnn_prefill_attention` has paged_prefill_attention's signature plus the host-side lengths and
the call to use. `cudnn_prefill_pays` says where the engine takes it over the paged Triton kernel:
GLM-4.5V's 2048-query chunks after 8K cached keys or more, where it was 2.0-2.2x faster on an H100
and paid back the graph torch builds for each new shape, and its 8192-query chunks from the first
(see the constants below).
"""
from __future__ import annotations

import functools

import torch

from .attention_decode import gather_paged, masked_scores_ref
from .attention_merge import merge_attention_parts


def sdpa_with_lse(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool,
                  scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    """q [1, Hq, Tq, D], k/v [1, Hkv, Tk, D] (Hkv divides Hq); causal: query i sees keys <= i.
    Returns (out [1, Hq, Tq, D] in q.dtype, lse [Hq, Tq] float32, natural log)."""
    out, lse = torch.ops.aten._scaled_dot_product_cudnn_attention(
        q, k, v, None, True, 0.0, causal, False, scale=scale)[:2]
    return out, lse.reshape(q.shape[1], q.shape[2]).float()


def sdpa_with_lse_ref(q, k, v, causal, scale) -> tuple[torch.Tensor, torch.Tensor]:
    tq, tk = q.shape[2], k.shape[2]
    # a query at position p sees keys j <= p: the first-key causal mask puts query i at i, no mask at the last key
    positions = torch.arange(tq, device=q.device) if causal else torch.full((tq,), tk - 1, device=q.device)
    scores = masked_scores_ref(q[0].transpose(0, 1), k[0].transpose(0, 1), positions, scale, None)
    vf = v[0].float().repeat_interleave(q.shape[1] // k.shape[1], dim=0)
    out = torch.einsum("hts,hsd->htd", torch.softmax(scores, dim=-1), vf)
    return out[None].to(q.dtype), torch.logsumexp(scores, dim=-1)


def gather_keys(cache: torch.Tensor, table: torch.Tensor, length: int) -> torch.Tensor:
    """cache [num_blocks, block_size, Hkv, D] (any strides), one sequence's block table [max_blocks]
    -> its keys 0..length-1 as [1, Hkv, length, D]: gather_paged's rows seen heads-first without a
    second copy (the attention call takes the strides)."""
    return gather_paged(cache, table, length).transpose(0, 1)[None]


def attend_in_two_parts(q: torch.Tensor, own_k: torch.Tensor, own_v: torch.Tensor, cached_k: torch.Tensor | None,
                        cached_v: torch.Tensor | None, scale: float, attend=sdpa_with_lse):
    """One sequence: q [Tq, Hq, D] with its own keys own_k/own_v [1, Hkv, Tq, D] (the last Tq
    positions) after the cached prefix cached_k/cached_v [1, Hkv, P, D] (None: no prefix).
    Returns the parts merge_attention_parts takes: ((out [Tq, Hq, D], lse [Hq, Tq]) over its own
    keys, causal; the same over the prefix, unmasked, or None)."""
    q4 = q.transpose(0, 1)[None]
    own, own_lse = attend(q4, own_k, own_v, True, scale)
    if cached_k is None:
        return (own[0].transpose(0, 1), own_lse), None
    cached, cached_lse = attend(q4, cached_k, cached_v, False, scale)
    return (own[0].transpose(0, 1), own_lse), (cached[0].transpose(0, 1), cached_lse)


def cudnn_prefill_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                            block_tables: torch.Tensor, context_lens: torch.Tensor, cu_seqlens_q: torch.Tensor,
                            max_q_len: int, scale: float, sinks: torch.Tensor | None = None,
                            window: int | None = None, *, context_lens_host: list[int],
                            query_start_host: list[int], new_keys: torch.Tensor | None = None,
                            new_values: torch.Tensor | None = None, attend=sdpa_with_lse,
                            merge=merge_attention_parts) -> torch.Tensor:
    """As paged_prefill_attention (q [Tq, Hq, D] packed by cu_seqlens_q [B+1] int32, caches
    [num_blocks, block_size, Hkv, D], block_tables [B, max_blocks], context_lens [B] int32), with
    the query starts and context lengths also on the host; no window. Each sequence's keys are
    copied out of the pages, then attended by `attend` (sdpa_with_lse or its reference) in the
    two parts above and merged by `merge` (merge_attention_parts or its reference) into the
    output's rows. new_keys, new_values [Tq, Hkv, D] (packed as q, D contiguous): the keys and
    values the chunk just wrote to the cache, attended where they are: only the cached prefix is
    gathered (a fresh prompt, nothing). Returns [Tq, Hq, D] in q.dtype."""
    if window is not None:
        raise ValueError("cudnn_prefill_attention has no sliding window; such layers take the paged kernel")
    out = torch.empty_like(q)
    for b, length in enumerate(context_lens_host):
        start, end = query_start_host[b], query_start_host[b + 1]
        if end == start:
            continue
        prefix = length - (end - start)
        if new_keys is not None:  # only the prefix comes out of the pages
            own_k, own_v = (x[start:end].transpose(0, 1)[None] for x in (new_keys, new_values))
            cached_k, cached_v = (gather_keys(c, block_tables[b], prefix) if prefix else None for c in (k_cache, v_cache))
        else:
            k, v = (gather_keys(c, block_tables[b], length) for c in (k_cache, v_cache))
            own_k, own_v = k[:, :, prefix:], v[:, :, prefix:]
            cached_k, cached_v = (k[:, :, :prefix], v[:, :, :prefix]) if prefix else (None, None)
        own, cached = attend_in_two_parts(q[start:end], own_k, own_v, cached_k, cached_v, scale, attend)
        merge(out[start:end], *own, *(cached or (None, None)), sinks)
    return out


# Where the two-part cuDNN form pays on Hopper (sm_90, where it was measured; BENCHMARKS.md
# "Prefill attention", 2026-12-06): torch builds one cuDNN graph for every new shape, sequence
# lengths included, 50-230 ms on an H100 (bench/cudnn_shape_probe.py), and a chunk's prefix length
# is new for most chunks. Taken only where one build is paid back within the chunk itself:
# GLM-4.5V's heads of 128 (46 layers) save 1.7 ms a layer after 8K cached keys, 3.2 after 16K and
# 6.0 after 30K for a 2048-query chunk, against ~60 ms for the build. gpt-oss's heads of 64 (18
# full-attention layers) save at most 1.4 ms a layer, 25 ms a chunk: never paid back, not taken.
CUDNN_MIN_PREFIX = {128: 8192}
CUDNN_MIN_QUERIES = 2048
# A chunk of this many queries pays its build back with no prefix at all (GLM-4.5V at 8192 queries:
# 2.9-3.1 against 5.8 ms a layer, ~130 ms over 46 layers, against a ~60 ms build; BENCHMARKS.md
# "Prefill attention", 2026-12-06 latest): a long prompt's first chunk at the engine's default step
# on a GPU, a shape that recurs for every prompt longer than one step and that the warmup builds.
CUDNN_LONG_CHUNK = 8192
# Sequences a prefill batch may hold for it: each costs its own gathers and calls.
CUDNN_MAX_SEQS = 4
# A sequence's gathered keys and values must fit this (a transient inside the planner's
# activation reserve): GLM-4.5V's 64K keys.
CUDNN_MAX_GATHER_BYTES = 256 << 20
# torch keeps every graph it built; past this many shapes a process keeps to the ones it has.
CUDNN_MAX_SHAPES = 64
_shapes_built: set[tuple] = set()


def cudnn_prefill_pays(capability: tuple[int, int], head_dim: int, kv_heads: int, element_size: int,
                       context_lens: list[int], query_lens: list[int]) -> bool:
    """Whether a prefill batch (per sequence: keys in all, new queries among them) goes faster
    through cudnn_prefill_attention than through the paged kernel, by the measurements above,
    counting a graph build for each shape."""
    min_prefix = CUDNN_MIN_PREFIX.get(head_dim)
    if capability[0] != 9 or min_prefix is None or not 0 < len(context_lens) <= CUDNN_MAX_SEQS:
        return False
    return all(queries >= CUDNN_MIN_QUERIES and (keys - queries >= min_prefix or queries >= CUDNN_LONG_CHUNK)
               and 2 * keys * kv_heads * head_dim * element_size <= CUDNN_MAX_GATHER_BYTES
               for keys, queries in zip(context_lens, query_lens))


def cudnn_shapes_fit(layout: tuple, context_lens: list[int], query_lens: list[int]) -> bool:
    """Whether the graphs the batch's calls need (layout: what else a graph depends on, such as
    device, heads and dtype) are built or may still be; records them as built."""
    shapes = {(*layout, queries, keys - queries) for keys, queries in zip(context_lens, query_lens)}
    shapes |= {(*layout, queries, queries) for queries in query_lens}
    new = shapes - _shapes_built
    if len(_shapes_built) + len(new) > CUDNN_MAX_SHAPES:
        return False
    _shapes_built.update(new)
    return True


@functools.lru_cache(maxsize=None)
def cudnn_works(device_index: int, head_dim: int, dtype: torch.dtype) -> bool:
    """Whether this torch runs cuDNN's attention on this GPU for this head size and dtype, with
    fewer KV heads than query heads, and computes the output and its log-sum-exp right (against
    sdpa_with_lse_ref), masked and not; tried once per device, head size and dtype."""
    dev = torch.device("cuda", device_index)
    gen = torch.Generator(device=dev).manual_seed(0)
    # queries as the engine passes them: [T, Hq, D] rows seen heads-first
    q = torch.randn(40, 4, head_dim, device=dev, generator=gen).to(dtype).transpose(0, 1)[None]
    # keys and values as the engine passes them: rows of [T, Hkv, D] seen heads-first, each row
    # possibly a slice of a wider one (the fused q/k/v projection's values); the unmasked part
    # from the first key, the causal one a view starting further in
    rows = torch.randn(72, 5, head_dim, device=dev, generator=gen).to(dtype)
    k, v = rows[:, 1:3].transpose(0, 1)[None], rows[:, 3:5].transpose(0, 1)[None]
    for keys, causal in ((slice(0, 72), False), (slice(32, 72), True)):
        part = (q, k[:, :, keys], v[:, :, keys], causal, head_dim ** -0.5)
        try:
            got = sdpa_with_lse(*part)
        except (RuntimeError, NotImplementedError, TypeError):
            return False
        if not matches_reference(*got, *sdpa_with_lse_ref(*part)):
            return False
    return True


def matches_reference(out: torch.Tensor, lse: torch.Tensor, ref: torch.Tensor, ref_lse: torch.Tensor) -> bool:
    """An attention call's output and log-sum-exp against its reference's, within bf16's reach
    (a probe's check: a wrong layout or mask is off by far more)."""
    if lse.shape != ref_lse.shape or (lse - ref_lse).abs().max() > 1e-2:
        return False
    return bool(((out.float() - ref.float()).norm() / ref.float().norm()) <= 2e-2)
