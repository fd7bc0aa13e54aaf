"""Test-wide setup.

The Triton interpreter must be chosen before any kernel module is imported (it is read when
`@triton.jit` decorates), so it is set here, first, on machines without a CUDA device.
"""
import os
import sys
import zlib
from pathlib import Path

# `python -m pytest` puts the working directory, the repo root, first on sys.path, where the
# top-level kernels/ folder would shadow the `kernels` package that transformers 5.25+ imports;
# the tests import the project as the installed `localchat` package instead.
_ROOT = Path(__file__).resolve().parent.parent
sys.path[:] = [p for p in sys.path if Path(p or ".").resolve() != _ROOT]

import torch  # noqa: E402

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402


@pytest.fixture(autouse=True)
def _seed_from_test_name(request):
    """Each test draws its random inputs from a seed fixed by its own name, so a result does not
    depend on which tests ran before it in the process and a failure reproduces alone. Setting
    LOCALCHAT_TEST_SEED to any other value draws a different set of inputs for every test."""
    salt = os.environ.get("LOCALCHAT_TEST_SEED", "")
    torch.manual_seed(zlib.crc32(f"{request.node.nodeid}{salt}".encode()))


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip_gpu = pytest.mark.skip(reason="needs a CUDA GPU (run `pytest -m gpu` on a GPU machine)")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip_gpu)
