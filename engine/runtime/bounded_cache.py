"""A thread-safe map that keeps its most recently used values within a budget."""
from __future__ import annotations

import threading
from collections import OrderedDict
from typing import Callable


class BoundedCache:
    """Values by key while size(value) over all of them adds up to at most `budget`, the least
    recently used going first; a value larger than the whole budget is not kept. kept: the
    values, oldest first; used: their total size."""

    def __init__(self, budget: int, size: Callable[[object], int] = lambda value: 1):
        self.budget, self.size = budget, size
        self.kept: OrderedDict = OrderedDict()
        self.used = 0
        self._lock = threading.Lock()

    def __len__(self) -> int:
        return len(self.kept)

    def get(self, key):
        """The value kept under `key` (now the most recently used), or None."""
        with self._lock:
            if key not in self.kept:
                return None
            self.kept.move_to_end(key)
            return self.kept[key]

    def put(self, key, value) -> None:
        size = self.size(value)
        with self._lock:
            if key in self.kept or size > self.budget:
                return
            self.kept[key] = value
            self.used += size
            while self.used > self.budget:
                self.used -= self.size(self.kept.popitem(last=False)[1])
