"""Decode steps launched one ahead of the host (each step's input ids read from the previous
step's choice on the device) stream exactly what steps taken one at a time stream: through
sequences that end at different steps (length, end-of-sequence id, stop string), requests that
arrive or are closed mid-run, a pool too small to reserve ahead, and requests it must not run
ahead (repetition penalty). On CPU the static-buffer path runs without capture."""
import dataclasses
import itertools

import torch

from localchat.engine.runtime.request import SamplingParams
from localchat.engine.runtime.sampling import Sampler, choose_tokens, sample_tokens
from test_engine_batching import QUESTIONS, _wait_until_idle
from tiny_models import chat, collect


def _engines(tiny, **serving):
    """(steps one at a time, steps launched ahead) over the same model, both with the static path."""
    one_by_one = tiny.engine(cuda_graphs=True, decode_ahead=False, **serving)
    ahead = tiny.engine(cuda_graphs=True, **serving)
    return one_by_one, ahead


def _run(engine, requests):
    """Submits all at once -> [(ids, text, finish reason, completion tokens)]."""
    streams = [engine.submit(r) for r in requests]
    out = []
    for s in streams:
        ids, text, _, final = collect(s)
        out.append((ids, text, final.finish_reason, final.completion_tokens))
    return out


def _close(engines):
    for e in engines:
        assert _wait_until_idle(e)
        e.shutdown()


def test_sequences_ending_at_different_steps_stream_the_same_tokens(oss):
    lengths = [3, 7, 12, 20, 5]
    requests = [chat(("user", q), max_tokens=n) for q, n in zip(QUESTIONS, lengths)]
    requests.append(chat(("user", QUESTIONS[1]), max_tokens=15, temperature=1.0, top_p=0.9, seed=3))
    one_by_one, ahead = _engines(oss, block_size=4, max_batch_tokens=64, max_running=8)
    expected = _run(one_by_one, requests)
    assert [n for *_, n in expected] == lengths + [15]
    assert _run(ahead, requests) == expected
    assert one_by_one.counters()["ahead_steps"] == 0
    c = ahead.counters()
    # The batch shrank five times as sequences reached their lengths: still mostly ahead. (How
    # many steps each engine takes depends on when the engine thread saw each submission.)
    assert c["ahead_steps"] >= 10
    _close([one_by_one, ahead])
    times = ahead.decode_step_times()
    assert sum(n for n, _ in times.values()) == c["graph_steps"]


def test_end_of_sequence_and_stop_strings_drop_the_row_launched_after(oss):
    base = chat(("user", QUESTIONS[1]), max_tokens=30)
    plain = oss.engine(block_size=4)
    ids, text, _, _ = collect(plain.submit(base))
    plain.shutdown()
    eos = ids[9]
    stop = text[4:7]
    stopped = dataclasses.replace(base, sampling=dataclasses.replace(base.sampling, stop=(stop,)))
    requests = [base, stopped, chat(("user", QUESTIONS[2]), max_tokens=30)]
    with_eos = dataclasses.replace(oss, spec=dataclasses.replace(oss.spec, eos_token_ids=(eos,)))
    one_by_one, ahead = _engines(with_eos, block_size=4, max_running=4)
    expected = _run(one_by_one, requests)
    assert expected[0][2] == "stop" and len(expected[0][0]) == ids.index(eos)
    assert expected[1][2] == "stop" and expected[1][1] == text[:text.index(stop)]
    assert _run(ahead, requests) == expected
    assert ahead.counters()["ahead_steps"] > 0
    _close([one_by_one, ahead])


def test_a_request_arriving_mid_run_and_a_closed_stream(oss):
    long = chat(("user", QUESTIONS[1]), max_tokens=40)
    late = chat(("user", QUESTIONS[4]), max_tokens=10)
    reference = oss.engine(block_size=4)
    expected_long, expected_late = (collect(reference.submit(r))[0] for r in (long, late))
    reference.shutdown()
    engine = oss.engine(block_size=4, cuda_graphs=True, max_running=4)
    first = engine.submit(long)
    items = iter(first)
    got = list(itertools.islice(items, 5))
    second = engine.submit(late)  # joins the batch: the run ahead stops for the scheduler
    assert collect(second)[0] == expected_late
    rest, _, _, final = collect(items)
    assert [t for d in got for t in d.token_ids] + rest == expected_long and final.finish_reason == "length"
    # Closing one of two streams mid-run aborts it; the other goes on to the same tokens.
    kept, closed = engine.submit(long), engine.submit(chat(("user", QUESTIONS[0]), max_tokens=400))
    next(iter(closed))
    closed.close()
    final = collect(closed)[3]
    assert final.finish_reason == "abort" and final.completion_tokens < 400
    assert collect(kept)[0] == expected_long
    assert engine.counters()["ahead_steps"] > 0
    _close([engine])


def test_a_pool_too_small_to_reserve_ahead_still_gives_the_same_tokens(oss):
    requests = [chat(("user", q), max_tokens=24) for q in QUESTIONS[:3]]
    roomy = oss.engine(block_size=4)
    expected = [collect(roomy.submit(r))[0] for r in requests]
    roomy.shutdown()
    tight = oss.engine(block_size=4, num_blocks=30, max_batch_tokens=16, cuda_graphs=True)
    assert [collect(s)[0] for s in [tight.submit(r) for r in requests]] == expected
    c = tight.counters()
    assert c["preemptions"] > 0 and c["ahead_steps"] > 0
    _close([tight])


def test_repetition_penalty_runs_one_step_at_a_time(oss):
    request = chat(("user", QUESTIONS[3]), max_tokens=12, repetition_penalty=1.3)
    one_by_one, ahead = _engines(oss, block_size=4)
    assert _run(ahead, [request]) == _run(one_by_one, [request])
    assert ahead.counters()["ahead_steps"] == 0 and ahead.counters()["graph_steps"] > 0
    _close([one_by_one, ahead])


def test_presence_and_frequency_penalties_run_one_step_at_a_time_and_change_the_answer(oss):
    plain = chat(("user", QUESTIONS[3]), max_tokens=12)
    request = chat(("user", QUESTIONS[3]), max_tokens=12, presence_penalty=2.0, frequency_penalty=1.0)
    one_by_one, ahead = _engines(oss, block_size=4)
    penalised = _run(ahead, [request])
    assert penalised == _run(one_by_one, [request]) and penalised != _run(one_by_one, [plain])
    assert ahead.counters()["ahead_steps"] == 0
    _close([one_by_one, ahead])


def test_choosing_on_the_device_matches_sampling_alone():
    logits = torch.randn(4, 257)
    params = [SamplingParams(temperature=0.8, top_k=30, seed=1), SamplingParams(temperature=1.2, seed=2),
              SamplingParams(temperature=0.5, min_p=0.05, seed=3), SamplingParams(temperature=1.0, top_p=0.8, seed=4)]
    together = choose_tokens(logits, [Sampler(p) for p in params], [None] * 4)
    assert together.dtype == torch.int64 and together.shape == (4,)
    alone = [sample_tokens(logits[i:i + 1], [Sampler(p)], [None])[0] for i, p in enumerate(params)]
    assert together.tolist() == alone
