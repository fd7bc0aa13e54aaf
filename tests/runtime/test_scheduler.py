import pytest

from localchat.engine.runtime.block_pool import BlockPool
from localchat.engine.runtime.prompt import Prompt
from localchat.engine.runtime.scheduler import Scheduler
from localchat.engine.runtime.sequence import EngineStream, Sequence, Status
from tiny_models import chat


def _seq(i: int, n_prompt: int) -> Sequence:
    stream = EngineStream(chat(("user", "x"), max_tokens=100))
    return Sequence(i, stream, Prompt(list(range(100 * i, 100 * i + n_prompt))), None, None, limit=1000,
                    eos_ids=(), block_size=4, spans=[], mrope=None)


def _step(sched: Scheduler) -> list[tuple[Sequence, int]]:
    plan = sched.schedule()
    sched.commit(plan)
    for seq, _ in plan:
        if seq.num_pending == 0:
            seq.tokens.append(7)  # as if sampled
    return plan


def test_decodes_go_first_and_prefill_is_chunked_under_the_budget():
    sched = Scheduler(BlockPool(64), 4, max_batch_tokens=10, max_running=8)
    old, new = _seq(0, 6), _seq(1, 30)
    sched.add(old)
    assert [(s.seq_id, n) for s, n in _step(sched)] == [(0, 6)]
    sched.add(new)
    assert [(s.seq_id, n) for s, n in _step(sched)] == [(0, 1), (1, 9)]
    assert [(s.seq_id, n) for s, n in _step(sched)] == [(0, 1), (1, 9)]
    assert [(s.seq_id, n) for s, n in _step(sched)] == [(0, 1), (1, 9)]
    assert [(s.seq_id, n) for s, n in _step(sched)] == [(0, 1), (1, 3)]
    assert [(s.seq_id, n) for s, n in _step(sched)] == [(0, 1), (1, 1)]


def test_a_prompt_alone_takes_the_whole_budget_and_beside_decodes_the_smaller_one():
    sched = Scheduler(BlockPool(64), 4, max_batch_tokens=24, max_running=8, max_batch_tokens_while_decoding=8)
    first, second = _seq(0, 30), _seq(1, 40)
    sched.add(first)
    assert [(s.seq_id, n) for s, n in _step(sched)] == [(0, 24)]  # alone: whole steps
    assert [(s.seq_id, n) for s, n in _step(sched)] == [(0, 6)]
    sched.add(second)  # the first answers now: every step with its token holds 8, its own among them
    assert [(s.seq_id, n) for s, n in _step(sched)] == [(0, 1), (1, 7)]
    assert [(s.seq_id, n) for s, n in _step(sched)] == [(0, 1), (1, 7)]
    sched.remove(first)
    assert [(s.seq_id, n) for s, n in _step(sched)] == [(1, 24)]  # alone again
    assert [(s.seq_id, n) for s, n in _step(sched)] == [(1, 2)]
    assert [(s.seq_id, n) for s, n in _step(sched)] == [(1, 1)]  # its own answer


@pytest.mark.parametrize("bad", [0, 25])
def test_the_budget_beside_decodes_must_fit_the_step(bad):
    with pytest.raises(ValueError, match=f"max_batch_tokens_while_decoding must be 1..max_batch_tokens .24., got {bad}"):
        Scheduler(BlockPool(8), 4, max_batch_tokens=24, max_running=8, max_batch_tokens_while_decoding=bad)


def _two_prefilled(n_prompt: int):
    """A 6-block pool of 4-token blocks with two sequences of n_prompt tokens after their prefill."""
    pool = BlockPool(6)
    sched = Scheduler(pool, 4, max_batch_tokens=16, max_running=8)
    seqs = _seq(0, n_prompt), _seq(1, n_prompt)
    for seq in seqs:
        sched.add(seq)
    _step(sched)
    return pool, sched, *seqs


def test_the_newest_request_is_preempted_and_recomputed():
    pool, sched, old, new = _two_prefilled(8)  # 2 blocks each
    for _ in range(4):  # the 9th..12th tokens: one more block each, the pool is then full
        _step(sched)
    assert pool.num_free == 0 and sched.preemptions == 0
    _step(sched)  # both want a 4th block: the newer one makes room
    assert sched.preemptions == 1 and new.status is Status.WAITING and new.blocks == []
    assert old.status is Status.RUNNING and len(old.blocks) == 4
    assert len(new.tokens) == 13  # its generated tokens stay; only their K/V is dropped
    pool.check()
    sched.remove(old)  # the old one finishes; the new one comes back, reusing its cached prefix
    plan = _step(sched)
    assert plan == [(new, 13 - 8)] and new.status is Status.RUNNING
    assert sched.prefix_hit_tokens == 8


def test_reserving_ahead_takes_the_next_block_or_nothing():
    # Two decoding sequences, each with a step in flight feeding its newest token: reserving
    # ahead gives each the table entry of the token after it (num_computed + 2), taken from free
    # blocks only; when they are not all there, nothing is taken.
    pool, sched, a, b = _two_prefilled(7)  # 7 cached, 8 tokens (one sampled), 2 blocks each
    assert (a.num_computed, len(a.tokens), len(a.blocks)) == (7, 8, 2)
    _step(sched)  # the 8th token cached, the 9th sampled: still 2 blocks each
    assert pool.num_free == 2 and (a.num_computed, len(a.blocks)) == (8, 2)
    # in flight: position 8 (a 3rd block each, taken by the normal schedule)...
    assert sched.schedule() == [(a, 1), (b, 1)] and pool.num_free == 0
    # ... and the token after it, position 9, lies in that same 3rd block: nothing more needed
    assert sched.reserve_ahead([a, b]) and pool.num_free == 0
    sched.commit([(a, 1), (b, 1)])
    for s in (a, b):
        s.tokens.append(7)
    for _ in range(2):  # positions 9 and 10 written; in flight: 11, the last slot of block 3
        assert sched.schedule() == [(a, 1), (b, 1)]
        sched.commit([(a, 1), (b, 1)])
        for s in (a, b):
            s.tokens.append(7)
    assert sched.schedule() == [(a, 1), (b, 1)] and a.num_computed == 11
    # the token after (position 12) needs a 4th block each, and the pool is empty: nothing taken
    assert not sched.reserve_ahead([a, b]) and len(a.blocks) == len(b.blocks) == 3
    sched.remove(b)  # b's 3 blocks come back: a can take its 4th
    assert sched.reserve_ahead([a]) and len(a.blocks) == 4 and pool.num_free == 2
    pool.check()
