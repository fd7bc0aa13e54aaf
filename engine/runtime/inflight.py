"""A decode step whose tokens are still being chosen on the GPU.

Its chosen ids stay on the device, where the next step can read them as its input, and a copy
travels to pinned host memory behind them, with the log-probabilities of the rows that asked for
them; only `tokens()` waits, and only for this step, not for the one launched after it.
"""
from __future__ import annotations

import torch

from .logprobs import RowLogprobs, StepLogprobs
from .sequence import Sequence


class InFlightStep:
    """seqs: the step's rows in order; ids: [B] int64 chosen ids on the device, or None when the
    ids were chosen on the host already (`chosen_on_host`), which ends a run of steps launched
    ahead. logprobs: what the step computed for the rows that asked (None: no row asked)."""

    def __init__(self, seqs: list[Sequence], ids: torch.Tensor | None, logprobs: StepLogprobs | None = None):
        self.seqs = seqs
        self.ids = ids
        self._logprobs = logprobs
        self._known: list | None = None
        self._known_logprobs: list[RowLogprobs | None] | None = None
        self._host = self._ready = None
        if ids is not None and ids.device.type == "cuda":
            self._host = ids.to("cpu", non_blocking=True)  # pinned: the copy does not block
            if logprobs is not None:
                self._logprobs = logprobs.to_host()
            self._ready = torch.cuda.Event()
            self._ready.record()

    @classmethod
    def chosen_on_host(cls, seqs: list[Sequence], tokens: list,
                       logprobs: list[RowLogprobs | None]) -> "InFlightStep":
        """A step whose tokens are known already: ints, or an Exception for a row whose sampling
        failed; logprobs: each row's (None: it did not ask)."""
        step = cls(seqs, None)
        step._known, step._known_logprobs = tokens, logprobs
        return step

    def tokens(self) -> list:
        """The chosen ids as ints, one per row (waits for this step's copy to land)."""
        if self._known is not None:
            return self._known
        if self._ready is not None:
            self._ready.synchronize()
            return self._host.tolist()
        return self.ids.tolist()

    def logprobs(self) -> list[RowLogprobs | None]:
        """Each row's log-probabilities (None for rows that did not ask); call after `tokens()`,
        which waited for their copy."""
        if self._known_logprobs is not None:
            return self._known_logprobs
        if self._logprobs is None:
            return [None] * len(self.seqs)
        return self._logprobs.per_row(len(self.seqs))
