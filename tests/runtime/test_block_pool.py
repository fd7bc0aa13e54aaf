import dataclasses

import pytest
import torch

from localchat.engine.runtime.block_pool import BlockPool, OutOfBlocks
from localchat.engine.runtime.kv_budget import (KVMemoryError, KVPlan, activation_headroom, plan_kv_blocks,
                                                sliding_blocks_in_use)
from localchat.engine.runtime.kv_cache import PagedKVCache
from localchat.engine.runtime.prefix_cache import BlockKeys, ImageSpan, image_spans, match_prefix
from localchat.engine.runtime.prompt import Prompt


def test_free_blocks_stay_cached_until_evicted_least_recent_first():
    pool = BlockPool(6)
    a = pool.allocate(3)
    for i, b in enumerate(a):
        pool.register(b, bytes([i]))
    pool.free(a)  # released last-first: a[2] is the least recently used now
    assert pool.num_free == 6 and pool.num_cached == 3
    fresh = pool.allocate(4)  # three plain blocks, then one eviction
    assert pool.evictions == 1 and pool.lookup(bytes([2])) is None
    assert pool.lookup(bytes([0])) == a[0] and pool.lookup(bytes([1])) == a[1]
    assert a[2] in fresh
    pool.check()
    with pytest.raises(OutOfBlocks):
        pool.allocate(3)


def test_shared_blocks_are_ref_counted():
    pool = BlockPool(4)
    (b,) = pool.allocate(1)
    pool.register(b, b"k")
    pool.take_cached(b)  # a second sequence reuses it while the first still holds it
    pool.free([b])
    assert pool.num_free == 3  # still held once
    pool.free([b])
    assert pool.num_free == 4 and pool.num_cached == 1
    pool.take_cached(pool.lookup(b"k"))  # revived from the cached list
    assert pool.num_free == 3 and pool.num_cached == 0
    pool.check()
    pool.free([b])
    with pytest.raises(RuntimeError):
        pool.free([b])


def test_duplicate_content_keeps_the_first_copy():
    pool = BlockPool(4)
    x, y = pool.allocate(2)
    assert pool.register(x, b"same") and not pool.register(y, b"same")
    pool.free([x, y])
    assert pool.num_cached == 1 and pool.lookup(b"same") == x


def test_block_keys_chain_over_the_prefix_and_images():
    toks = list(range(12))
    keys = BlockKeys(4, []).extend(toks, 3)
    assert len(set(keys)) == 3
    changed = BlockKeys(4, []).extend([99] + toks[1:], 3)
    assert all(k != c for k, c in zip(keys, changed))  # an early change changes every later key
    img = lambda sha: [ImageSpan(0, 5, 7, sha)]  # noqa: E731
    a, b = BlockKeys(4, img("aa")).extend(toks, 3), BlockKeys(4, img("bb")).extend(toks, 3)
    assert a[0] == b[0] and a[1] != b[1] and a[2] != b[2]  # same ids, different picture


def test_match_prefix_stops_at_the_first_miss():
    pool = BlockPool(8)
    blocks = pool.allocate(3)
    keys = BlockKeys(2, []).extend([1, 2, 3, 4, 5, 6], 3)
    for b, k in zip(blocks, keys):
        pool.register(b, k)
    pool.free(blocks)
    other = BlockKeys(2, []).extend([1, 2, 3, 4, 9, 9], 3)
    assert match_prefix(pool, other) == blocks[:2]
    pool.check()


def test_image_spans_follow_the_grid():
    img, other = 7, 1
    grid = torch.tensor([[1, 4, 4], [1, 2, 4]])  # 4 and 2 LLM tokens with merge 2
    ids = [other, img, img, img, img, other, img, img, other]
    pixels = (torch.zeros(3, 56, 56, dtype=torch.uint8), torch.zeros(3, 28, 56, dtype=torch.uint8))
    spans = image_spans(Prompt(ids, pixels, grid, ("x", "y")), img, 2)
    assert [(s.index, s.start, s.end, s.sha256) for s in spans] == [(0, 1, 5, "x"), (1, 6, 8, "y")]


def test_pool_size_from_free_gpu_memory(oss):
    spec, gib = dataclasses.replace(oss.spec, sliding_window=None), 1 << 30  # one layer group
    per_block = PagedKVCache.bytes_per_block(spec.num_layers, 16, spec.num_kv_heads, spec.head_dim, torch.bfloat16)
    kw = dict(max_context=512, max_batch_tokens=2048, max_running=1000)
    cuda = torch.device("cuda")
    headroom = activation_headroom(spec, 2048, 1000, 16 * gib)
    assert headroom >= 1.5 * gib
    free = headroom + 1000 * per_block + per_block // 2
    assert plan_kv_blocks(spec, torch.bfloat16, cuda, 16, mem_info=(free, 16 * gib), **kw).num_blocks == 1000
    assert plan_kv_blocks(spec, torch.bfloat16, cuda, 16, mem_info=(80 * gib, 80 * gib), **kw).num_blocks == 512 * 1000 // 16
    assert plan_kv_blocks(spec, torch.bfloat16, cuda, 16, num_blocks=7, **kw).num_blocks == 7
    assert plan_kv_blocks(spec, torch.bfloat16, torch.device("cpu"), 16, max_kv_tokens=100, **kw).num_blocks == 7
    assert plan_kv_blocks(spec, torch.bfloat16, torch.device("cpu"), 16, **kw).num_blocks == 1024 // 16
    with pytest.raises(KVMemoryError, match="GiB of GPU memory is free"):
        plan_kv_blocks(spec, torch.bfloat16, cuda, 16, mem_info=(gib, 80 * gib), **kw)


def test_sliding_layers_get_a_pool_sized_by_their_window(oss):
    spec, gib, bs = oss.spec, 1 << 30, 16  # 2 layers: one sliding (window 8), one full
    half = PagedKVCache.bytes_per_block(1, bs, spec.num_kv_heads, spec.head_dim, torch.bfloat16)
    kw = dict(max_context=512, max_batch_tokens=2048, max_running=1000)
    cuda = torch.device("cuda")
    # Per running chat: the window's blocks plus the chunk's ends, and once more for the prefix cache.
    in_use = sliding_blocks_in_use(8, bs, 1000, 2048)
    assert in_use == 1000 * (1 + 2) + 2048 // bs
    want = in_use + 1000 * (1 + 1)
    headroom = activation_headroom(spec, 2048, 1000, 16 * gib)
    free = headroom + 10_000 * half + want * half + half // 2
    # A full block now holds only the full layer, so the budget buys twice the context it used to.
    assert plan_kv_blocks(spec, torch.bfloat16, cuda, bs, mem_info=(free, 16 * gib), **kw) == KVPlan(10_000, want)
    # A small budget is shared: never more sliding blocks than full ones.
    small = headroom + 600 * half
    assert plan_kv_blocks(spec, torch.bfloat16, cuda, bs, mem_info=(small, 16 * gib), **kw) == KVPlan(300, 300)
    # A block count asked for sizes the full group; the sliding one follows the rule, capped by it.
    assert plan_kv_blocks(spec, torch.bfloat16, cuda, bs, num_blocks=7, **kw) == KVPlan(7, 7)
    assert plan_kv_blocks(spec, torch.bfloat16, cuda, bs, num_blocks=10**6, **kw) == KVPlan(10**6, want)
    assert plan_kv_blocks(spec, torch.bfloat16, cuda, bs, num_blocks=200, num_sliding_blocks=150, **kw) == \
        KVPlan(200, 150)
    with pytest.raises(ValueError, match="cannot hold one chat's window and prefill chunk"):  # 2048 + 7 tokens
        plan_kv_blocks(spec, torch.bfloat16, cuda, bs, num_blocks=200, num_sliding_blocks=129, **kw)
    assert plan_kv_blocks(spec, torch.bfloat16, cuda, bs, num_blocks=200, num_sliding_blocks=0, **kw) == KVPlan(200)
    assert plan_kv_blocks(spec, torch.bfloat16, torch.device("cpu"), bs, max_kv_tokens=100, **kw) == KVPlan(7, 7)
