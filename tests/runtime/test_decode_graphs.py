"""The decode-graph path (static buffers, batch-size buckets, padded rows writing to a scratch
block) gives the tokens of the plain path. On CPU it runs without capture; the GPU test in
test_engine_gpu.py replays real graphs."""
import pytest
import torch

from localchat.engine.runtime.decode_graphs import bucket_sizes
from localchat.engine.runtime.request import SamplingParams, TextPart
from localchat.engine.runtime.sampling import Sampler, sample_tokens
from test_engine_batching import QUESTIONS, _wait_until_idle
from tiny_models import chat, collect, image


def test_bucket_sizes_cover_every_batch():
    assert bucket_sizes(64)[:4] == [1, 2, 4, 8] and bucket_sizes(64)[-1] == 64
    assert bucket_sizes(20) == [1, 2, 4, 8, 12, 16, 20]
    assert bucket_sizes(1) == [1]


def test_padded_static_decode_gives_the_plain_tokens(oss):
    # Three and five sequences pad to buckets of 4 and 8; the scratch rows must not disturb them.
    requests = [chat(("user", q), max_tokens=10) for q in QUESTIONS]
    plain = oss.engine(block_size=4, max_batch_tokens=64)
    expected = [collect(plain.submit(r))[0] for r in requests]
    graphs = oss.engine(block_size=4, max_batch_tokens=64, cuda_graphs=True, max_running=8)
    for group in (requests[:3], requests):
        streams = [graphs.submit(r) for r in group]
        assert [collect(s)[0] for s in streams] == expected[:len(group)]
    c = graphs.counters()
    assert c["graph_steps"] > 0 and c["graph_steps"] < c["steps"]  # prefill steps stay eager
    assert _wait_until_idle(graphs)
    # The scratch blocks lie outside the pools: no sequence was ever given one. The sliding
    # group's is its placeholder block.
    assert graphs.cache.full.k.shape[1] == graphs.pool.num_blocks + 1
    assert graphs.cache.sliding.k.shape[1] == graphs.sliding_pool.num_blocks + 1 == graphs.cache.placeholder + 1
    assert graphs.counters()["sliding_evictions"] + graphs.sliding_pool.num_cached > 0  # windows slid
    plain.shutdown()
    graphs.shutdown()  # joins the engine thread: its last step is counted
    times = graphs.decode_step_times()
    assert {3, 5} <= set(times) and sum(n for n, _ in times.values()) == graphs.counters()["graph_steps"]


def test_glm_image_prompt_decodes_through_the_static_path(glm):
    request = chat(("user", (image(4), TextPart("What is this?"))), max_tokens=10)
    plain = glm.engine(block_size=4, max_batch_tokens=16)
    graphs = glm.engine(block_size=4, max_batch_tokens=16, cuda_graphs=True, max_running=4)
    assert collect(graphs.submit(request))[0] == collect(plain.submit(request))[0]
    assert graphs.counters()["graph_steps"] >= 8  # M-RoPE positions after the image, 3 axes
    plain.shutdown()
    graphs.shutdown()


def test_batched_sampling_matches_row_by_row():
    logits = torch.randn(5, 300)
    params = [SamplingParams(temperature=0), SamplingParams(temperature=0.7, top_k=20, seed=1),
              SamplingParams(temperature=1.3, top_p=0.9, seed=2), SamplingParams(temperature=1.0, min_p=0.1, seed=3),
              SamplingParams(temperature=0, repetition_penalty=1.5)]
    ctx = [None, None, None, None, torch.tensor([int(logits[4].argmax())])]
    together = sample_tokens(logits, [Sampler(p) for p in params], ctx)
    alone = [sample_tokens(logits[i:i + 1], [Sampler(p)], [ctx[i]])[0] for i, p in enumerate(params)]
    assert together == alone
    assert together[0] == int(logits[0].argmax())
    assert together[4] != int(logits[4].argmax())  # the penalty moved the greedy choice
    assert together[1] in torch.topk(logits[1], 20).indices.tolist()


@pytest.mark.parametrize("temperature", [0.5, 1.0])
def test_exponential_race_draws_the_softmax_distribution(temperature):
    logits = torch.tensor([2.0, 1.0, 0.5, 0.0, -1.0])
    s = Sampler(SamplingParams(temperature=temperature, seed=0))
    counts = torch.bincount(torch.tensor([s(logits, None) for _ in range(4000)]), minlength=5).float()
    expected = torch.softmax(logits / temperature, dim=0)
    assert torch.allclose(counts / counts.sum(), expected, atol=0.03)


def test_warm_prefill_borrows_blocks_and_changes_no_answer(glm):
    request = chat(("user", (image(5), TextPart("What is this?"))), max_tokens=6)
    engine = glm.engine(block_size=4, max_batch_tokens=32)
    before = collect(engine.submit(request))[0]
    assert _wait_until_idle(engine)
    ran = engine.runner.warm_prefill(engine.pool, [32, 8, 10**6])  # the last does not fit: skipped
    assert ran == [32, 8] and _wait_until_idle(engine)
    assert collect(engine.submit(request))[0] == before
    engine.shutdown()
