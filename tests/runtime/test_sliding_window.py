"""Sliding-window layers in a KV group of their own (tiny gpt-oss: layer 0 slides over 8 tokens,
layer 1 sees everything; 4-token blocks): blocks the window has passed go back to the sliding
pool while the full group keeps growing, and the answers stay those of transformers."""
import pytest

from localchat.engine.runtime.block_pool import BlockPool
from localchat.engine.runtime.kv_cache import PagedKVCache, SplitKVCache, first_window_block
from localchat.engine.runtime.prefix_cache import match_windowed_prefix
from test_engine_batching import QUESTIONS, _wait_until_idle
from tiny_models import chat, collect, hf_greedy

WINDOW, BS = 8, 4
LONG = "Hello there, how are you today? Tell me a story about dragons and castles, please."


def _record_holdings(engine) -> list[tuple[int, int, int, int]]:
    """Wraps the scheduler so every planned step records, per sequence, (tokens fed, full blocks,
    sliding blocks held, first token it feeds) at the step's peak (after its blocks grew)."""
    sched, seen = engine.scheduler, []
    schedule = sched.schedule

    def recording():
        plan = schedule()
        for seq, n in plan:
            held = [b for b in seq.sliding_blocks if b != sched.placeholder]
            # The held entries are exactly those from sliding_start on; earlier ones are placeholders.
            assert held == seq.sliding_blocks[seq.sliding_start:]
            seen.append((n, len(seq.blocks), len(held), seq.num_computed))
        used = sched.sliding_pool.num_blocks - sched.sliding_pool.num_free
        assert used == sum(len(s.sliding_blocks) - s.sliding_start for s in sched.running)
        return plan

    sched.schedule = recording
    return seen


def test_sliding_blocks_stay_within_the_window_while_the_context_grows(oss):
    engine = oss.engine(block_size=BS, max_batch_tokens=16)
    assert isinstance(engine.cache, SplitKVCache)
    seen = _record_holdings(engine)
    request = chat(("user", LONG), max_tokens=60)
    ids, _, _, final = collect(engine.submit(request))
    assert ids == hf_greedy(oss, engine.formatter.build(request), 60)
    one_group = oss.engine(block_size=BS, max_batch_tokens=16, num_sliding_blocks=0)  # nothing released
    assert type(one_group.cache) is PagedKVCache and one_group.sliding_pool is None
    assert collect(one_group.submit(request))[0] == ids
    one_group.shutdown()
    assert final.prompt_tokens > 4 * WINDOW  # the window slid a long way
    for n, full, held, start in seen:
        # The blocks spanning [start - window + 1, start + n) and no more.
        assert held == -(-(start + n) // BS) - first_window_block(start, WINDOW, BS)
        assert held <= -(-(WINDOW - 1 + n) // BS) + 1
        assert full == -(-(start + n) // BS)
    decode = [held for n, _, held, _ in seen if n == 1]
    assert len(decode) == 59 and max(decode) <= -(-WINDOW // BS) + 1
    assert seen[-1][1] >= (final.prompt_tokens + 59) // BS  # the full group kept every block
    assert _wait_until_idle(engine)
    engine.shutdown()


@pytest.mark.parametrize("chunk", [3, 8, 13, 64])
def test_chunks_smaller_and_larger_than_the_window_match_transformers(oss, chunk):
    engine = oss.engine(block_size=BS, max_batch_tokens=chunk)
    seen = _record_holdings(engine)
    request = chat(("user", LONG), max_tokens=12)
    ids = collect(engine.submit(request))[0]
    assert ids == hf_greedy(oss, engine.formatter.build(request), 12)
    assert max(held for *_, held, _ in seen) <= -(-(WINDOW - 1 + chunk) // BS) + 1
    assert _wait_until_idle(engine)
    engine.shutdown()


def test_prefix_match_needs_the_window_before_its_end():
    keys = [bytes([i]) * 4 for i in range(6)]

    def pools(sliding_keys):
        full, sliding = BlockPool(8), BlockPool(8)
        blocks = full.allocate(6)
        for b, k in zip(blocks, keys):
            full.register(b, k)
        full.free(blocks)
        held = sliding.allocate(len(sliding_keys))
        for b, i in zip(held, sliding_keys):
            sliding.register(b, keys[i])
        sliding.free(held)
        return full, sliding

    # All 6 blocks: the token at 24 sees 17.., i.e. blocks 4 and 5.
    full, sliding = pools([2, 3, 4, 5])
    blocks, table, start = match_windowed_prefix(full, sliding, keys, BS, WINDOW, placeholder=8)
    assert len(blocks) == 6 and start == 4 and table[:4] == [8] * 4 and table[4:] == [sliding.lookup(k) for k in keys[4:]]
    assert full.num_free == 2 and sliding.num_free == 6  # references taken on what is used only
    # Blocks 4 and 5 evicted: 5 blocks would need 3 and 4, 4 blocks need 2 and 3.
    full, sliding = pools([0, 1, 2, 3])
    blocks, table, start = match_windowed_prefix(full, sliding, keys, BS, WINDOW, placeholder=8)
    assert len(blocks) == 4 and start == 2 and len(table) == 4 and table[:2] == [8, 8]
    # Nothing of the window left anywhere: no reuse at all.
    full, sliding = pools([])
    assert match_windowed_prefix(full, sliding, keys, BS, WINDOW, placeholder=8) == ([], [], 0)
    assert full.num_free == 8
    full.check()
    sliding.check()


def test_multi_turn_reuse_with_a_tiny_sliding_pool_matches_a_cold_run(oss):
    first = chat(("user", LONG), max_tokens=12)
    second = chat(("user", LONG), ("assistant", "Once upon a time."), ("user", "And then?"), max_tokens=12)
    cold = oss.engine(block_size=BS)
    expected = collect(cold.submit(second))[0]
    cold.shutdown()
    full_hit = None
    for sliding_blocks in (None, 12):  # the default keeps released windows; 12 evicts most of them
        warm = oss.engine(block_size=BS, max_batch_tokens=8, num_sliding_blocks=sliding_blocks)
        collect(warm.submit(first))
        collect(warm.submit(chat(("user", QUESTIONS[2]), max_tokens=12)))  # churns the cached lists
        before = warm.counters()
        assert collect(warm.submit(second))[0] == expected
        after = warm.counters()
        hit = after["prefix_hit_tokens"] - before["prefix_hit_tokens"]
        assert hit % BS == 0 and after["computed_tokens"] - before["computed_tokens"] == \
            len(warm.formatter.build(second).input_ids) - hit + 11
        if sliding_blocks is None:
            full_hit = hit
            assert hit >= len(warm.formatter.build(first).input_ids) // BS * BS
        else:  # the full group still holds the earlier turn, the sliding group only its start
            assert after["sliding_evictions"] > 0 and 0 < hit < full_hit
        assert _wait_until_idle(warm)
        warm.shutdown()


def test_preemption_when_the_sliding_pool_runs_short(oss):
    requests = [chat(("user", q), max_tokens=24) for q in QUESTIONS[:3]]
    roomy = oss.engine(block_size=BS)
    expected = [collect(roomy.submit(r))[0] for r in requests]
    # The full pool is roomy; 9 sliding blocks hold about two windows plus a chunk.
    tight = oss.engine(block_size=BS, max_batch_tokens=16, num_sliding_blocks=9)
    streams = [tight.submit(r) for r in requests]
    assert [collect(s)[0] for s in streams] == expected
    assert tight.counters()["preemptions"] > 0
    assert _wait_until_idle(tight)
    roomy.shutdown()
    tight.shutdown()


def test_each_group_holds_only_its_layers_and_both_are_reported(oss, glm):
    with pytest.raises(ValueError, match="at least that"):  # one chat's window and chunk need 7
        oss.engine(block_size=BS, max_batch_tokens=16, num_sliding_blocks=6)
    engine = oss.engine(block_size=BS, num_blocks=40, num_sliding_blocks=12, max_batch_tokens=16)
    cache = engine.cache
    assert cache.full.k.shape[:2] == (1, 40) and cache.sliding.k.shape[:2] == (1, 12 + 1)
    assert cache.layer(0)[2] and not cache.layer(1)[2]  # layer 0 slides (gpt-oss's even layers)
    info = engine.info()
    assert info.kv_cache_tokens == 40 * BS and info.kv_window_tokens == 12 * BS
    assert info.kv_cache_bytes == cache.nbytes == 2 * (cache.full.k.nbytes + cache.sliding.k.nbytes)
    c = engine.counters()
    assert (c["num_blocks"], c["sliding_num_blocks"], c["sliding_free_blocks"]) == (40, 12, 12)
    engine.shutdown()
    # A model without windows: one group over every layer, as before.
    plain = glm.engine(block_size=BS)
    assert type(plain.cache) is PagedKVCache and plain.cache.k.shape[0] == glm.spec.num_layers
    assert plain.sliding_pool is None and plain.info().kv_window_tokens is None
    assert plain.counters()["sliding_num_blocks"] == 0
    plain.shutdown()
