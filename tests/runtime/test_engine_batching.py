"""Continuous batching, chunked prefill, preemption, cancel and refusals on a tiny gpt-oss
(sliding window 8 on alternate layers, so windows cross 4-token blocks and chunk edges)."""
import threading
import time

import pytest
from tiny_models import chat, collect, hf_greedy

QUESTIONS = ["Hello there, how are you today?", "Tell me a story about dragons and castles.",
             "What is 2+2?", "Hello there, how are you today?", "Name three colours of the sky at dusk."]


def _idle(engine) -> bool:
    """Every block of both layer groups is back in its pool."""
    c = engine.counters()
    return c["free_blocks"] == c["num_blocks"] and c["sliding_free_blocks"] == c["sliding_num_blocks"]


def _wait_until_idle(engine, timeout=10.0):
    deadline = time.time() + timeout
    while not _idle(engine) and time.time() < deadline:
        time.sleep(0.01)
    engine.pool.check()
    if engine.sliding_pool is not None:
        engine.sliding_pool.check()
    return _idle(engine)


def test_chunked_prefill_matches_transformers(oss):
    engine = oss.engine(block_size=4, max_batch_tokens=7)
    request = chat(("user", "Hello there, how are you today? Tell me a story about dragons."), max_tokens=20)
    ids, _, _, final = collect(engine.submit(request))
    assert ids == hf_greedy(oss, engine.formatter.build(request), 20)
    assert final.finish_reason == "length" and final.completion_tokens == 20
    assert final.prompt_tokens == len(final.prompt_token_ids) > 7  # it really took several chunks
    t = final.timings
    assert t.prefill > 0 and t.first_token > 0 and t.decode > 0 and t.decode_tokens_per_s > 0
    assert t.image_encode == 0
    engine.shutdown()


def test_batched_requests_give_the_tokens_of_one_at_a_time(oss):
    requests = [chat(("user", q), max_tokens=12) for q in QUESTIONS]
    alone_engine = oss.engine(block_size=4, max_batch_tokens=16)
    alone = [collect(alone_engine.submit(r))[0] for r in requests]
    batched_engine = oss.engine(block_size=4, max_batch_tokens=16)
    streams = [batched_engine.submit(r) for r in requests]  # all in flight together
    assert [collect(s)[0] for s in streams] == alone
    # A second batch on the warm engine reuses cached prefixes and still agrees.
    streams = [alone_engine.submit(r) for r in requests]
    assert [collect(s)[0] for s in streams] == alone
    assert alone_engine.counters()["prefix_hit_tokens"] > 0
    assert _wait_until_idle(batched_engine) and _wait_until_idle(alone_engine)
    batched_engine.shutdown()
    alone_engine.shutdown()


def test_prompts_read_in_shorter_steps_beside_answers_give_the_same_tokens(oss):
    requests = [chat(("user", q), max_tokens=12) for q in QUESTIONS]
    alone_engine = oss.engine(block_size=4, max_batch_tokens=32)
    alone = [collect(alone_engine.submit(r))[0] for r in requests]
    engine = oss.engine(block_size=4, max_batch_tokens=32, max_batch_tokens_while_decoding=6)
    assert engine.scheduler.max_batch_tokens_while_decoding == 6
    first = iter(engine.submit(requests[0]))
    head = next(first)  # answering now: the prompts after it are read 6 tokens a step, its own among them
    streams = [engine.submit(r) for r in requests[1:]]
    assert [list(head.token_ids) + collect(first)[0]] + [collect(s)[0] for s in streams] == alone
    assert _wait_until_idle(engine) and _wait_until_idle(alone_engine)
    engine.shutdown()
    alone_engine.shutdown()


def test_requests_from_several_threads(oss):
    requests = [chat(("user", q + " " * i), max_tokens=10) for i, q in enumerate(QUESTIONS * 2)]
    reference = oss.engine(block_size=4)
    expected = [collect(reference.submit(r))[0] for r in requests]
    engine = oss.engine(block_size=4, max_batch_tokens=32)
    results = [None] * len(requests)

    def client(i):
        results[i] = collect(engine.submit(requests[i]))[0]

    threads = [threading.Thread(target=client, args=(i,)) for i in range(len(requests))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert results == expected
    assert engine.counters()["steps"] < sum(len(e) for e in expected)  # they shared steps
    engine.shutdown()
    reference.shutdown()


def test_preemption_under_a_tiny_pool_keeps_outputs_exact(oss):
    requests = [chat(("user", q), max_tokens=24) for q in QUESTIONS[:3]]
    roomy = oss.engine(block_size=4)
    expected = [collect(roomy.submit(r))[0] for r in requests]
    # Each request needs ~20 blocks; 30 hold one or two at a time, never all three.
    tight = oss.engine(block_size=4, num_blocks=30, max_batch_tokens=16)
    streams = [tight.submit(r) for r in requests]
    assert [collect(s)[0] for s in streams] == expected
    assert tight.counters()["preemptions"] > 0
    assert _wait_until_idle(tight)
    tight.shutdown()
    roomy.shutdown()


def test_seeded_sampling_is_the_same_alone_and_batched(oss):
    sampled = chat(("user", QUESTIONS[1]), max_tokens=16, temperature=1.0, top_p=0.9, seed=7)
    engine = oss.engine(block_size=4, max_batch_tokens=16)
    alone = collect(engine.submit(sampled))[0]
    others = [engine.submit(chat(("user", q), max_tokens=16)) for q in QUESTIONS]
    again = engine.submit(sampled)
    assert collect(again)[0] == alone
    for s in others:
        collect(s)
    engine.shutdown()


def test_closing_a_stream_aborts_and_frees_every_block(oss):
    engine = oss.engine(block_size=4, max_running=1)
    running = engine.submit(chat(("user", QUESTIONS[1]), max_tokens=400))
    queued = engine.submit(chat(("user", QUESTIONS[2]), max_tokens=400))  # waits: one running at most
    queued.close()
    items = iter(running)
    for _ in range(3):
        next(items)
    running.close()
    final = collect(items)[3]
    assert final.finish_reason == "abort" and 3 <= final.completion_tokens < 400
    final = collect(queued)[3]
    assert final.finish_reason == "abort" and final.completion_tokens == 0
    assert _wait_until_idle(engine)
    # A stream closed without ever being read is aborted too.
    engine.submit(chat(("user", QUESTIONS[0]), max_tokens=400)).close()
    assert _wait_until_idle(engine)
    # The engine is still healthy afterwards.
    assert collect(engine.submit(chat(("user", QUESTIONS[0]), max_tokens=3)))[3].finish_reason == "length"
    engine.shutdown()


def test_too_long_requests_are_refused_with_the_limit(oss):
    small_pool = oss.engine(block_size=4, num_blocks=8)  # 32 tokens
    final = collect(small_pool.submit(chat(("user", QUESTIONS[1]))))[3]
    assert final.finish_reason == "error" and "KV cache holds 32 tokens" in final.error
    assert final.prompt_tokens > 32
    short_context = oss.engine(block_size=4, max_context=40)
    final = collect(short_context.submit(chat(("user", QUESTIONS[1]))))[3]
    assert final.finish_reason == "error" and "context holds 40" in final.error
    assert short_context.info().context_length == 40
    # A prompt that fits runs until the context is full, then ends with "length".
    request = chat(("user", "Hi"), max_tokens=100)
    n = len(short_context.formatter.build(request).input_ids)
    ids, _, _, final = collect(short_context.submit(request))
    assert final.finish_reason == "length" and final.completion_tokens == len(ids) == 40 - n
    small_pool.shutdown()
    short_context.shutdown()


def test_multi_turn_reuses_the_earlier_turn(oss):
    first = chat(("user", QUESTIONS[1]), max_tokens=12)
    warm = oss.engine(block_size=4)
    ids1, _, _, f1 = collect(warm.submit(first))
    second = chat(("user", QUESTIONS[1]), ("assistant", "Once upon a time."), ("user", "And then?"), max_tokens=12)
    before = warm.counters()
    ids, _, _, f2 = collect(warm.submit(second))
    after = warm.counters()
    assert f1.finish_reason == f2.finish_reason == "length"
    cold = oss.engine(block_size=4)
    assert collect(cold.submit(second))[0] == ids
    # The earlier turn's cached tokens (its prompt and all generated ids but the last, which is
    # sampled and never fed) were found in full blocks, not recomputed.
    earlier = list(f1.prompt_token_ids) + ids1[:-1]
    now = list(f2.prompt_token_ids)
    common = next((i for i, (a, b) in enumerate(zip(earlier, now)) if a != b), min(len(earlier), len(now)))
    expected_hit = min(common, len(now) - 1) // 4 * 4
    assert expected_hit >= len(f1.prompt_token_ids) // 4 * 4
    assert after["prefix_hit_tokens"] - before["prefix_hit_tokens"] == expected_hit
    assert after["computed_tokens"] - before["computed_tokens"] == len(now) - expected_hit + 11
    warm.shutdown()
    cold.shutdown()



def test_a_chat_longer_than_the_context_goes_on_without_its_oldest_turns(oss):
    from dataclasses import replace

    engine = oss.engine(block_size=4, max_context=96)
    turns = [("system", "Be brief.")]
    for i in range(6):
        turns += [("user", QUESTIONS[i % len(QUESTIONS)]), ("assistant", "Once upon a time there was a dragon.")]
    request = replace(chat(*turns, ("user", "And then?"), max_tokens=8), overflow="drop_oldest")
    assert len(engine.formatter.build(request).input_ids) > 96  # the whole chat does not fit
    assert collect(engine.submit(replace(request, overflow="error")))[3].finish_reason == "error"

    ids, _, _, final = collect(engine.submit(request))
    assert final.finish_reason == "length" and final.dropped_messages > 0 and final.dropped_messages % 2 == 0
    # exactly the tokens of the shortened chat sent as it is: system prompt, then from a question on
    shortened = replace(request, messages=request.messages[:1] + request.messages[1 + final.dropped_messages:],
                        overflow="error")
    assert shortened.messages[1].role == "user"
    same_ids, _, _, same = collect(engine.submit(shortened))
    assert (ids, final.prompt_token_ids) == (same_ids, same.prompt_token_ids)
    assert final.prompt_tokens + 8 <= 96 * 3 // 4  # room for the answer and the turns to come

    # the next turn keeps that cut, so its prompt starts with the blocks already cached
    following = replace(request, messages=request.messages + chat(("assistant", "The end."), ("user", "Why?")).messages,
                        dropped_hint=final.dropped_messages)
    before = engine.counters()["prefix_hit_tokens"]
    _, _, _, next_final = collect(engine.submit(following))
    assert next_final.dropped_messages == final.dropped_messages
    assert engine.counters()["prefix_hit_tokens"] - before >= final.prompt_tokens // 4 * 4
    engine.shutdown()


def test_a_gpu_fault_stops_the_engine_and_says_to_restart_but_running_out_of_memory_does_not(oss, monkeypatch):
    import torch

    engine = oss.engine(block_size=4)
    run = engine.runner.run
    failure = {"error": torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")}

    def failing(plan):
        if failure["error"] is not None:
            error, failure["error"] = failure["error"], None
            raise error
        return run(plan)

    monkeypatch.setattr(engine.runner, "run", failing)
    final = collect(engine.submit(chat(("user", QUESTIONS[0]))))[3]
    assert final.finish_reason == "error" and "out of memory" in final.error
    assert engine.health() is None  # one request lost; the engine goes on
    assert collect(engine.submit(chat(("user", QUESTIONS[0]), max_tokens=3)))[3].finish_reason == "length"

    failure["error"] = RuntimeError("CUDA error: an illegal memory access was encountered\nCUDA kernel errors ...")
    final = collect(engine.submit(chat(("user", QUESTIONS[1]))))[3]
    assert final.finish_reason == "error"
    assert "illegal memory access" in engine.health() and "restart localchat" in engine.health()
    # from then on every request is refused at once with the reason, without running a step
    refused = collect(engine.submit(chat(("user", QUESTIONS[2]))))[3]
    assert refused.finish_reason == "error" and refused.error == engine.health() and refused.prompt_tokens == 0
    engine.shutdown()


def test_only_faults_that_stay_with_the_gpu_context_are_unrecoverable():
    from localchat.engine.parallel.group import WorkerFailed
    from localchat.engine.runtime.failures import unrecoverable

    assert unrecoverable(RuntimeError("CUDA error: device-side assert triggered"))
    assert "rank 1" in unrecoverable(WorkerFailed("tensor-parallel rank 1 (GPU 1) exited unexpectedly"))
    for passing in (RuntimeError("CUDA error: invalid argument"), RuntimeError("CUDA error: out of memory"),
                    ValueError("temperature must be at least 0"), RuntimeError("")):
        assert unrecoverable(passing) is None


def test_work_runs_on_the_engine_thread(oss):
    # what warmup and the benchmarks hand the engine's thread (graph captures): run there, between
    # steps, with its failure raised to the caller and the engine serving on
    engine = oss.engine(block_size=4)
    seen = []
    engine.run_on_engine_thread(lambda: seen.append(threading.current_thread().name))
    assert seen == ["localchat-engine"]

    def fails():
        raise ValueError("no room")

    with pytest.raises(ValueError, match="no room"):
        engine.run_on_engine_thread(fails)
    ids, _, _, final = collect(engine.submit(chat(("user", "What is 2+2?"), max_tokens=3)))
    assert final.finish_reason == "length" and len(ids) == 3
    engine.shutdown()
