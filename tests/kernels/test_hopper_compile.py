"""The decode-path kernels compile for Hopper (sm_90), and what the launchers send to Ampere, Ada and
Blackwell GPUs for those, on a machine without a GPU."""
import os
import subprocess
import sys
from pathlib import Path

import pytest
import triton

PTXAS = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "ptxas"


@pytest.mark.skipif(not PTXAS.exists(), reason="this Triton build has no bundled ptxas")
def test_decode_kernels_compile_for_each_gpu_generation():
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    script = Path(__file__).with_name("hopper_compile.py")
    done = subprocess.run([sys.executable, str(script)], env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout + done.stderr
    assert done.stdout.count("ok ") == 250 and "FAILED" not in done.stdout, done.stdout
