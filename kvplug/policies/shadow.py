"""A sampled shadow cache: what another ranking would have saved on a sample of the blocks.

It sees the same accesses and releases as the real cache, but only for keys whose hash
falls in the sample (one in `1 / rate`), and holds `rate` times the real capacity, so its
saved value estimates the real cache's under its ranking (the mini-simulation of
Caffeine and LHD). It ignores the prefix tree: any released entry may go. Entries held
by a request are not evictable, as in the real cache. Every operation is O(log n).
"""

from __future__ import annotations

from collections.abc import Callable
from heapq import heappop, heappush
from itertools import count

BlockKey = bytes


def sampled(key: BlockKey, rate_shift: int) -> bool:
    """Whether `key` is in the sample of one key in 2**rate_shift. Keys are hashes, so
    their first byte is uniform (vLLM's keys with a group id end in that id instead)."""
    return key[0] & ((1 << rate_shift) - 1) == 0


class ShadowCache:
    """`rank(credit)` turns a released entry's credit into its eviction rank: lower goes
    first. GreedyDual's inflation is `floor`, the rank of the last victim."""

    def __init__(self, capacity: int, rank: Callable[[ShadowCache, float], float]) -> None:
        self.capacity = max(1, capacity)
        self.rank = rank
        self.floor = 0.0
        self.saved = 0.0  # value of the hits since the last `decay`
        self._entries: dict[BlockKey, tuple[float, int] | None] = {}  # None: held
        self._heap: list[tuple[float, int, BlockKey]] = []
        self._order = count()

    def access(self, key: BlockKey, value: float) -> None:
        """A request uses `key`: a hit if it is here; either way it is now held."""
        if key in self._entries:
            self.saved += value
        self._entries[key] = None
        while len(self._entries) > self.capacity and self._evict_one():
            pass

    def release(self, key: BlockKey, credit: float) -> None:
        if key in self._entries:
            ranked = (self.rank(self, credit), next(self._order))
            self._entries[key] = ranked
            heappush(self._heap, (*ranked, key))
            if len(self._heap) > 64 + 4 * len(self._entries):
                self._heap = [(*r, k) for k, r in self._entries.items() if r is not None]
                self._heap.sort()

    def _evict_one(self) -> bool:
        heap, entries = self._heap, self._entries
        while heap:
            rank, order, key = heappop(heap)
            if entries.get(key) == (rank, order):
                del entries[key]
                self.floor = max(self.floor, rank)
                return True
        return False

    def decay(self, factor: float) -> None:
        self.saved *= factor
