"""The chunk-graph path (steps of few tokens from static buffers, padded to a token-count bucket,
the padding sequence writing only the scratch block) gives the logits, cache entries and tokens of
the eager step. On CPU it runs without capture; tests/gpu/test_chunk_graphs_cuda.py replays real
graphs."""
import pytest
import torch

from localchat.engine.runtime.chunk_graphs import ChunkGraphs, bucket_sizes
from localchat.engine.runtime.kv_cache import build_kv_cache
from localchat.engine.runtime.step_runner import StepInputs, StepRunner
from test_engine_batching import QUESTIONS, _wait_until_idle
from tiny_models import chat, collect, image

BLOCK = 4


def test_bucket_sizes():
    assert bucket_sizes(2048) == [16, 32, 48, 64, 80, 96, 112, 128, 160, 192, 224, 256]
    assert bucket_sizes(100) == [16, 32, 48, 64, 80, 96]
    assert bucket_sizes(8) == []


def _runners(tiny, max_tokens=64, max_seqs=4):
    """An eager runner and one with chunk graphs, over caches of the same layout (40 blocks in the
    pool, block 40 the scratch block; for gpt-oss's sliding layers a group of 40 and its placeholder)."""
    spec, sliding = tiny.spec, 40 if tiny.spec.sliding_window else 0
    out = []
    for graphs in (False, True):
        cache = build_kv_cache(spec, 41, BLOCK, spec.num_kv_heads, torch.float32, "cpu", sliding)
        chunks = None
        if graphs:
            chunks = ChunkGraphs(tiny.model, cache, torch.float32, torch.device("cpu"), max_tokens=max_tokens,
                                 max_seqs=max_seqs, max_blocks=16, scratch_block=40,
                                 mrope=spec.family == "glm4v_moe")
        out.append(StepRunner(tiny.model, cache, torch.device("cpu"), torch.float32, None, chunks))
    return out


def _inputs(tiny, steps: list[tuple[int, int]], tables, sliding_tables, seed: int) -> StepInputs:
    """steps: (cached, new) tokens of each sequence; every sequence samples its last row."""
    g = torch.Generator().manual_seed(seed)
    ids, positions, entries, last = [], [], [], []
    for table, (cached, new) in zip(tables, steps):
        ids += torch.randint(5, tiny.spec.vocab_size, (new,), generator=g).tolist()
        positions.append(torch.arange(cached, cached + new))
        entries.append((table, cached, new))
        last.append(len(ids) - 1)
    pos = torch.cat(positions)
    if tiny.spec.family == "glm4v_moe":
        pos = pos.expand(3, -1).contiguous()
    return StepInputs(ids, entries, pos, None, last, sliding_tables)


@pytest.mark.parametrize("family", ["oss", "glm"])
def test_padded_chunk_steps_give_the_eager_logits_and_cache(family, request):
    tiny = request.getfixturevalue(family)
    eager, graphs = _runners(tiny)
    split = tiny.spec.sliding_window is not None
    tables = [list(range(i * 10, i * 10 + 10)) for i in range(4)]
    sliding = [list(range(i * 10, i * 10 + 10)) for i in range(4)] if split else None
    # A prefill of three sequences (odd lengths across blocks), then a mixed step of two decode
    # tokens and a chunk after a cached prefix, then four sequences at once: buckets 16, 32, 48.
    rounds = [[(0, 5), (0, 9), (0, 2)], [(5, 1), (9, 1), (2, 20)], [(6, 3), (10, 20), (22, 17), (0, 7)]]
    for i, steps in enumerate(rounds):
        n = len(steps)
        inputs = _inputs(tiny, steps, tables[:n], sliding[:n] if split else None, seed=i)
        size = graphs.chunks.bucket(inputs)
        assert size == (16, 32, 48)[i]
        want = eager.execute(inputs)
        got = graphs.execute(inputs)
        assert got.shape == want.shape == (n, tiny.spec.vocab_size)
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    assert graphs.counters.chunk_graph_steps == 3
    # Every real slot holds the eager step's key; the padding wrote nowhere but the scratch block.
    groups = [(eager.cache.full, graphs.cache.full, 40), (eager.cache.sliding, graphs.cache.sliding,
                                                          graphs.cache.placeholder)] if split else \
        [(eager.cache, graphs.cache, 40)]
    for plain, padded, scratch in groups:
        keep = [b for b in range(padded.k.shape[1]) if b != scratch]
        torch.testing.assert_close(padded.k[:, keep], plain.k[:, keep], rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(padded.v[:, keep], plain.v[:, keep], rtol=1e-5, atol=1e-5)
        assert padded.k[:, scratch].abs().sum() > 0  # the padding did write there


def test_steps_the_graphs_do_not_take(oss):
    eager, graphs = _runners(oss, max_tokens=32, max_seqs=2)
    tables = [list(range(i * 10, i * 10 + 10)) for i in range(3)]
    sliding = [list(range(i * 10, i * 10 + 10)) for i in range(3)]
    chunks = graphs.chunks
    assert chunks.sizes == [16, 32]
    assert chunks.bucket(_inputs(oss, [(0, 33)], tables[:1], sliding[:1], 0)) is None  # more tokens
    assert chunks.bucket(_inputs(oss, [(0, 3)] * 3, tables, sliding, 0)) is None  # more sequences
    no_sampling = _inputs(oss, [(0, 7)], tables[:1], sliding[:1], 0)
    no_sampling.last_rows = []
    assert chunks.bucket(no_sampling) is None
    with_image = _inputs(oss, [(0, 7)], tables[:1], sliding[:1], 0)
    with_image.features = torch.zeros(2, oss.spec.hidden_size)
    assert chunks.bucket(with_image) is None
    assert chunks.bucket(_inputs(oss, [(0, 7)], tables[:1], None, 0)) is None  # a split cache needs both tables
    wide = _inputs(oss, [(0, 7)], [list(range(17))], [list(range(17))], 0)
    assert chunks.bucket(wide) is None  # a table wider than the graphs' (16 blocks)
    assert chunks.bucket(_inputs(oss, [(5, 1), (9, 1)], tables[:2], sliding[:2], 0)) is None  # decode only
    assert chunks.bucket(_inputs(oss, [(0, 17)], tables[:1], sliding[:1], 0)) == 32


def test_a_failing_chunk_graph_falls_back_to_eager_steps(oss, monkeypatch):
    eager, graphs = _runners(oss)
    tables, sliding = [list(range(10))], [list(range(10))]
    inputs = _inputs(oss, [(0, 9)], tables, sliding, 0)

    def broken(*args, **kwargs):
        raise RuntimeError("operation not permitted when stream is capturing")

    monkeypatch.setattr(graphs.chunks, "run", broken)
    torch.testing.assert_close(graphs.execute(inputs), eager.execute(inputs))
    assert graphs.chunks is None and graphs.counters.chunk_graph_steps == 0
    graphs.fails_together = True  # under tensor parallelism the step fails instead
    graphs.chunks = _runners(oss)[1].chunks
    monkeypatch.setattr(graphs.chunks, "run", broken)
    with pytest.raises(RuntimeError, match="capturing"):
        graphs.execute(inputs)


def test_engine_with_chunk_graphs_gives_the_plain_tokens(oss):
    # Prompts read in 16-token steps: their last chunks and the steps they share with other
    # chats' decode tokens take the chunk graphs (buckets 16 and 32 of max_batch_tokens 32).
    requests = [chat(("user", q), max_tokens=10) for q in QUESTIONS]
    plain = oss.engine(block_size=4, max_batch_tokens=32, max_batch_tokens_while_decoding=16)
    expected = [collect(plain.submit(r))[0] for r in requests]
    both = oss.engine(block_size=4, max_batch_tokens=32, max_batch_tokens_while_decoding=16, cuda_graphs=True,
                      max_running=4)
    streams = [both.submit(r) for r in requests]
    assert [collect(s)[0] for s in streams] == expected
    c = both.counters()
    assert c["chunk_graph_steps"] > 0 and c["graph_steps"] > 0
    assert c["chunk_graph_steps"] + c["graph_steps"] < c["steps"]  # chunks that sample nothing stay eager
    assert _wait_until_idle(both)
    assert plain.counters()["chunk_graph_steps"] == 0
    plain.shutdown()
    both.shutdown()


def test_glm_image_turn_then_a_short_follow_up(glm):
    # The image's chunk runs eagerly (features); the follow-up's new tokens after the cached
    # first turn take a chunk graph with M-RoPE positions past the image.
    first = chat(("user", (image(4), "What is this?")), max_tokens=6)
    plain = glm.engine(block_size=4, max_batch_tokens=64)
    graphs = glm.engine(block_size=4, max_batch_tokens=64, chunk_graphs=True, max_running=4)
    answers = []
    for engine in (plain, graphs):
        ids, text, _, _ = collect(engine.submit(first))
        follow = chat(("user", (image(4), "What is this?")), ("assistant", text), ("user", "And the colour?"),
                      max_tokens=6)
        answers.append((ids, collect(engine.submit(follow))[0]))
    assert answers[0] == answers[1]
    c = graphs.counters()
    assert c["chunk_graph_steps"] >= 1 and c["prefix_hit_tokens"] > 0 and c["graph_steps"] == 0
    plain.shutdown()
    graphs.shutdown()
