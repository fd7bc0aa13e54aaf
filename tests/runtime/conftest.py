"""Fixtures for the runtime tests: one tiny gpt-oss and one tiny GLM-4.5V per session."""
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))

from tiny_models import tiny_glm, tiny_gpt_oss  # noqa: E402


@pytest.fixture(scope="session")
def oss(tmp_path_factory):
    return tiny_gpt_oss(tmp_path_factory.mktemp("oss"))


@pytest.fixture(scope="session")
def glm(tmp_path_factory):
    return tiny_glm(tmp_path_factory.mktemp("glm"))
