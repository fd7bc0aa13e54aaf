"""The real engine on the demo checkpoint (CPU), wrapped for the app tests."""
from __future__ import annotations

import dataclasses
import time

from localchat.engine.runtime.engine import Engine


class DemoEngine:
    """The real engine, with answers capped at `max_tokens` so the tests stay short; every request
    and engine stream is recorded."""

    def __init__(self, engine: Engine, max_tokens: int):
        self.engine, self.max_tokens = engine, max_tokens
        self.requests, self.streams = [], []

    def info(self):
        return self.engine.info()

    def counters(self):
        return self.engine.counters()

    def submit(self, request):
        sampling = dataclasses.replace(request.sampling, max_tokens=min(request.sampling.max_tokens, self.max_tokens))
        request = dataclasses.replace(request, sampling=sampling)
        self.requests.append(request)
        stream = self.engine.submit(request)
        self.streams.append(stream)
        return stream


def without_end_of_text(monkeypatch, engine: Engine) -> None:
    """No end-of-text token while the test runs: a random-weight answer then goes on to its token
    limit instead of now and then ending within a few tokens, which a test that leaves or stops
    mid-answer cannot allow."""
    monkeypatch.setattr(engine, "spec", dataclasses.replace(engine.spec, eos_token_ids=()))


def slow_steps(monkeypatch, engine: Engine, delay: float) -> None:
    """Every engine step (prefill chunk or decode step) also sleeps `delay` seconds: the demo model
    answers in a fraction of a second on CPU, too fast for a browser to watch or for Stop to land
    mid-answer."""
    for name in ("run", "run_ahead"):  # steps the scheduler plans, and decode steps launched ahead
        monkeypatch.setattr(engine.runner, name, _paced(getattr(engine.runner, name), delay))


def _paced(run, delay: float):
    def paced(*args, **kwargs):
        time.sleep(delay)
        return run(*args, **kwargs)

    return paced
