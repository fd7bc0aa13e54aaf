"""The pool of KV-cache blocks: who holds which block, and which full blocks are remembered by
the hash of their content so later requests can reuse them (the prefix cache).

A block is in exactly one of three states:
  held     ref count > 0: in the block table of at least one running sequence;
  cached   ref count 0, content hash known: free, but its K/V can still be reused until evicted;
  plain    ref count 0, no hash: free and holding nothing worth keeping.
Allocation takes plain blocks first and then evicts cached ones, least recently used first.
"""
from __future__ import annotations

from collections import OrderedDict


class OutOfBlocks(RuntimeError):
    pass


class BlockPool:
    def __init__(self, num_blocks: int):
        if num_blocks < 1:
            raise ValueError(f"the KV cache needs at least one block, got {num_blocks}")
        self.num_blocks = num_blocks
        self.ref = [0] * num_blocks
        self.hash_of: list[bytes | None] = [None] * num_blocks
        self.block_of: dict[bytes, int] = {}
        self._plain: list[int] = list(range(num_blocks - 1, -1, -1))  # pop() hands out low ids first
        self._cached: OrderedDict[int, None] = OrderedDict()  # oldest first
        self.evictions = 0

    @property
    def num_free(self) -> int:
        """Blocks an allocation can take now (plain plus cached)."""
        return len(self._plain) + len(self._cached)

    @property
    def num_cached(self) -> int:
        return len(self._cached)

    def allocate(self, n: int) -> list[int]:
        if n > self.num_free:
            raise OutOfBlocks(f"asked for {n} KV blocks, {self.num_free} free")
        out = []
        for _ in range(n):
            if self._plain:
                b = self._plain.pop()
            else:
                b, _ = self._cached.popitem(last=False)
                del self.block_of[self.hash_of[b]]
                self.hash_of[b] = None
                self.evictions += 1
            self.ref[b] = 1
            out.append(b)
        return out

    def free(self, blocks: list[int]) -> None:
        """Drops one reference to each block. Pass a sequence's table as is: blocks are released
        last-first, so a chain's tail is evicted before the prefix it depends on."""
        for b in reversed(blocks):
            if self.ref[b] <= 0:
                raise RuntimeError(f"KV block {b} freed more often than it was taken")
            self.ref[b] -= 1
            if self.ref[b] == 0:
                if self.hash_of[b] is not None:
                    self._cached[b] = None
                else:
                    self._plain.append(b)

    def lookup(self, h: bytes) -> int | None:
        return self.block_of.get(h)

    def take_cached(self, b: int) -> None:
        """Adds a reference to a block found by `lookup` (reviving it if it was free)."""
        if self.ref[b] == 0:
            del self._cached[b]
        self.ref[b] += 1

    def register(self, b: int, h: bytes) -> bool:
        """Remembers held, full block `b` under content hash `h`. When another block already holds
        the same content (two requests computed it at once) the first one stays the cached copy."""
        if self.hash_of[b] is not None or h in self.block_of:
            return False
        self.hash_of[b] = h
        self.block_of[h] = b
        return True

    def check(self) -> None:
        """Asserts the bookkeeping is consistent (used by tests)."""
        free = set(self._plain) | set(self._cached)
        assert len(free) == len(self._plain) + len(self._cached), "a block is free twice"
        for b in range(self.num_blocks):
            assert (self.ref[b] == 0) == (b in free), f"block {b}: ref {self.ref[b]} vs free list"
            if self.hash_of[b] is not None:
                assert self.block_of[self.hash_of[b]] == b
        assert all(self.hash_of[b] is not None for b in self._cached)
