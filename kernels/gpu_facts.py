"""What the launchers need to know about the GPU they launch on, read once per device."""
from __future__ import annotations

import functools
import os

import torch

# The SM count the launch heuristics were measured with (one H200); also the answer for tensors
# off the GPU (the interpreter), where it only shapes the grids.
MEASURED_SMS = 132


@functools.lru_cache(maxsize=None)
def _cuda_sm_count(index: int) -> int:
    return torch.cuda.get_device_properties(index).multi_processor_count


def sm_count(device: torch.device) -> int:
    """Streaming multiprocessors of `device`: grids sized per SM scale with the GPU (an H100 PCIe
    has 114, an A100 108, an RTX 4090 128)."""
    if device.type != "cuda":
        return MEASURED_SMS
    return _cuda_sm_count(device.index if device.index is not None else torch.cuda.current_device())


def compiled_on_gpu(device: torch.device) -> bool:
    """Whether Triton kernels on `device` run compiled on a CUDA GPU rather than in Triton's
    interpreter (TRITON_INTERPRET=1, the CPU tests)."""
    return device.type == "cuda" and os.environ.get("TRITON_INTERPRET") != "1"
