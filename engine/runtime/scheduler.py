"""Which sequences run in the next step, and how many of their tokens.

Continuous batching: every step packs one token for each decoding sequence and then prefill
chunks, all under a per-step token budget, so a long (image) prompt is prefilled a chunk at a
time while the other chats keep decoding; the budget of a step that carries decodes may be a
smaller one, so those chats' tokens keep their pace while a prompt read alone takes whole steps.
Waiting requests are admitted first come first served once their first chunk fits; on admission
their prompt is matched against the prefix cache.
When a running sequence needs a block and none is free, the newest request (by arrival) is
preempted: its blocks go back to the pool and it waits at the head of the queue to be
recomputed (its generated tokens are kept, so its output continues exactly where it stopped).

Sliding-window layers (a split KV cache, kv_cache.py) draw blocks from their own pool: a step
gives a sequence the same new entries in both tables, and must find them free in both pools. At
commit, every sliding block wholly before the window of the next token (position num_computed:
it sees keys num_computed - window < j) goes back to the sliding pool and its entry becomes the
placeholder block, so a sequence holds at most the blocks spanning [start - window + 1, start +
chunk) of its current chunk: ceil((window - 1 + chunk) / block_size) + 1, whatever its context.
"""
from __future__ import annotations

import time
from collections import deque

from .block_pool import BlockPool
from .kv_cache import first_window_block
from .prefix_cache import match_prefix, match_windowed_prefix
from .sequence import Sequence, Status


class Scheduler:
    """sliding_pool, window: the sliding group's pool and the window in tokens (None without a
    sliding group); its placeholder block id is sliding_pool.num_blocks (kv_cache.py).
    max_batch_tokens_while_decoding (default max_batch_tokens): the budget of a step while a
    running sequence decodes (its prompt read), so a long prompt is read in shorter chunks while
    other chats are answering, their tokens coming at the pace of those chunks, and in whole
    steps when it is alone."""

    def __init__(self, pool: BlockPool, block_size: int, max_batch_tokens: int, max_running: int,
                 sliding_pool: BlockPool | None = None, window: int | None = None,
                 max_batch_tokens_while_decoding: int | None = None):
        if (sliding_pool is None) != (window is None):
            raise ValueError("a sliding pool needs its window, and a window its pool")
        while_decoding = max_batch_tokens_while_decoding
        if while_decoding is None:
            while_decoding = max_batch_tokens
        if not 0 < while_decoding <= max_batch_tokens:
            raise ValueError(f"max_batch_tokens_while_decoding must be 1..max_batch_tokens ({max_batch_tokens}), "
                             f"got {while_decoding}")
        self.max_batch_tokens_while_decoding = while_decoding
        self.pool = pool
        self.sliding_pool = sliding_pool
        self.window = window
        self.placeholder = sliding_pool.num_blocks if sliding_pool is not None else None
        self.block_size = block_size
        self.max_batch_tokens = max_batch_tokens
        self.max_running = max_running
        # Admission keeps a few blocks spare so running decodes do not preempt at once.
        self.watermark = max(1, pool.num_blocks // 100)
        self.sliding_watermark = max(1, sliding_pool.num_blocks // 100) if sliding_pool is not None else 0
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
        if self.sliding_pool is not None:
            self.sliding_pool.free(seq.sliding_blocks[seq.sliding_start:])
        seq.reset_computed()

    def _blocks_needed(self, seq: Sequence, n: int) -> int:
        """New table entries (in each group) for feeding n more tokens."""
        return max(-(-(seq.num_computed + n) // self.block_size) - len(seq.blocks), 0)

    def _fits(self, seq: Sequence, n: int, spare: int = 0, sliding_spare: int = 0) -> bool:
        need = self._blocks_needed(seq, n)
        if need + spare > self.pool.num_free:
            return False
        return self.sliding_pool is None or need + sliding_spare <= self.sliding_pool.num_free

    def _grow(self, seq: Sequence, n: int) -> None:
        need = self._blocks_needed(seq, n)
        seq.blocks += self.pool.allocate(need)
        if self.sliding_pool is not None:
            seq.sliding_blocks += self.sliding_pool.allocate(need)

    def reserve_ahead(self, seqs: list[Sequence]) -> bool:
        """While each of `seqs` has a decode step in flight (feeding its newest token): table
        entries for the token after that one too (num_computed + 2 tokens), so the next step can
        be launched before this one's token is known. Takes free blocks only; returns False, with
        nothing taken, when there are not enough (the next schedule() may then preempt)."""
        need = sum(self._blocks_needed(seq, 2) for seq in seqs)
        if need > self.pool.num_free or (self.sliding_pool is not None and need > self.sliding_pool.num_free):
            return False
        for seq in seqs:
            self._grow(seq, 2)
        return True

    def _slide(self, seq: Sequence) -> None:
        """Releases the sliding blocks the next token's window no longer reaches."""
        end = first_window_block(seq.num_computed, self.window, self.block_size)
        if end <= seq.sliding_start:
            return
        gone = seq.sliding_blocks[seq.sliding_start:end]
        self.sliding_pool.free(gone[::-1])  # oldest first into the cached list: evicted first
        seq.sliding_blocks[seq.sliding_start:end] = [self.placeholder] * len(gone)
        seq.sliding_start = end

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
        keys = seq.keys.extend(seq.tokens, full)
        if self.sliding_pool is None:
            seq.blocks = match_prefix(self.pool, keys)
        else:
            seq.blocks, seq.sliding_blocks, seq.sliding_start = match_windowed_prefix(
                self.pool, self.sliding_pool, keys, self.block_size, self.window, self.placeholder)
        seq.num_computed = len(seq.blocks) * self.block_size
        seq.num_registered = len(seq.blocks)

    def schedule(self) -> list[tuple[Sequence, int]]:
        """The next step's (sequence, new token count) pairs, in packing order."""
        decoding = any(seq.num_computed >= seq.prompt_len for seq in self.running)  # its prompt read
        budget = self.max_batch_tokens_while_decoding if decoding else self.max_batch_tokens
        plan: dict[Sequence, int] = {}
        preempted_before = self.preemptions
        # Decodes first so a long prefill never stalls them; oldest first within each kind.
        for seq in sorted(self.running, key=lambda s: (s.num_pending > 1, s.seq_id)):
            if budget == 0:
                break
            if seq.status is not Status.RUNNING:
                continue  # preempted earlier in this pass
            n = min(seq.num_pending, budget)
            while not self._fits(seq, n):
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
            sliding_spare = self.sliding_watermark if self.running else 0
            if not self._fits(seq, n, spare, sliding_spare):
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
        """After the step ran: the fed tokens are cached; newly full blocks join the prefix cache
        (in both groups, under the same keys); sliding blocks that left the window are released."""
        for seq, n in plan:
            seq.num_computed += n
            full = seq.num_computed // self.block_size
            if full > seq.num_registered:
                keys = seq.keys.extend(seq.tokens, full)
                for i in range(seq.num_registered, full):
                    self.pool.register(seq.blocks[i], keys[i])
                    if self.sliding_pool is not None and i >= seq.sliding_start:
                        self.sliding_pool.register(seq.sliding_blocks[i], keys[i])
                seq.num_registered = full
            if self.sliding_pool is not None:
                self._slide(seq)
