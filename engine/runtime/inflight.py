"""A decode step whose tokens are still being chosen on the GPU.

Its chosen ids stay on the device, where the next step can read them as its input, and a copy
travels to pinned host memory behind them; only `tokens()` waits, and only for this step, not
for the one launched after it.
"""
from __future__ import annotations

import torch

from .sequence import Sequence


class InFlightStep:
    """seqs: the step's rows in order; ids: [B] int64 chosen ids on the device, or None when the
    ids were chosen on the host already (`known`: ints, or an Exception for a row whose sampling
    failed), which ends a run of steps launched ahead."""

    def __init__(self, seqs: list[Sequence], ids: torch.Tensor | None, known: list | None = None):
        self.seqs = seqs
        self.ids = ids
        self._known = known
        self._host = self._ready = None
        if ids is not None and ids.device.type == "cuda":
            self._host = ids.to("cpu", non_blocking=True)  # pinned: the copy does not block
            self._ready = torch.cuda.Event()
            self._ready.record()

    def tokens(self) -> list:
        """The chosen ids as ints, one per row (waits for this step's copy to land)."""
        if self._known is not None:
            return self._known
        if self._ready is not None:
            self._ready.synchronize()
            return self._host.tolist()
        return self.ids.tolist()
