"""The loop the engine thread runs: takes submitted requests, schedules a step, runs it, samples
and streams its tokens, and, with captured decode graphs, launches decode steps ahead of the host
(decode_ahead). Engine (engine.py) sets up what it uses and serves the public API around it.

EngineLoop is Engine's base: it relies on the attributes Engine._setup gives it (scheduler, runner,
_inbox, decode_ahead, block_size, _fatal).
"""
from __future__ import annotations

import logging
import queue
import time

import torch

from .constrained import choose_rows
from .failures import unrecoverable
from .inflight import InFlightStep
from .logprobs import RowLogprobs, host_logprobs, token_logprobs
from .sampling import choose_tokens, sample_tokens
from .sequence import Sequence, Status

log = logging.getLogger(__name__)


class EngineLoop:
    # ---- engine thread ----------------------------------------------------------------------

    def _take_new(self) -> bool:
        """Moves submitted sequences to the scheduler; blocks while there is nothing to do.
        Returns False once shut down."""
        block = not self.scheduler.has_work()
        while True:
            try:
                seq = self._inbox.get(block=block)
            except queue.Empty:
                return True
            if seq is None:
                return False
            if callable(seq):  # work that must run on the engine thread (warmup)
                seq()
                continue
            self.scheduler.add(seq)
            block = False

    def _finish(self, seq: Sequence, reason: str, error: str | None = None) -> None:
        if seq.status is Status.FINISHED:
            return
        self.scheduler.remove(seq)  # blocks are back in the pool before the Final is seen
        seq.finish(reason, error)

    def _run(self) -> None:
        while self._take_new():
            for seq in [*self.scheduler.running, *self.scheduler.waiting]:
                if seq.stream.aborted.is_set():
                    self._finish(seq, "abort")
            try:
                plan = self.scheduler.schedule()
            except Exception as e:  # broken bookkeeping: end every request rather than spin
                log.exception("scheduling failed")
                for seq in [*self.scheduler.running, *self.scheduler.waiting]:
                    self._finish(seq, "error", f"the scheduler failed: {type(e).__name__}: {e}")
                continue
            if not plan:
                continue
            try:
                self._step(plan)
            except Exception as e:  # a failed step must not take the engine (or other chats) down
                log.exception("engine step failed")
                for seq, _ in plan:
                    self._finish(seq, "error", f"{type(e).__name__}: {e}")
                self._fatal = self._fatal or unrecoverable(e)
                if self._fatal:  # every later step would fail the same way: end them all, refuse new ones
                    for seq in [*self.scheduler.running, *self.scheduler.waiting]:
                        self._finish(seq, "error", self._fatal)
        leftovers = [*self.scheduler.running, *self.scheduler.waiting]
        while not self._inbox.empty():
            leftovers.append(self._inbox.get_nowait())
        for seq in leftovers:
            if seq is not None:
                self._finish(seq, "abort")

    def _sample(self, sampling: list[Sequence], logits: torch.Tensor) -> list[int | Exception]:
        """One token per sequence, all rows at once; if that fails, row by row so only the
        request whose settings broke it gets the error."""
        contexts = [seq.penalty_context(logits.device) for seq in sampling]
        try:
            return self._choose_on_host(sampling, logits, contexts)
        except Exception:
            out: list[int | Exception] = []
            for row, seq in enumerate(sampling):
                try:
                    out += self._choose_on_host([seq], logits[row:row + 1], [contexts[row]])
                except Exception as e:  # e.g. sampling settings that leave no token
                    log.exception("sampling failed")
                    out.append(e)
            return out

    def _choose_on_host(self, seqs: list[Sequence], logits: torch.Tensor, contexts: list) -> list[int]:
        """logits [B, V]: one token per sequence; JSON-mode rows by their constraint (constrained.py)."""
        samplers = [seq.sampler for seq in seqs]
        if all(seq.json_answer is None for seq in seqs):
            return sample_tokens(logits, samplers, contexts)
        return choose_rows(logits, samplers, contexts, [seq.json_answer for seq in seqs], sample_tokens)

    def _step(self, plan: list[tuple[Sequence, int]]) -> None:
        if self._runs_ahead(plan):
            self._decode_ahead(plan)
            return
        start, graph_steps = time.perf_counter(), self.runner.counters.graph_steps
        try:
            sampling, logits = self.runner.run(plan)
            self._stream(plan, sampling, logits)
        finally:
            if self.runner.counters.graph_steps > graph_steps:
                self.runner.counters.record_decode(len(plan), time.perf_counter() - start)

    def _stream(self, plan: list[tuple[Sequence, int]], sampling: list[Sequence], logits: torch.Tensor | None) -> None:
        done = time.perf_counter()
        self.scheduler.commit(plan)
        if not sampling:
            return
        tokens = self._sample(sampling, logits)
        logprobs = host_logprobs(logits, tokens, [seq.sampler for seq in sampling])
        for seq, token, values in zip(sampling, tokens, logprobs):
            self._emit(seq, token, done, values)

    def _emit(self, seq: Sequence, token: int | Exception, done: float, logprobs: RowLogprobs | None = None) -> None:
        if seq.clock.prefill_done is None:
            seq.clock.prefill_done = done
        if isinstance(token, Exception):
            self._finish(seq, "error", f"{type(token).__name__}: {token}")
            return
        reason = seq.append_token(token, logprobs)
        if reason is not None:
            self._finish(seq, reason)

    # ---- decode steps launched ahead ----------------------------------------------------------
    #
    # Step N+1 is launched (its inputs copied behind step N on the stream, its tokens read from
    # step N's chosen ids on the device) before the host waits for step N's tokens; the host then
    # streams step N's text while the GPU runs N+1. A sequence that step N finishes has one more
    # row in step N+1, whose result is dropped: that row writes the K/V of the sequence's real
    # last token into a slot past its registered (prefix-cached) blocks, and any later owner of
    # those blocks writes them behind it on the same stream.

    def _runs_ahead(self, plan: list[tuple[Sequence, int]]) -> bool:
        # Every running sequence must be in it: the run goes on without the scheduler. A sequence
        # whose token is chosen on the host (penalties, JSON mode) holds the batch to one step at a time.
        return (self.decode_ahead and len(plan) == len(self.scheduler.running) and self.runner.graph_ready(plan)
                and not any(seq.chooses_on_host for seq, _ in plan))

    def _decode_ahead(self, plan: list[tuple[Sequence, int]]) -> None:
        """Decode steps, each launched before the previous one's tokens are on the host, until
        something needs the scheduler (a new request, an abort, a sequence running out of
        tokens or blocks); the last launched step is always taken before returning."""
        mark, graph_steps = time.perf_counter(), self.runner.counters.graph_steps
        sampling, logits = self.runner.run(plan)
        if self.runner.counters.graph_steps == graph_steps:  # the graph failed: it ran eagerly
            self._stream(plan, sampling, logits)
            return
        step = self._choose(sampling, logits)
        while True:
            nxt = None
            ahead = self._ahead(step)
            if ahead:
                ids = step.ids
                if len(ahead) < len(step.seqs):
                    row = {seq: i for i, seq in enumerate(step.seqs)}
                    ids = ids.index_select(0, torch.tensor([row[seq] for seq in ahead]).to(ids.device, non_blocking=True))
                try:
                    logits = self.runner.run_ahead(ahead, ids)
                except Exception as e:  # e.g. a bucket that cannot be captured: decode eagerly from now on
                    log.warning("decode graph failed (%s: %s); decoding eagerly from now on", type(e).__name__, e)
                    self.runner.graphs = None
                else:
                    nxt = self._choose(ahead, logits)
            self._take(step)
            now = time.perf_counter()
            self.runner.counters.record_decode(len(step.seqs), now - mark)
            mark = now
            if nxt is None:
                return
            step = nxt

    def _choose(self, seqs: list[Sequence], logits: torch.Tensor) -> InFlightStep:
        """Queues the choice of each row's token (and the log-probabilities of the rows that asked)
        behind the step; if that fails, samples row by row on the host (the failing row gets the
        error) and no step is launched after this one."""
        samplers = [seq.sampler for seq in seqs]
        try:
            ids = choose_tokens(logits, samplers, [None] * len(seqs))
        except Exception:
            tokens = self._sample(seqs, logits)
            return InFlightStep.chosen_on_host(seqs, tokens, host_logprobs(logits, tokens, samplers))
        return InFlightStep(seqs, ids, token_logprobs(logits, ids, samplers))

    def _ahead(self, step: InFlightStep) -> list[Sequence]:
        """The sequences of `step` that go into a step launched now, after it (their blocks
        reserved), or [] when the scheduler should run first."""
        sched, graphs = self.scheduler, self.runner.graphs
        if step.ids is None or graphs is None or not self._inbox.empty():
            return []
        if any(seq.chooses_on_host for seq in step.seqs):  # e.g. a call began in the step before
            return []
        if sched.waiting and len(sched.running) < sched.max_running:
            return []
        if any(seq.stream.aborted.is_set() for seq in sched.running):
            return []
        running = [seq for seq in step.seqs if seq.status is Status.RUNNING]
        if any(-(-(len(seq.tokens) + 1) // self.block_size) > graphs.max_blocks for seq in running):
            return []
        # A sequence that `step` brings to its token limit ends there: no row after it.
        ahead = [seq for seq in running if len(seq.generated) + 1 < seq.max_tokens]
        if not ahead or not sched.reserve_ahead(ahead):
            return []
        return ahead

    def _take(self, step: InFlightStep) -> None:
        """Waits for one launched step's tokens and streams them; rows of sequences that finished
        after it was launched are dropped."""
        tokens = step.tokens()
        done = time.perf_counter()
        live = [(seq, token, values) for seq, token, values in zip(step.seqs, tokens, step.logprobs())
                if seq.status is Status.RUNNING]
        self.scheduler.commit([(seq, 1) for seq, _, _ in live])
        for seq, token, values in live:
            self._emit(seq, token, done, values)
