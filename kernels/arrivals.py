"""Arrival counts for kernels whose last program to finish a unit of work completes it (sums
the parts the others left in a buffer, in a fixed order), so no second launch is needed."""
from __future__ import annotations

import torch

_ARRIVALS: dict[torch.device, torch.Tensor] = {}
_RETIRED_ARRIVALS: list[torch.Tensor] = []


def arrival_counts(device: torch.device, n: int) -> torch.Tensor:
    """At least n int32 counts, zero. One buffer per device, shared by every kernel that counts
    arrivals: each launch leaves the counts it used at zero again, and launches on one device
    run one after another on its stream. A buffer outgrown is kept alive: CUDA graphs captured
    with it still point at its memory."""
    device = torch.device(device)
    counts = _ARRIVALS.get(device)
    if counts is None or counts.numel() < n:
        if counts is not None:
            _RETIRED_ARRIVALS.append(counts)
        counts = torch.zeros(max(n, 1 << 16), dtype=torch.int32, device=device)
        _ARRIVALS[device] = counts
    return counts
