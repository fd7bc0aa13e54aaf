"""Fixtures for the app tests: a History in a tmp dir and the fake engine."""
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
