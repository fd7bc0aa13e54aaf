"""Which sequences run in the next step, and how many of their tokens.

Continuous batching: every step packs one token for each decoding sequence and then prefill
chunks, all under a per-step token budget, so a long (image) prompt is prefilled a chunk at a
time while the other chats keep decoding. Waiting requests are admitted first come first served
once their first chunk fits; on admission their prompt is matched against the prefix cache.
When a running sequence needs a block and none is free, the newest request (by arrival) is
preempted: its blocks go back to the pool and it waits at the head of the queue to be
recomputed (its generated tokens are kept, so its output continues exactly where it stopped).
"""
from __future__ import annotations

import time
from collections import deque

from .block_pool import BlockPool
from .prefix_cache import match_prefix
from .sequence import Sequence, Status


class Scheduler:
    def __init__(self, pool: BlockPool, block_size: int, max_batch_tokens: int, max_running: int):
        self.pool = pool
        self.block_size = block_size
        self.max_batch_tokens = max_batch_tokens
        self.max_running = max_running
        # Admission keeps a few blocks spare so running decodes do not preempt at once.
        self.watermark = max(1, pool.num_blocks // 100)
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.preemptions = 0
        self.prefix_hit_tokens = 0

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def add(self, seq: Sequence) -> None:
        seq.status = Status.WAITING
        self.waiting.append(seq)

    def remove(self, seq: Sequence) -> None:
        """Takes a finished or aborted sequence out and returns its blocks."""
        if seq in self.running:
            self.running.remove(seq)
        elif seq in self.waiting:
            self.waiting.remove(seq)
        self._release(seq)

    def _release(self, seq: Sequence) -> None:
        self.pool.free(seq.blocks)
        seq.reset_computed()

    def _blocks_needed(self, seq: Sequence, n: int) -> int:
        return max(-(-(seq.num_computed + n) // self.block_size) - len(seq.blocks), 0)

    def _grow(self, seq: Sequence, n: int) -> None:
        seq.blocks += self.pool.allocate(self._blocks_needed(seq, n))

    def _preempt(self, seq: Sequence) -> None:
        self.running.remove(seq)
        self._release(seq)
        seq.status = Status.WAITING
        self.waiting.appendleft(seq)
        self.preemptions += 1

    def _match_prefix(self, seq: Sequence) -> None:
        """Takes the cached blocks that hold the start of seq's tokens. The last token is always
        left to compute: its logits give the next token."""
        full = (len(seq.tokens) - 1) // self.block_size
        seq.blocks = match_prefix(self.pool, seq.keys.extend(seq.tokens, full))
        seq.num_computed = len(seq.blocks) * self.block_size
        seq.num_registered = len(seq.blocks)

    def schedule(self) -> list[tuple[Sequence, int]]:
        """The next step's (sequence, new token count) pairs, in packing order."""
        budget = self.max_batch_tokens
        plan: dict[Sequence, int] = {}
        preempted_before = self.preemptions
        # Decodes first so a long prefill never stalls them; oldest first within each kind.
        for seq in sorted(self.running, key=lambda s: (s.num_pending > 1, s.seq_id)):
            if budget == 0:
                break
            if seq.status is not Status.RUNNING:
                continue  # preempted earlier in this pass
            n = min(seq.num_pending, budget)
            while self._blocks_needed(seq, n) > self.pool.num_free:
                victim = max(self.running, key=lambda s: s.seq_id)
                budget += plan.pop(victim, 0)
                self._preempt(victim)
                if victim is seq:
                    break
            if seq.status is Status.RUNNING:
                self._grow(seq, n)
                plan[seq] = n
                budget -= n
        # No admissions in a step that had to preempt: the pool is already too full.
        while (self.waiting and budget > 0 and len(self.running) < self.max_running
               and self.preemptions == preempted_before):
            seq = self.waiting[0]
            self._match_prefix(seq)
            n = min(seq.num_pending, budget)
            spare = self.watermark if self.running else 0
            if self._blocks_needed(seq, n) + spare > self.pool.num_free:
                self._release(seq)
                break
            self.waiting.popleft()
            self.prefix_hit_tokens += seq.num_computed
            if seq.clock.admitted is None:
                seq.clock.admitted = time.perf_counter()
                seq.reused_tokens = seq.num_computed
            self._grow(seq, n)
            seq.status = Status.RUNNING
            self.running.append(seq)
            plan[seq] = n
            budget -= n
        return list(plan.items())

    def commit(self, plan: list[tuple[Sequence, int]]) -> None:
        """After the step ran: the fed tokens are cached; newly full blocks join the prefix cache."""
        for seq, n in plan:
            seq.num_computed += n
            full = seq.num_computed // self.block_size
            if full > seq.num_registered:
                keys = seq.keys.extend(seq.tokens, full)
                for i in range(seq.num_registered, full):
                    self.pool.register(seq.blocks[i], keys[i])
                seq.num_registered = full
