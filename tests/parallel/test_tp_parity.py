"""Tensor and expert parallel runs of every tiny checkpoint against the single-process model:
the same logits (float32 tolerance) for a prompt with an image (GLM) or text (gpt-oss) and the
same greedy tokens, at world sizes 2 and 4, through the group the engine uses (rank 0 here, the
other ranks spawned gloo processes); and each rank reads only its own slices of the checkpoint."""
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image

sys.path.insert(0, str(Path(__file__).parents[1]))
from fixtures import open_fixture  # noqa: E402

from localchat.engine.models import build_model  # noqa: E402
from localchat.engine.parallel.group import WorkerGroup  # noqa: E402
from localchat.engine.parallel.slicing import ShardingError, shard_plan  # noqa: E402
from localchat.engine.runtime.kv_cache import PagedKVCache  # noqa: E402
from localchat.engine.runtime.prompt import ChatFormatter  # noqa: E402
from localchat.engine.runtime.request import ChatRequest, ImagePart, Message, TextPart  # noqa: E402
from localchat.engine.runtime.step_runner import StepInputs, StepRunner  # noqa: E402
from localchat.engine.weights.loader import load_weights, load_weights_slice, read_spec  # noqa: E402

pytestmark = pytest.mark.slow  # spawns processes

BLOCK, BLOCKS, NEW_TOKENS = 16, 24, 4
CPU = torch.device("cpu")
# (fixture, expert parallel). The tiny gpt-oss has I = 96, three 32-value MXFP4 groups, so only
# its experts split four ways whole (EP), not sliced (TP would leave a rank empty). glm-fp8-block
# cannot be split at all: every tiny dim is inside one 128-wide scale block (test_slicing.py).
CASES = {
    2: [("glm-bf16", False), ("glm-bf16", True), ("glm-fp8-channel", False), ("glm-fp8-tensor", True),
        ("gpt-oss-mxfp4", False), ("gpt-oss-mxfp4", True), ("gpt-oss-bf16", False), ("gpt-oss-bf16", True)],
    4: [("glm-bf16", False), ("glm-bf16", True), ("glm-fp8-channel", False), ("glm-fp8-channel", True),
        ("gpt-oss-mxfp4", True), ("gpt-oss-bf16", True)],
}
PARAMS = [(w, name, ep) for w, cases in CASES.items() for name, ep in cases]

_groups: dict[int, WorkerGroup] = {}


def group_of(world: int) -> WorkerGroup:
    """One group per world size, kept for its tests (PARAMS lists them together); a process
    belongs to one torch.distributed group at a time, so the previous one is closed first."""
    if world not in _groups or _groups[world].failure:  # a failed test leaves its group broken
        for old in _groups.values():
            old.close()
        _groups.clear()
        _groups[world] = WorkerGroup([CPU] * world).start()
    return _groups[world]


@pytest.fixture(scope="module", autouse=True)
def _close_groups():
    yield
    for g in _groups.values():
        g.close()
    _groups.clear()


def _image() -> ImagePart:
    import io

    pixels = np.random.RandomState(3).randint(0, 255, (48, 64, 3), dtype=np.uint8)
    buf = io.BytesIO()
    Image.fromarray(pixels).save(buf, format="PNG")
    return ImagePart.from_bytes(buf.getvalue())


def _prompt(path, spec):
    parts = (_image(), TextPart("What is in the picture?")) if spec.vision else (TextPart("Tell me a story"),)
    return ChatFormatter(path, spec).build(ChatRequest((Message("user", parts),)))


def _greedy(model, step, spec, prompt):
    """Prefill (logits of every prompt row) then NEW_TOKENS - 1 decode steps through `step`
    (StepInputs -> logits). Returns (prompt logits [T, V], greedy tokens, decode logits)."""
    ids = list(prompt.input_ids)
    features, delta = None, 0
    if spec.family == "glm4v_moe":
        rope, delta = model.rope_positions(torch.tensor(ids), prompt.image_grid_thw)
        if prompt.pixel_values is not None:
            with torch.inference_mode():
                features = model.encode_images(prompt.pixel_values, prompt.image_grid_thw)
    else:
        rope = torch.arange(len(ids))
    table = list(range(BLOCKS))
    logits = step(StepInputs(ids, [(table, 0, len(ids))], rope, features, list(range(len(ids)))))
    tokens, decoded, pos = [int(logits[-1].argmax())], [], len(ids)
    for _ in range(NEW_TOKENS - 1):
        positions = torch.tensor([pos + delta])
        if spec.family == "glm4v_moe":
            positions = positions.expand(3, 1)
        out = step(StepInputs(tokens[-1:], [(table, pos, 1)], positions, None, [0]))
        decoded.append(out[0])
        tokens.append(int(out[0].argmax()))
        pos += 1
    return logits, tokens, torch.stack(decoded)


def _cache(spec, kv_heads):
    return PagedKVCache(spec.num_layers, BLOCKS, BLOCK, kv_heads, spec.head_dim, torch.float32, CPU)


_single: dict[str, tuple] = {}


def single(name):
    if name not in _single:
        path = open_fixture(name)
        spec = read_spec(path)
        model = build_model(spec, load_weights(path, spec, dtype=torch.float32))
        runner = StepRunner(model, _cache(spec, spec.num_kv_heads), CPU, torch.float32)
        _single[name] = _greedy(model, runner.execute, spec, _prompt(path, spec))
    return _single[name]


def _close(a, b):
    scale = b.abs().max()
    return float((a - b).abs().max() / scale)


@pytest.mark.parametrize("world,name,ep", PARAMS)
def test_split_model_matches_the_single_process_model(world, name, ep):
    path = open_fixture(name)
    spec = read_spec(path)
    group = group_of(world)
    model = group.load(path, spec, torch.float32, expert_parallel=ep)
    assert model.kv_heads * world >= spec.num_kv_heads and model.ctx.world_size == world
    runner = group.step_runner(model, _cache(spec, model.kv_heads), CPU, torch.float32)
    logits, tokens, decoded = _greedy(model, runner.forward, spec, _prompt(path, spec))
    want_logits, want_tokens, want_decoded = single(name)
    assert logits.shape == want_logits.shape == (logits.shape[0], spec.vocab_size)
    assert _close(logits, want_logits) < 1e-5
    assert _close(decoded, want_decoded) < 1e-5
    assert tokens == want_tokens
    # Each rank read exactly the ranges its shard plan names, as reading them here does.
    for report in group.reports:
        plan = shard_plan(spec, world, report.rank, ep)
        seen = []
        load_weights_slice(path, spec, plan, on_progress=lambda done, total, f: seen.append((done, total)))
        assert report.bytes_read == seen[-1][0] < seen[-1][1], report


def test_an_impossible_split_is_refused_before_any_rank_reads():
    path = open_fixture("glm-fp8-block")
    group = group_of(2)
    with pytest.raises(ShardingError, match="FP8 scale blocks"):
        group.load(path, read_spec(path), torch.float32)
    assert group.failure is None and all(p.is_alive() for p in group.procs)


def test_quantize_fp8_while_loading_a_split_model():
    # each rank converts the bf16 slices it reads; row-parallel slices get the scales of their
    # part of each row, finer than a whole row's: every converted slice is at least as close to
    # its bf16 values as the same slice of the single-process conversion, and the split model's
    # logits as far from the bf16 model's as that quantization's error lets them be
    from localchat.engine.parallel.slicing import slice_weights
    from localchat.engine.weights.formats import Fp8Weight
    path = open_fixture("glm-bf16")
    spec = read_spec(path)
    plain = load_weights(path, spec, dtype=torch.float32)
    whole = load_weights(path, spec, dtype=torch.float32, quantize="fp8")
    for rank in range(2):
        plan = shard_plan(spec, 2, rank, False)
        mine, theirs, exact = load_weights_slice(path, spec, plan, quantize="fp8"), slice_weights(whole, plan), \
            slice_weights(plain, plan)
        converted = [k for k, v in mine.items() if isinstance(v, Fp8Weight)]
        assert "model.language_model.layers.1.self_attn.o_proj.weight" in converted
        for k in converted:
            w = exact[k].dequantize()
            assert (mine[k].dequantize() - w).norm() <= (theirs[k].dequantize() - w).norm() * (1 + 1e-6), (k, rank)
    bf16 = single("glm-bf16")[0]
    one = build_model(spec, whole)
    one_logits = _greedy(one, StepRunner(one, _cache(spec, spec.num_kv_heads), CPU, torch.float32).execute, spec,
                         _prompt(path, spec))[0]
    group = group_of(2)
    model = group.load(path, spec, torch.float32, expert_parallel=False, quantize="fp8")
    runner = group.step_runner(model, _cache(spec, model.kv_heads), CPU, torch.float32)
    split_logits = _greedy(model, runner.forward, spec, _prompt(path, spec))[0]
    assert 0 < _close(split_logits, bf16) < 2 * _close(one_logits, bf16)
