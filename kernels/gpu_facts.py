"""What the launchers need to know about the GPU they launch on, read once per device."""
from __future__ import annotations

import functools
import os
from dataclasses import dataclass

import torch

# The SM count the launch heuristics were measured with (one H200); also the answer for tensors
# off the GPU (the interpreter), where it only shapes the grids.
MEASURED_SMS = 132


@functools.lru_cache(maxsize=None)
def _cuda_sm_count(index: int) -> int:
    return torch.cuda.get_device_properties(index).multi_processor_count


def cuda_index(device: torch.device) -> int:
    """The index of the CUDA device `device` names; the current one's where it names none ("cuda")."""
    return device.index if device.index is not None else torch.cuda.current_device()


def sm_count(device: torch.device) -> int:
    """Streaming multiprocessors of `device`: grids sized per SM scale with the GPU (an H100 PCIe
    has 114, an A100 108, an RTX 4090 128)."""
    if device.type != "cuda":
        return MEASURED_SMS
    return _cuda_sm_count(cuda_index(device))


def compiled_on_gpu(device: torch.device) -> bool:
    """Whether Triton kernels on `device` run compiled on a CUDA GPU rather than in Triton's
    interpreter (TRITON_INTERPRET=1, the CPU tests)."""
    return device.type == "cuda" and os.environ.get("TRITON_INTERPRET") != "1"


# compute capability from which the kernels run: bf16 tensor cores (Ampere)
MIN_CAPABILITY = (8, 0)
# compute capability from which e4m3 is in hardware (cvt ... e4m3x2; Triton's float8e4nv): Ada,
# Hopper, Blackwell. The FP8 kernels and the packed-f16 MXFP4 row kernels (which decode through
# e4m3) need it.
FP8_CAPABILITY = (8, 9)


@dataclass(frozen=True)
class GpuArch:
    """What the kernels' choices depend on besides shapes, of one GPU: its compute capability
    (major, minor) and the shared memory one program may use (the opt-in maximum, bytes)."""

    capability: tuple[int, int]
    shared_memory: int

    @property
    def fp8(self) -> bool:
        return self.capability >= FP8_CAPABILITY

    @property
    def hopper(self) -> bool:
        """Hopper (9.0) and newer: the tensor-copy engine (TMA) and packed bf16 multiplies
        (mul.bf16x2), on which the TMA-fed MXFP4 row kernels and the MXFP4 tensor-core decode run."""
        return self.capability >= (9, 0)

    @property
    def mma_from_shared(self) -> bool:
        """Tensor cores that read both operands from shared memory (Hopper's wgmma, datacenter
        Blackwell): a pipelined tile then keeps every stage's operands there."""
        return self.capability[0] in (9, 10)


# The GPU the defaults were measured on (one H200; 227 KiB a program), and what the kernels
# assume off the GPU (the interpreter), where it only selects among the same code paths.
MEASURED_ARCH = GpuArch((9, 0), 232448)


# Shared memory a program may opt into, by compute capability (CUDA programming guide, "Technical
# Specifications per Compute Capability"), for when the driver cannot be asked; 99 KiB on the rest
# (8.6, 8.9, 12.0), the least of them
_SHARED_BY_CAPABILITY = {(8, 0): 166912, (8, 7): 166912, (9, 0): 232448, (10, 0): 232448}
_LEAST_SHARED = 101376


@functools.lru_cache(maxsize=None)
def _cuda_arch(index: int) -> GpuArch:
    capability = tuple(torch.cuda.get_device_capability(index))
    try:
        import triton

        shared = int(triton.runtime.driver.active.utils.get_device_properties(index)["max_shared_mem"])
    except Exception:  # noqa: BLE001 - a Triton without this query: the documented figure, else the least
        shared = _SHARED_BY_CAPABILITY.get(capability, _LEAST_SHARED)
    return GpuArch(capability, shared)


def gpu_arch(device: torch.device) -> GpuArch:
    """The GpuArch of `device`; MEASURED_ARCH for tensors off the GPU."""
    if device.type != "cuda":
        return MEASURED_ARCH
    return _cuda_arch(cuda_index(device))


def require_supported(device: torch.device) -> None:
    """Raises ValueError when `device` is a GPU the kernels cannot run on: an AMD one (they hold
    NVIDIA assembly), or one older than they need."""
    if compiled_on_gpu(device) and torch.version.hip:
        raise ValueError("the kernels are written for NVIDIA GPUs and this torch is built for AMD GPUs (ROCm); "
                         "use a CUDA build of torch on an NVIDIA GPU, or --backend with a server that runs on yours")
    if compiled_on_gpu(device) and gpu_arch(device).capability < MIN_CAPABILITY:
        major, minor = gpu_arch(device).capability
        raise ValueError(f"the kernels need an NVIDIA GPU of compute capability {MIN_CAPABILITY[0]}."
                         f"{MIN_CAPABILITY[1]} or newer (Ampere, Ada, Hopper, Blackwell); "
                         f"{torch.cuda.get_device_name(device)} is {major}.{minor}")


def require_fp8(device: torch.device) -> None:
    """Raises ValueError, saying what the GPU lacks, when FP8 kernels cannot run on `device`."""
    if compiled_on_gpu(device) and not gpu_arch(device).fp8:
        major, minor = gpu_arch(device).capability
        raise ValueError(f"FP8 weights need an NVIDIA GPU of compute capability {FP8_CAPABILITY[0]}."
                         f"{FP8_CAPABILITY[1]} or newer (Ada, Hopper, Blackwell); "
                         f"{torch.cuda.get_device_name(device)} is {major}.{minor}")
