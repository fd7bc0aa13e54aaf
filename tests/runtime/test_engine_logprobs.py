"""Log-probabilities from the engine on the tiny models: each generated token's value is the
log_softmax of the transformers model's logits at its position, on the eager path and on decode
steps launched ahead (the static path, run without capture on CPU); asking changes no token of
its own or of the requests batched with it; the end-of-sequence token has its entry too."""
import dataclasses

import pytest
import torch

from test_engine_batching import QUESTIONS, _wait_until_idle
from tiny_models import chat
from localchat.engine.runtime.request import Delta, Final


def _answer(stream):
    """(generated ids, logprob entries, Final) of one stream."""
    ids, entries = [], []
    for item in stream:
        if isinstance(item, Final):
            return ids, entries, item
        ids += item.token_ids
        entries += item.logprobs
    raise AssertionError("the stream ended without a Final")


def _reference(tiny, engine, request, ids) -> torch.Tensor:
    """[len(ids), V] log_softmax of the transformers model's logits at each generated position."""
    prompt = engine.formatter.build(request).input_ids
    with torch.no_grad():
        logits = tiny.hf(input_ids=torch.tensor([prompt + ids])).logits[0, len(prompt) - 1:-1]
    return torch.log_softmax(logits.float(), dim=-1)


@pytest.mark.parametrize("ahead", [False, True], ids=["eager", "ahead"])
@pytest.mark.parametrize("family", ["oss", "glm"])
def test_greedy_logprobs_are_the_models_log_softmax(family, ahead, request):
    tiny = request.getfixturevalue(family)
    engine = tiny.engine(block_size=4, cuda_graphs=ahead)
    asked = chat(("user", QUESTIONS[1]), max_tokens=12, logprobs=5)
    ids, entries, final = _answer(engine.submit(asked))
    assert len(entries) == final.completion_tokens == len(ids) == 12
    assert [e.id for e in entries] == ids
    ref = _reference(tiny, engine, asked, ids)
    assert ref.argmax(dim=-1).tolist() == ids
    top = torch.topk(ref, 5)
    for i, e in enumerate(entries):
        assert e.logprob == pytest.approx(float(ref[i, ids[i]]), abs=1e-4)
        assert [t.id for t in e.top] == top.indices[i].tolist() and e.top[0].id == ids[i]
        assert [t.logprob for t in e.top] == pytest.approx(top.values[i].tolist(), abs=1e-4)
        assert e.token == tiny.tokenizer.decode([ids[i]]) and bytes(e.bytes).decode() == e.token
    assert (engine.counters()["ahead_steps"] > 0) == ahead
    assert _wait_until_idle(engine)
    engine.shutdown()


@pytest.mark.parametrize("ahead", [False, True], ids=["eager", "ahead"])
def test_asking_changes_no_token_of_its_own_or_of_the_requests_beside_it(oss, ahead):
    plain = [chat(("user", QUESTIONS[0]), max_tokens=10),
             chat(("user", QUESTIONS[2]), max_tokens=14, temperature=0.8, top_k=40, seed=5),
             chat(("user", QUESTIONS[4]), max_tokens=8, temperature=1.1, seed=9)]
    alone_engine = oss.engine(block_size=4, cuda_graphs=ahead)
    alone = [_answer(alone_engine.submit(r))[0] for r in plain]
    asking = [dataclasses.replace(r, sampling=dataclasses.replace(r.sampling, logprobs=n))
              for r, n in zip(plain, (None, 3, 0))]
    engine = oss.engine(block_size=4, cuda_graphs=ahead)
    answers = [_answer(s) for s in [engine.submit(r) for r in asking]]  # all in flight together
    assert [ids for ids, _, _ in answers] == alone
    assert answers[0][1] == []
    for (ids, entries, _), n in zip(answers[1:], (3, 0)):
        assert [e.id for e in entries] == ids and all(len(e.top) == n for e in entries)
        assert all(e.logprob <= 0 for e in entries)
    for e in (alone_engine, engine):
        assert _wait_until_idle(e)
        e.shutdown()


def test_the_end_of_sequence_token_has_an_entry_but_no_text(oss):
    request = chat(("user", QUESTIONS[1]), max_tokens=30, logprobs=2)
    plain = oss.engine(block_size=4)
    ids = _answer(plain.submit(request))[0]
    plain.shutdown()
    eos = ids[6]
    with_eos = dataclasses.replace(oss, spec=dataclasses.replace(oss.spec, eos_token_ids=(eos,)))
    for ahead in (False, True):
        engine = with_eos.engine(block_size=4, cuda_graphs=ahead)
        stream = engine.submit(request)
        items = list(stream)
        got, entries, final = _answer(iter(items))
        assert final.finish_reason == "stop" and got == ids[:6]
        assert len(entries) == final.completion_tokens == 7 and [e.id for e in entries] == ids[:7]
        last = next(d for d in items if isinstance(d, Delta) and d.logprobs and d.logprobs[0].id == eos)
        assert (last.text, last.reasoning, last.token_ids) == ("", "", ())
        engine.shutdown()


@pytest.mark.parametrize("ahead", [False, True], ids=["eager", "ahead"])
def test_one_log_softmax_per_step_over_the_rows_that_asked_and_none_without(oss, ahead, monkeypatch):
    rows_per_call = []
    log_softmax = torch.log_softmax

    def counted(x, *args, **kwargs):
        rows_per_call.append(x.shape[0])
        return log_softmax(x, *args, **kwargs)

    monkeypatch.setattr(torch, "log_softmax", counted)
    engine = oss.engine(block_size=4, cuda_graphs=ahead)
    plain = [chat(("user", q), max_tokens=10) for q in QUESTIONS[:3]]
    for s in [engine.submit(r) for r in plain]:
        _answer(s)
    assert rows_per_call == []  # requests that do not ask run nothing extra
    asking = [dataclasses.replace(r, sampling=dataclasses.replace(r.sampling, logprobs=k))
              for r, k in zip(plain, (2, None, 0))]
    answers = [_answer(s) for s in [engine.submit(r) for r in asking]]
    assert sum(rows_per_call) == 20 == sum(len(entries) for _, entries, _ in answers)
    assert max(rows_per_call) == 2  # the two asking rows of a step in one call, the third left out
    assert _wait_until_idle(engine)
    engine.shutdown()


@pytest.mark.gpu
def test_decode_steps_launched_ahead_on_cuda_return_the_eager_values(tmp_path):
    from tiny_models import tiny_gpt_oss

    tiny = tiny_gpt_oss(tmp_path, "cuda")
    requests = [chat(("user", QUESTIONS[0]), max_tokens=24, logprobs=4),
                chat(("user", QUESTIONS[1]), max_tokens=24, temperature=0.9, seed=4, logprobs=0),
                chat(("user", QUESTIONS[2]), max_tokens=24)]
    eager = tiny.engine(block_size=16, cuda_graphs=False)
    expected = [_answer(s) for s in [eager.submit(r) for r in requests]]
    engine = tiny.engine(block_size=16, max_running=8)
    got = [_answer(s) for s in [engine.submit(r) for r in requests]]
    assert engine.counters()["ahead_steps"] > 10
    assert [ids for ids, _, _ in got] == [ids for ids, _, _ in expected]
    for (_, entries, _), (_, reference, _) in zip(got, expected):
        assert [(e.id, [t.id for t in e.top]) for e in entries] == [(e.id, [t.id for t in e.top]) for e in reference]
        # the same tokens and rankings; the values to the rounding of bf16 rows batched otherwise
        # (which step each request joins depends on the host's timing: 1.2e-3 apart in two of six runs)
        assert [e.logprob for e in entries] == pytest.approx([e.logprob for e in reference], abs=5e-3)
    assert [len(entries) for _, entries, _ in got] == [24, 24, 0]
    eager.shutdown()
    engine.shutdown()


@pytest.mark.parametrize("ahead", [False, True], ids=["eager", "ahead"])
def test_a_logit_bias_bans_a_token_beside_requests_without_one(oss, ahead):
    """The row with a bias loses the token the model wants most at its first step, and the rows
    beside it keep the tokens they would choose alone; an id past the vocabulary is refused."""
    plain = [chat(("user", QUESTIONS[0]), max_tokens=6), chat(("user", QUESTIONS[2]), max_tokens=6)]
    engine = oss.engine(block_size=4, cuda_graphs=ahead)
    alone = [_answer(engine.submit(r))[0] for r in plain]
    banned = alone[0][0]
    biased = dataclasses.replace(plain[0], sampling=dataclasses.replace(plain[0].sampling,
                                                                        logit_bias=((banned, -100.0),)))
    ids, _, _ = _answer(engine.submit(biased))
    together = [_answer(s)[0] for s in [engine.submit(biased), engine.submit(plain[1])]]
    assert banned not in ids and together == [ids, alone[1]]
    vocab = engine.spec.vocab_size
    outside = dataclasses.replace(plain[0], sampling=dataclasses.replace(plain[0].sampling,
                                                                         logit_bias=((vocab, 1.0),)))
    final = list(engine.submit(outside))[-1]
    assert final.finish_reason == "error" and "outside this model's vocabulary" in final.error
    assert _wait_until_idle(engine)
    engine.shutdown()
