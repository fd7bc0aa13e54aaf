"""Fixtures for the app tests: a History in a tmp dir, the fake engine, the real engine on the demo model."""
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))

from fake_engine import FakeEngine  # noqa: E402
from localchat.app.history import History  # noqa: E402


@pytest.fixture
def history(tmp_path):
    h = History(tmp_path / "data")
    yield h
    h.close()


@pytest.fixture
def engine():
    return FakeEngine()


@pytest.fixture(scope="session")
def demo_checkpoint(tmp_path_factory):
    from localchat.app.demo import ensure_demo

    return ensure_demo(tmp_path_factory.mktemp("demo"))


@pytest.fixture(scope="session")
def demo_runtime(demo_checkpoint):
    """One engine on the demo checkpoint for every test that needs it (it loads in seconds)."""
    from localchat.engine.runtime.engine import Engine

    engine = Engine(demo_checkpoint, device="cpu", name="demo")
    yield engine
    engine.shutdown()
