"""Rank 0's step runner under tensor parallelism: the engine's StepRunner, which also hands each
step's inputs to the other ranks before running the same forward on its own slices."""
from __future__ import annotations

import contextlib

import torch

from ..runtime.sequence import Sequence
from ..runtime.step_runner import StepInputs, StepRunner
from .group import WorkerFailed, WorkerGroup


class ParallelStepRunner(StepRunner):
    """Same interface as StepRunner; the logits it returns are whole (gathered over the ranks'
    vocabulary slices), so sampling stays on rank 0 unchanged."""

    fails_together = True

    def __init__(self, model, cache, device: torch.device, dtype: torch.dtype, group: WorkerGroup, graphs=None,
                 chunks=None):
        super().__init__(model, cache, device, dtype, graphs, chunks)
        self.group = group

    def run(self, plan: list[tuple[Sequence, int]]) -> tuple[list[Sequence], torch.Tensor | None]:
        self.group.check()
        with self._on_device():
            if self.graph_ready(plan):
                inputs = self.graph_inputs(plan)
                self.group.send_decode(inputs)
                logits = self._in_step(lambda: self.graphs.run(*inputs))
                self._count_graph_step(len(plan))
                return [seq for seq, _ in plan], logits
            inputs, sampling = self.prepare(plan)  # image encoding runs here, on rank 0 only
            return sampling, self.forward(inputs)

    def capture_graphs(self) -> float:
        if self.graphs is None and self.chunks is None:
            return 0.0
        self.group.check()
        self.group.send_capture()
        with self._on_device():
            return self._in_step(super().capture_graphs)

    def _in_step(self, fn):
        """Runs rank 0's part of work every rank is doing at once. A failure anywhere leaves the
        ranks out of step, so the group is finished either way (no eager fallback here)."""
        try:
            return fn()
        except Exception as e:
            if not self.group.wait_for_failure():
                self.group.fail(f"the step failed on rank 0 ({type(e).__name__}: {e})")
            raise WorkerFailed(self.group.failure) from e

    def _on_device(self):
        """The engine thread's current GPU must be rank 0's for the kernels and NCCL calls."""
        return torch.cuda.device(self.device) if self.device.type == "cuda" else contextlib.nullcontext()

    def forward(self, inputs: StepInputs) -> torch.Tensor | None:
        """Runs one step on every rank; returns rank 0's (whole) logits of inputs.last_rows."""
        self.group.check()
        self.group.send_step(inputs)
        with self._on_device():
            return self._in_step(lambda: self.execute(inputs))
