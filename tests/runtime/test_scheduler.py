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


def test_the_newest_request_is_preempted_and_recomputed():
    pool = BlockPool(6)
    sched = Scheduler(pool, 4, max_batch_tokens=16, max_running=8)
    old, new = _seq(0, 8), _seq(1, 8)
    sched.add(old)
    sched.add(new)
    _step(sched)  # both prefilled: 2 blocks each
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
