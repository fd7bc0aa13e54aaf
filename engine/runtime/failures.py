"""Which failures of an engine step leave the engine unable to serve, and what to tell the user.

After a fault on the GPU (an illegal memory access, a device-side assert, a launch failure) the
CUDA context is lost: every later call fails the same way, so going on would fail every chat with
a confusing error. A tensor-parallel worker that died takes its share of the model with it. Both
need a restart. Running out of memory, or one request's bad settings, do not: that request fails
and the others go on.
"""
from __future__ import annotations

import torch

# What torch's messages say for a lost CUDA context (the texts of CUDA's sticky errors, which every
# later call in the process returns too).
_GPU_FAULTS = ("illegal memory access", "device-side assert", "unspecified launch failure", "misaligned address",
               "illegal instruction", "CUBLAS_STATUS_EXECUTION_FAILED", "uncorrectable ECC error", "NCCL error")


def unrecoverable(error: BaseException) -> str | None:
    """Why the engine cannot go on after `error` and what to do, or None when it can."""
    from ..parallel.group import WorkerFailed

    if isinstance(error, torch.OutOfMemoryError):
        return None
    if isinstance(error, WorkerFailed):
        return f"{error}; restart localchat"
    text = str(error)
    if "out of memory" in text:
        return None
    # Only the faults that stay with the context: a bad launch (invalid argument, too many
    # resources) fails that call alone, whatever exception class carries it.
    if any(m in text for m in _GPU_FAULTS):
        first = text.strip().splitlines()[0] if text.strip() else type(error).__name__
        return (f"the GPU reported a fault the engine cannot recover from ({first}); restart localchat. "
                "If it happens again, `nvidia-smi` and the system log (dmesg: Xid errors) say more")
    return None
