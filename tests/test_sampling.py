import torch

from localchat.engine.runtime.request import SamplingParams
from localchat.engine.runtime.sampling import (
    Sampler, apply_presence_frequency, apply_repetition_penalty, filter_logits, sample_tokens,
)


def test_greedy_is_argmax():
    logits = torch.randn(50)
    assert Sampler(SamplingParams(temperature=0))(logits, torch.tensor([], dtype=torch.long)) == int(logits.argmax())


def test_seed_reproduces_and_differs():
    logits = torch.zeros(1000)
    ctx = torch.tensor([], dtype=torch.long)
    a = [Sampler(SamplingParams(seed=7))(logits, ctx) for _ in range(3)]
    s1, s2 = Sampler(SamplingParams(seed=7)), Sampler(SamplingParams(seed=8))
    seq1 = [s1(logits, ctx) for _ in range(20)]
    seq2 = [s2(logits, ctx) for _ in range(20)]
    s3 = Sampler(SamplingParams(seed=7))
    assert seq1 == [s3(logits, ctx) for _ in range(20)]
    assert seq1 != seq2 and len(set(a)) == 1


def test_top_k_and_top_p_keep_the_right_sets():
    logits = torch.log(torch.tensor([0.5, 0.3, 0.15, 0.05]))
    kept = torch.isfinite(filter_logits(logits, SamplingParams(top_k=2)))
    assert kept.tolist() == [True, True, False, False]
    kept = torch.isfinite(filter_logits(logits, SamplingParams(top_p=0.8)))
    assert kept.tolist() == [True, True, False, False]
    kept = torch.isfinite(filter_logits(logits, SamplingParams(top_p=0.81)))
    assert kept.tolist() == [True, True, True, False]
    kept = torch.isfinite(filter_logits(logits, SamplingParams(min_p=0.25)))
    assert kept.tolist() == [True, True, True, False]


def test_sampling_never_picks_filtered_tokens():
    logits = torch.randn(64)
    top = set(torch.topk(logits, 3).indices.tolist())
    s = Sampler(SamplingParams(temperature=1.5, top_k=3, seed=0))
    assert {s(logits, torch.tensor([], dtype=torch.long)) for _ in range(200)} <= top


def test_repetition_penalty():
    out = apply_repetition_penalty(torch.tensor([2.0, -2.0, 1.0]), torch.tensor([0, 1]), 2.0)
    assert out.tolist() == [1.0, -4.0, 1.0]


def test_presence_and_frequency_penalties_count_the_generated_tokens():
    logits = torch.tensor([3.0, 2.875, 1.0, -1.0])  # values exact in float32
    out = apply_presence_frequency(logits, torch.tensor([0, 0, 3]), presence=0.5, frequency=0.25)
    assert out.tolist() == [3.0 - 0.5 - 2 * 0.25, 2.875, 1.0, -1.0 - 0.5 - 0.25]
    # the prompt's ids (the first prompt_len of the context) do not count; the repetition penalty's do
    context = torch.tensor([1, 1, 0])  # prompt [1, 1], then 0 generated
    greedy = SamplingParams(temperature=0, presence_penalty=0.2)
    assert Sampler(greedy, prompt_len=2)(logits, context) == 1  # 3.0 - 0.2 < 2.875
    assert Sampler(greedy, prompt_len=3)(logits, context) == 0  # nothing generated yet
    assert Sampler(SamplingParams(temperature=0, frequency_penalty=-1.0), prompt_len=2)(logits, context) == 0
    rows = [SamplingParams(temperature=0, frequency_penalty=0.2), SamplingParams(temperature=0),
            SamplingParams(temperature=0.7, presence_penalty=1.5, seed=3)]
    batch = torch.stack([logits, logits, torch.randn(4)])
    samplers = [Sampler(p, prompt_len=2) for p in rows]
    contexts = [context, None, context]
    assert sample_tokens(batch, samplers, contexts) == \
        [sample_tokens(batch[i:i + 1], [Sampler(p, prompt_len=2)], [contexts[i]])[0] for i, p in enumerate(rows)]
    assert sample_tokens(batch, samplers, contexts)[:2] == [1, 0]


def test_logit_bias_bans_and_forces_tokens():
    logits = torch.randn(3, 50) * 2
    top = logits.argmax(dim=-1).tolist()
    banned = [Sampler(SamplingParams(temperature=0, logit_bias=((t, -100.0),))) for t in top]
    context = torch.tensor([1, 2, 3])
    chosen = sample_tokens(logits, banned, [context] * 3)
    assert all(c != t for c, t in zip(chosen, top))
    assert chosen == [logits[b].clone().index_fill_(0, torch.tensor([top[b]]), -1e9).argmax().item()
                      for b in range(3)]
    low = logits.argmin(dim=-1).tolist()
    forced = [Sampler(SamplingParams(temperature=1.0, seed=s, logit_bias=((low[b], 100.0),))) for b, s in
              enumerate((1, 2, 3))]
    assert sample_tokens(logits, forced, [context] * 3) == low
    # a bias on one row leaves the others as they were
    free = Sampler(SamplingParams(temperature=0))
    assert sample_tokens(logits, [banned[0], free, free], [context, None, None])[1:] == top[1:]
