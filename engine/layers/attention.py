"""Causal self-attention with GQA, optional attention sinks and sliding window.

CUDA runs the Triton kernels (rotary fused with the cache write, paged attention; at decode the
rotation and the cache write ride in the attention launch itself); elsewhere their torch
references (same signatures) run. The decoding sequences at long contexts of a step that also
reads a long chunk take the decode kernel, or the short-chunk kernel (kernels/attention_short.py),
which packs a KV head's query heads into one tile and splits the keys, where they have a few
queries each; with SHORT_CHUNK_KERNEL on, so do full-attention steps of a few queries a sequence
(a short turn, a prompt's tail beside decoding chats). A prefill chunk
after a long cached prefix, or a whole long chunk, on Hopper goes to cuDNN's fused attention on
keys copied out of the pages (kernels/attention_cudnn.py), where that measured faster.
Keys and values live in a paged cache (engine/runtime/kv_cache.py); a ForwardBatch says which slots.
With a split cache (gpt-oss), a sliding-window layer keeps its K/V in the sliding group and reads
that group's block tables and slots; every other layer, and every layer of a one-group cache,
reads the full group's.
"""
from __future__ import annotations

import logging

import torch

from ...kernels.attention_cudnn import cudnn_prefill_attention, cudnn_prefill_pays, cudnn_shapes_fit, cudnn_works
from ...kernels.attention_decode import paged_decode_attention, paged_decode_attention_ref, rotary_decode_attention
from ...kernels.attention_prefill import paged_prefill_attention, paged_prefill_attention_ref
from ...kernels.attention_short import (MIXED_SPLIT_MIN_KEYS, SHORT_SPLIT_KEYS, short_prefill_attention,
                                        short_prefill_queries, short_prefill_splits)
from ...kernels.gpu_facts import cuda_index, gpu_arch
from ...kernels.rotary import apply_rotary, apply_rotary_ref
from ..parallel.context import SINGLE, ParallelContext
from ..spec import ModelSpec
from .linear import concat_rows, linear, linear_takes_e4m3

log = logging.getLogger(__name__)
# Whether steps of a few queries a sequence take the short-chunk kernel (kernels/attention_short.py)
# rather than the paged one, in captured chunk graphs and eagerly, in full-attention layers (a
# window's 128 keys are the paged kernel's: 7-8 against 8-14 us). On an H100 a 16-token turn after
# 30K tokens reached its first token 1.7-1.8x sooner alone and 2.0-4.7x beside 8 answering chats;
# after 512 tokens, where a chunk graph (which cannot see the context) takes it too, turns read
# within 6% of the paged kernel (BENCHMARKS.md, "Short chunks after long contexts").
SHORT_CHUNK_KERNEL = True
# Whether a captured graph whose bucket is past the short-chunk kernel's bound shares its step on
# the device: sequences of a few queries (decoding chats) on the short-chunk kernel, the others on
# the paged one (each skipping the other's). Without it such a step gives the decoding chats' rows
# to the paged kernel, which walks every key once per query head. On an H200, GLM-4.5V-FP8 (12
# layers) beside 8 chats decoding after 30K tokens: a 32-token turn's first token 84-85 -> 19-20 ms,
# 64 and 100 tokens 86-87 -> 26-27 ms (the paged kernel alone for reference); nothing slower,
# after 512 tokens either, for the two launches it adds to each full-attention layer of such steps
# (BENCHMARKS.md, "Short chunks after long contexts").
SHARED_CAPTURED_STEPS = True
# Devices where a cuDNN prefill call raised (a shape its build refuses, a workspace that did not
# fit): every later prefill there takes the paged kernel.
_cudnn_failed: set[torch.device] = set()


def _takes_cudnn(q: torch.Tensor, k_cache: torch.Tensor, batch, query_lens: list[int]) -> bool:
    """Whether this CUDA prefill batch of a full-attention layer goes through cuDNN on gathered
    keys: long cached prefixes on a GPU where that was measured faster, a torch that runs it, and
    room for the graphs of its shapes."""
    if k_cache.dtype != q.dtype or not cudnn_prefill_pays(
            gpu_arch(q.device).capability, q.shape[-1], k_cache.shape[2], k_cache.element_size(),
            batch.context_lens_host, query_lens):
        return False
    device = cuda_index(q.device)
    return cudnn_works(device, q.shape[-1], q.dtype) and cudnn_shapes_fit(
        (device, q.shape[1], k_cache.shape[2], q.shape[-1], q.dtype), batch.context_lens_host, query_lens)


def _through_cudnn(q, k_cache, v_cache, tables, batch, query_lens: list[int], scale, sinks, new_keys, new_values
                   ) -> torch.Tensor | None:
    """A prefill batch's attention through cuDNN where _takes_cudnn says it pays; None where it does
    not, or where the call raised (logged once; the paged kernel then takes this batch and every
    later one on the device: the attention writes nothing but its output, so the batch is simply
    attended again)."""
    if q.device in _cudnn_failed or not _takes_cudnn(q, k_cache, batch, query_lens):
        return None
    try:
        return cudnn_prefill_attention(q, k_cache, v_cache, tables, batch.context_lens, batch.query_start,
                                       max(query_lens), scale, sinks, context_lens_host=batch.context_lens_host,
                                       query_start_host=batch.query_start_host, new_keys=new_keys,
                                       new_values=new_values)
    except RuntimeError as e:  # torch's cuDNN errors and out-of-memory both
        _cudnn_failed.add(q.device)
        log.warning("cuDNN's prefill attention failed on %s (%s: %s); prefill attention takes the paged kernel "
                    "from now on", q.device, type(e).__name__, e)
        return None


def paged_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, batch,
                    scale: float, sinks: torch.Tensor | None = None, window: int | None = None,
                    tables: torch.Tensor | None = None, new_keys: torch.Tensor | None = None,
                    new_values: torch.Tensor | None = None) -> torch.Tensor:
    """q [T, Hq, D] packed over the batch's sequences; k_cache, v_cache [blocks, block_size,
    Hkv, D]; tables [B, max_blocks] (default: batch.block_tables). Each sequence's new tokens are
    the last ones of its context. Returns [T, Hq, D]. A query at position p sees keys j <= p
    (and p - window < j with a window); a sink adds exp(sinks[h]) to head h's softmax
    denominator without a value. new_keys, new_values [T, Hkv, D]: the batch's keys and values
    as just written to the cache, which a prefill may read from there instead."""
    on_gpu = _runs_kernels(q)
    takes_short = on_gpu and SHORT_CHUNK_KERNEL and window is None
    tables = batch.block_tables if tables is None else tables
    lens = batch.context_lens
    if batch.is_decode:
        decode = paged_decode_attention if on_gpu else paged_decode_attention_ref
        return decode(q, k_cache, v_cache, tables, lens, scale, sinks, window)
    few_queries = short_prefill_queries(q.shape[1], k_cache.shape[2])
    if batch.captured_query_len is not None:  # a captured graph: sized by its bounds, no host-planned path
        longest = batch.captured_query_len
        past_bound = longest > few_queries
        prefill = paged_prefill_attention if on_gpu else paged_prefill_attention_ref
        if not takes_short or (past_bound and not SHARED_CAPTURED_STEPS):
            return prefill(q, k_cache, v_cache, tables, lens, batch.query_start, longest, scale, sinks, window)
        splits = short_prefill_splits(tables.shape[1] * k_cache.shape[1])
        out = short_prefill_attention(q, k_cache, v_cache, tables, lens, batch.query_start, min(longest, few_queries),
                                      scale, sinks, window, num_splits=splits, split_keys=SHORT_SPLIT_KEYS,
                                      longest_taken=few_queries if past_bound else None)
        if past_bound:
            return prefill(q, k_cache, v_cache, tables, lens, batch.query_start, longest, scale, sinks, window,
                           out=out, skip_up_to=few_queries)
        return out
    starts = batch.query_start_host
    query_lens = [b - a for a, b in zip(starts, starts[1:])]
    # a step packs its decoding sequences first: the leading ones of a few queries each
    few = next((i for i, n in enumerate(query_lens) if n > few_queries), len(query_lens)) if on_gpu else 0
    most_keys = max(batch.context_lens_host[:few], default=0)
    splits = short_prefill_splits(most_keys) if few else None
    # eagerly the context is known: after at most SHORT_SPLIT_KEYS keys (one part) the paged kernel
    # is as fast or faster
    if splits is not None and splits > 1 and few == len(query_lens) and takes_short:
        return short_prefill_attention(q, k_cache, v_cache, tables, lens, batch.query_start, max(query_lens), scale,
                                       sinks, window, num_splits=splits, split_keys=SHORT_SPLIT_KEYS)
    if splits is not None and few < len(query_lens) and window is None and most_keys >= MIXED_SPLIT_MIN_KEYS:
        return _cut_after(few, splits, q, k_cache, v_cache, tables, batch, query_lens, scale, sinks, new_keys,
                          new_values)
    return _long_prefill(q, k_cache, v_cache, tables, batch, query_lens, scale, sinks, window, new_keys, new_values)


def _cut_after(few: int, splits: int, q, k_cache, v_cache, tables, batch, query_lens: list[int], scale, sinks,
               new_keys, new_values) -> torch.Tensor:
    """A full-attention step whose first `few` sequences (decoding chats at long contexts) have a
    few queries each and whose others have long chunks: walking the first ones' keys with the
    chunks' tiles would leave most rows empty, so they take the decode kernel (one query each) or
    the short-chunk kernel (`splits` parts at most) and the others their own call, each writing its
    rows of one output."""
    rows, out = batch.query_start_host[few], torch.empty_like(q)
    # one query each: the decode kernel (after 30K keys 51 / 31 us against the short-chunk kernel's
    # 92 / 85, GLM-4.5V / gpt-oss heads)
    if rows == few:
        out[:rows] = paged_decode_attention(q[:rows], k_cache, v_cache, tables[:few], batch.context_lens[:few],
                                            scale, sinks)
    else:
        short_prefill_attention(q[:rows], k_cache, v_cache, tables[:few], batch.context_lens[:few],
                                batch.query_start[:few + 1], max(query_lens[:few]), scale, sinks, None,
                                num_splits=splits, split_keys=SHORT_SPLIT_KEYS, out=out[:rows])
    rest_keys, rest_values = (None if x is None else x[rows:] for x in (new_keys, new_values))
    _long_prefill(q[rows:], k_cache, v_cache, tables[few:], batch.sequences_from(few), query_lens[few:], scale,
                  sinks, None, rest_keys, rest_values, out[rows:])
    return out


def _runs_kernels(q: torch.Tensor) -> bool:
    """Whether the Triton kernels serve q's attention (on a GPU) rather than their references."""
    return q.is_cuda


def _long_prefill(q, k_cache, v_cache, tables, batch, query_lens: list[int], scale, sinks, window, new_keys,
                  new_values, out: torch.Tensor | None = None) -> torch.Tensor:
    """Prefill attention of an eager batch with long chunks: cuDNN where _takes_cudnn says it
    pays, else the paged kernel (the torch reference off the GPU); into `out` when given."""
    on_gpu = _runs_kernels(q)
    if on_gpu and window is None:
        got = _through_cudnn(q, k_cache, v_cache, tables, batch, query_lens, scale, sinks, new_keys, new_values)
        if got is not None:
            return got if out is None else out.copy_(got)
    prefill = paged_prefill_attention if on_gpu else paged_prefill_attention_ref
    return prefill(q, k_cache, v_cache, tables, batch.context_lens, batch.query_start, max(query_lens), scale, sinks,
                   window, out=out)


class SelfAttention:
    """One decoder layer's attention; weights from the flat store under `prefix`.

    Under tensor parallelism the rank holds a range of query heads and their kv heads (sinks
    follow their heads); its output is this rank's partial sum of o_proj, which the model
    all-reduces (o_proj's bias is held by rank 0 only)."""

    def __init__(self, spec: ModelSpec, weights: dict, prefix: str, layer: int, ctx: ParallelContext = SINGLE):
        self.layer = layer
        layout = ctx.layout(spec)
        self.heads, self.kv_heads, self.head_dim = layout.num_q_heads, layout.num_kv_heads, spec.head_dim
        self.scale = spec.head_dim ** -0.5
        self.window = spec.sliding_window if spec.layer_types[layer] == "sliding" else None
        q, k, v, self.o = (weights[f"{prefix}.{n}_proj.weight"] for n in "qkvo")
        q_b, k_b, v_b, self.o_b = (weights.get(f"{prefix}.{n}_proj.bias") for n in "qkvo")
        self.sinks = weights.get(f"{prefix}.sinks") if spec.attention_sinks else None
        for w, heads, what in ((q, self.heads, "q_proj"), (k, self.kv_heads, "k_proj")):
            if w.shape[0] != heads * self.head_dim:
                raise ValueError(f"{prefix}.{what} has {w.shape[0]} rows, but rank {ctx.rank} of {ctx.world_size} "
                                 f"should hold {heads} heads of {self.head_dim}: the weights were cut for another split")
        # q, k and v read the same input: one fused weight is one kernel launch instead of three.
        # Only the fused copy is kept, so the separate ones are freed with the loaded store.
        fused = concat_rows([q, k, v], [q_b, k_b, v_b])
        self.qkv_parts = [fused] if fused is not None else [(q, q_b), (k, k_b), (v, v_b)]
        self.qkv_widths = [w.shape[0] for w in (q, k, v)]

    def takes_e4m3_input(self, num_tokens: int, dtype: torch.dtype, device: torch.device) -> bool:
        """Whether q/k/v quantise these tokens' rows to e4m3, so the norm in front can write them
        (its e4m3 output, passed as x_e4m3)."""
        return linear_takes_e4m3(num_tokens, dtype, device, self.qkv_parts[0][0])

    def __call__(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, batch, cache,
                 x_e4m3: tuple[torch.Tensor, torch.Tensor] | None = None) -> torch.Tensor:
        """x [T, hidden] packed over the batch; cos/sin [T, rotary_dim] carry the rotary angles;
        x_e4m3: x's rows as e4m3 (takes_e4m3_input)."""
        t = x.shape[0]
        outs = [linear(x, w, b, x_e4m3) for w, b in self.qkv_parts]
        q, k, v = outs[0].split(self.qkv_widths, dim=-1) if len(outs) == 1 else outs
        q = q.view(t, self.heads, self.head_dim)
        k = k.view(t, self.kv_heads, self.head_dim)
        v = v.view(t, self.kv_heads, self.head_dim)
        k_cache, v_cache, sliding = cache.layer(self.layer)
        tables, slots = batch.block_tables, batch.slot_mapping
        if sliding:
            tables, slots = batch.sliding_block_tables, batch.sliding_slot_mapping
        if x.is_cuda and batch.is_decode:
            # the rotation and the cache write of the new token happen inside the attention launch
            out = rotary_decode_attention(q, k, v, cos, sin, k_cache, v_cache, slots, tables, batch.context_lens,
                                          self.scale, self.sinks, self.window)
        else:
            # one pass rotates q and k and stores the new keys and values in the paged cache
            rotary = apply_rotary if x.is_cuda else apply_rotary_ref
            q, k = rotary(q, k, cos, sin, v, k_cache, v_cache, slots)
            out = paged_attention(q, k_cache, v_cache, batch, self.scale, self.sinks, self.window, tables, k, v)
        return linear(out.reshape(t, -1), self.o, self.o_b)
