"""The load test (bench/load_test.py), short: concurrent streaming clients with mid-stream cancels
against the API over a real Engine on the demo model, then the KV pool must be full again.
The fake-engine tests check that the load test's own checks catch what they claim to."""
import asyncio
import importlib.util
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest

from fake_engine import FakeEngine, FakeStream
from localchat.engine.runtime.request import Final, Timings

_SCRIPT = Path(__file__).resolve().parents[2] / "bench" / "load_test.py"
_spec = importlib.util.spec_from_file_location("load_test", _SCRIPT)
load_test = importlib.util.module_from_spec(_spec)
sys.modules.setdefault("load_test", load_test)  # dataclasses look their module up there
_spec.loader.exec_module(load_test)


@pytest.mark.slow
def test_short_load_on_demo_engine(tmp_path):
    from localchat.app.demo import ensure_demo
    from localchat.engine.runtime.engine import Engine

    engine = Engine(ensure_demo(tmp_path), device="cpu")
    try:
        report = load_test.run_load(engine, clients=8, seconds=10, seed=1)
    finally:
        engine.shutdown()
    print(report.summary())
    assert report.failure_count == 0, report.failures
    assert report.completed >= 8 and report.cancelled >= 1
    assert report.completion_tokens > 0 and report.ttft
    assert report.kv_free_blocks == report.kv_num_blocks


class _FailingStream(FakeStream):
    def __iter__(self):
        yield from list(super().__iter__())[:-1]
        yield Final("error", 3, 1, Timings(), error="boom")


class _FailingEngine(FakeEngine):
    def submit(self, request):
        return _FailingStream(self, request)


def test_error_events_are_counted_as_failures():
    engine = _FailingEngine(delay=0.0, filler_words=2)
    with load_test.ServerThread(load_test.api_app(engine)) as server:
        report = asyncio.run(load_test.drive(server.url, engine.name, clients=2, seconds=0.5, seed=0,
                                             cancel_prob=0.0, request_timeout=10))
    assert report.failure_count > 0 and report.completed == 0
    assert "boom" in report.failures[0]
    assert not report.ok


def test_fake_engine_run_passes_the_completeness_checks():
    engine = FakeEngine(delay=0.0, filler_words=80)
    with load_test.ServerThread(load_test.api_app(engine)) as server:
        report = asyncio.run(load_test.drive(server.url, engine.name, clients=2, seconds=0.5, seed=0,
                                             cancel_prob=0.5, request_timeout=10))
    assert report.failure_count == 0, report.failures
    assert report.completed > 0 and report.cancelled > 0


def test_blocks_still_held_after_the_load_fail_the_run():
    held = SimpleNamespace(counters=lambda: {"free_blocks": 7, "num_blocks": 8},
                           pool=SimpleNamespace(check=lambda: None))
    report = load_test.LoadReport(clients=1, seconds=1.0, completed=1)
    load_test.wait_for_idle_pool(held, report, timeout=0.2)
    assert not report.ok and "7/8" in report.failures[0]
