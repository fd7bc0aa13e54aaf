"""ParallelContext: one rank never touches torch.distributed; uneven vocabulary slices are
padded for the gather and trimmed after it."""
import sys
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).parents[1]))
from fixtures import open_fixture  # noqa: E402

from localchat.engine.models import build_model  # noqa: E402
from localchat.engine.parallel.context import SINGLE, ParallelContext  # noqa: E402
from localchat.engine.runtime.forward_batch import ForwardBatch  # noqa: E402
from localchat.engine.runtime.kv_cache import PagedKVCache  # noqa: E402
from localchat.engine.weights.loader import load_weights, read_spec  # noqa: E402


def _no_collectives(monkeypatch):
    def refuse(*args, **kwargs):
        raise AssertionError("a collective was called in a single-process run")

    for name in ("all_reduce", "all_gather", "broadcast", "all_gather_into_tensor"):
        monkeypatch.setattr(dist, name, refuse)


@pytest.mark.parametrize("name", ["glm-bf16", "gpt-oss-mxfp4"])
def test_one_rank_calls_no_collective(name, monkeypatch):
    _no_collectives(monkeypatch)
    path = open_fixture(name)
    spec = read_spec(path)
    model = build_model(spec, load_weights(path, spec, dtype=torch.float32))
    assert model.ctx == SINGLE and model.kv_heads == spec.num_kv_heads
    cache = PagedKVCache(spec.num_layers, 2, 16, spec.num_kv_heads, spec.head_dim, torch.float32, "cpu")
    ids = torch.tensor([5, 6, 7])
    rope = torch.arange(3).expand(3, 3) if spec.family == "glm4v_moe" else torch.arange(3)
    batch = ForwardBatch.build([([0, 1], 0, 3)], rope, 16, "cpu")
    logits = model.logits(model.forward(model.embed(ids), batch, cache))
    assert logits.shape == (3, spec.vocab_size) and torch.isfinite(logits).all()


def test_uneven_column_slices_are_padded_for_the_gather_and_trimmed(monkeypatch):
    # vocabulary 10 over 3 ranks: cdiv gives 4, 4 and the last rank 2
    pieces = [torch.arange(0, 8.).view(2, 4), torch.arange(8, 16.).view(2, 4), torch.tensor([[16., 17], [18, 19]])]

    def fake_all_gather_into_tensor(out, x, group=None):
        assert x.shape == (2, 4) and out.shape == (3 * 2, 4)
        for p, piece in zip(out.view(3, 2, 4), pieces):
            p.zero_()[:, :piece.shape[1]] = piece

    monkeypatch.setattr(dist, "all_gather_into_tensor", fake_all_gather_into_tensor)
    ctx = ParallelContext(2, 3, group=object())
    out = ctx.gather_columns(pieces[2], per_rank=4, total=10)
    assert torch.equal(out, torch.cat(pieces, dim=1))


def test_a_context_is_checked():
    with pytest.raises(ValueError, match="rank 2 is outside a group of 2"):
        ParallelContext(2, 2, group=object())
    with pytest.raises(ValueError, match="needs a process group"):
        ParallelContext(0, 2)
