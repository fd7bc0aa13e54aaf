"""The engine with tp=2 on the CPU (gloo): the same greedy chat answers as tp=1, text and image
requests batched together, each rank reading only part of the checkpoint, and clean ends: the
workers stop with the engine, a killed worker fails requests with an error naming it (no hang),
and the workers exit when the engine's process dies."""
import io
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

sys.path.insert(0, str(Path(__file__).parents[1]))
from fixtures import open_fixture  # noqa: E402

from localchat.engine.runtime.engine import Engine  # noqa: E402
from localchat.engine.runtime.request import (  # noqa: E402
    ChatRequest, Final, ImagePart, Message, SamplingParams, TextPart)

pytestmark = pytest.mark.slow  # spawns processes


def engine(name, **parallel) -> Engine:
    return Engine(open_fixture(name), device="cpu", dtype="float32", block_size=4, max_batch_tokens=16, **parallel)


def ask(*parts, max_tokens=6) -> ChatRequest:
    parts = tuple(TextPart(p) if isinstance(p, str) else p for p in parts)
    return ChatRequest((Message("user", parts),), SamplingParams(temperature=0.0, max_tokens=max_tokens))


def picture() -> ImagePart:
    pixels = np.random.RandomState(5).randint(0, 255, (56, 56, 3), dtype=np.uint8)
    buf = io.BytesIO()
    Image.fromarray(pixels).save(buf, format="PNG")
    return ImagePart.from_bytes(buf.getvalue())


def answers(e: Engine, requests) -> list[tuple[list[int], Final]]:
    """Submits all requests at once (so they share steps), then drains each stream."""
    streams = [e.submit(r) for r in requests]
    out = []
    for s in streams:
        ids, final = [], None
        for item in s:
            if isinstance(item, Final):
                final = item
            else:
                ids += item.token_ids
        out.append((ids, final))
    return out


@pytest.mark.parametrize("name,ep,requests", [
    ("gpt-oss-mxfp4", False, lambda: [ask("Tell me a story"), ask("Why is the sky blue?", max_tokens=4)]),
    ("glm-bf16", True, lambda: [ask(picture(), "What is this?"), ask("Hello there")]),
])
def test_tp2_engine_answers_like_tp1(name, ep, requests):
    one = engine(name)
    try:
        want = answers(one, requests())
    finally:
        one.shutdown()
    two = engine(name, tp=2, ep=ep)
    try:
        got = answers(two, requests())
        info = two.info()
        reports, procs = two.workers.reports, two.workers.procs
    finally:
        two.shutdown()
    assert [ids for ids, _ in got] == [ids for ids, _ in want]
    assert all(f.finish_reason in ("stop", "length") for _, f in got), [f.error for _, f in got]
    assert all(ids for ids, _ in got)
    assert "2 ranks" in info.placement
    # rank 0 read its slices in this process, rank 1 in its own; neither read the whole file
    total = sum(f.stat().st_size for f in open_fixture(name).glob("*.safetensors"))
    assert [r.rank for r in reports] == [0, 1]
    assert all(r.bytes_read < 0.8 * total for r in reports)
    assert not any(p.is_alive() for p in procs)  # shutdown stopped the workers


@pytest.mark.parametrize("name,ep", [("gpt-oss-mxfp4", False), ("glm-bf16", True)])
def test_tp2_decode_graph_path_answers_like_tp1(name, ep):
    """Decode steps through every rank's DecodeGraphs (static buffers, padded buckets; on the CPU
    they run without capture): rank 0 sends each step's decode inputs, the workers replay theirs."""
    requests = [ask("Tell me a story", max_tokens=8), ask("Hello there", max_tokens=5), ask("Why?", max_tokens=7)]
    one = engine(name)
    try:
        want = answers(one, requests)
    finally:
        one.shutdown()
    two = engine(name, tp=2, ep=ep, cuda_graphs=True, max_running=4)
    try:
        assert two.warmup() == 0.0  # nothing to compile or capture on the CPU
        assert two.runner.warm_prefill(two.pool, [12], two.sliding_pool) == [12]  # a prefill every rank runs
        assert two.pool.num_free == two.pool.num_blocks
        if name.startswith("gpt-oss"):  # its sliding layers (window 8) have a pool of their own
            assert two.sliding_pool.num_free == two.sliding_pool.num_blocks
        got = answers(two, requests)
        graph_steps = two.counters()["graph_steps"]
    finally:
        two.shutdown()
    assert [ids for ids, _ in got] == [ids for ids, _ in want]
    assert graph_steps >= 4  # three sequences padded to the bucket of 4, then fewer


def test_a_killed_worker_fails_requests_with_an_error_naming_it():
    e = engine("gpt-oss-mxfp4", tp=2)
    try:
        proc = e.workers.procs[0]
        os.kill(proc.pid, signal.SIGKILL)
        proc.join(10)
        start = time.monotonic()
        (ids, final), = answers(e, [ask("Hello")])
        assert final.finish_reason == "error"
        assert "rank 1" in final.error and "signal 9" in final.error and "restart" in final.error
        (_, again), = answers(e, [ask("Hello again")])  # the group stays failed, and says so
        assert again.finish_reason == "error" and "rank 1" in again.error
        assert time.monotonic() - start < 20
    finally:
        e.shutdown()


def test_workers_exit_when_the_engine_process_dies(tmp_path):
    script = textwrap.dedent(f"""
        import time
        from localchat.engine.runtime.engine import Engine
        e = Engine({str(open_fixture("gpt-oss-mxfp4"))!r}, device="cpu", dtype="float32", tp=2, block_size=4)
        print(e.workers.procs[0].pid, flush=True)
        time.sleep(120)
    """)
    parent = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True)
    try:
        worker = int(parent.stdout.readline())
    finally:
        parent.kill()
        parent.wait()
    deadline = time.monotonic() + 20
    while time.monotonic() < deadline:
        try:
            os.kill(worker, 0)
        except ProcessLookupError:
            return
        time.sleep(0.1)
    os.kill(worker, signal.SIGKILL)
    pytest.fail("the worker outlived its engine's process")


def test_expert_parallel_needs_several_ranks():
    with pytest.raises(ValueError, match="tp >= 2"):
        engine("gpt-oss-mxfp4", ep=True)


def _cli(*args):
    import shutil

    script = shutil.which("localchat", path=str(Path(sys.executable).parent)) or shutil.which("localchat")
    env = dict(os.environ, HF_HUB_OFFLINE="1", TRANSFORMERS_VERBOSITY="error")
    return subprocess.run([script, *map(str, args)], capture_output=True, text=True, timeout=180, env=env)


def test_run_command_with_tp_and_ep_gives_the_tp1_answer():
    import json

    name = "gpt-oss-bf16"
    out = _cli("run", open_fixture(name), "--prompt", "Tell me a story", "--temperature", "0", "--max-tokens", "5",
               "--json", "--device", "cpu", "--tp", "2", "--ep")
    assert out.returncode == 0, out.stderr
    one = engine(name)
    try:
        (want, _), = answers(one, [ask("Tell me a story", max_tokens=5)])
    finally:
        one.shutdown()
    assert json.loads(out.stdout)["token_ids"] == want


def test_run_command_refuses_a_split_the_model_does_not_allow():
    out = _cli("run", open_fixture("glm-bf16"), "--prompt", "hi", "--device", "cpu", "--tp", "3")
    assert out.returncode == 1 and "num_attention_heads = 4 is not divisible by tensor-parallel size 3" in out.stderr
    assert "Traceback" not in out.stderr
    bad = _cli("run", open_fixture("glm-bf16"), "--prompt", "hi", "--gpus", "zero")
    assert bad.returncode == 2 and "--gpus takes GPU indices" in bad.stderr


@pytest.mark.gpu
@pytest.mark.parametrize("ep", [False, True])
def test_tp2_over_nccl_answers_like_one_gpu(ep):
    import torch

    if torch.cuda.device_count() < 2:
        pytest.skip("needs two CUDA GPUs")
    requests = [ask(picture(), "What is this?"), ask("Hello there")]
    path = open_fixture("glm-bf16")
    one = Engine(path, device="cuda", dtype="float32", block_size=16)
    try:
        want = answers(one, requests)
    finally:
        one.shutdown()
    two = Engine(path, device="cuda", dtype="float32", block_size=16, tp=2, ep=ep, gpus=[0, 1])
    try:
        got = answers(two, requests)
    finally:
        two.shutdown()
    assert [ids for ids, _ in got] == [ids for ids, _ in want]
    assert all(f.finish_reason in ("stop", "length") for _, f in got), [f.error for _, f in got]
