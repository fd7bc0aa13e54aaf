"""Programmatic dependent launch (PDL, sm_90 and later): a kernel launched with it may start
while the kernel before it in the stream is still running; it waits for that kernel's results
only where it first needs them (`pdl_wait`, griddepcontrol.wait), so its launch and its
prologue overlap the end of the kernel before. CUDA graphs keep the programmatic edge (CUDA
12.3 and later, CUDA Programming Guide "CUDA Graphs").

Rules every kernel here keeps when launched with PDL, so that the stream stays ordered:
- Before `pdl_wait` a program reads only what the host or a kernel two or more launches earlier
  wrote (expert ids, page tables, weights), and writes nothing: the caching allocator may have
  handed it memory that the kernel before is still reading.
- Every program calls `pdl_wait`, early-exiting ones included, and only then `pdl_release`, which
  lets the next kernel start. A kernel therefore starts only once every kernel before its
  predecessor has completed, which is what makes the first rule's reads safe.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from .gpu_facts import compiled_on_gpu, cuda_capability


def pdl_supported(device: torch.device) -> bool:
    """Whether kernels on `device` can be launched with PDL: compiled for a CUDA device of compute
    capability 9.0 or later (not the Triton interpreter)."""
    return compiled_on_gpu(device) and cuda_capability(device)[0] >= 9


def pdl_launch_options(pdl: bool) -> dict:
    """Launch keyword arguments for a kernel launched with PDL or not."""
    return {"launch_pdl": True} if pdl else {}


@triton.jit
def pdl_wait(PDL: tl.constexpr):
    """Wait until the kernel before has completed and its writes are visible (PDL only)."""
    if PDL:
        tl.extra.cuda.gdc_wait()


@triton.jit
def pdl_release(PDL: tl.constexpr):
    """Let the next kernel start once every program of this one has called this (PDL only)."""
    if PDL:
        tl.extra.cuda.gdc_launch_dependents()
