"""`learned`'s referee: two sampled shadow caches and the duel between their rankings.

A `ShadowCache` sees the same accesses and releases as the real cache, but only for keys
whose hash falls in the sample (one in ``2**rate_shift``, `sampled`), and holds that
share of the real capacity, so its saved value estimates the real cache's under its
ranking (the mini-simulation of Caffeine and LHD). It ignores the prefix tree: any
released entry may go. Entries held by a request are not evictable, as in the real cache.
Every operation is O(log n).

A `ShadowDuel` runs two of them, one ranking by the learned credit (GreedyDual: the
floor, the rank of the last victim, plus the credit) and one by release order (LRU), and
every `window` sampled accesses chooses the ranking the real cache uses (``use_learned``)
and halves both scores.

Written in Cython's pure-Python mode, like `kvplug.core.dense`: compiled at install where
a C compiler is present (``COMPILED``), so that the dense core's calls into the duel cost
no Python frame, and run as plain Python otherwise. Both run the same tests and make the
same decisions: the same dict and heap of ``(rank, order, key)`` tuples, the same float
arithmetic in the same order.
"""

from __future__ import annotations

from heapq import heappop, heappush

import cython

COMPILED: bool = cython.compiled

BlockKey = bytes


def sampled(key: BlockKey, rate_shift: int) -> bool:
    """Whether `key` is in the sample of one key in 2**rate_shift. Keys are hashes, so
    their first byte is uniform (vLLM's keys with a group id end in that id instead)."""
    return key[0] & ((1 << rate_shift) - 1) == 0


@cython.final
@cython.cclass
class ShadowCache:
    """A released entry's eviction rank is ``floor + credit`` with `by_credit`
    (GreedyDual's inflation is `floor`, the rank of the last victim), else 0.0 (release
    order alone, by the order its release got); lower goes first.

    Invariants: `entries` maps each key held here to None (held by a request) or to its
    live ``(rank, order)``; every live pair is in `heap` as ``(rank, order, key)`` (stale
    triples are skipped when popped, and dropped when the heap outgrows the entries);
    once an `access` returns, more than `capacity` entries are held only while none is
    evictable (a release makes an entry evictable, but evicts nothing)."""

    capacity = cython.declare(cython.Py_ssize_t, visibility="public")
    floor = cython.declare(cython.double, visibility="public")
    saved = cython.declare(cython.double, visibility="public")  # hits' value since `decay`
    by_credit: cython.bint
    entries = cython.declare(dict, visibility="readonly")
    heap = cython.declare(list, visibility="readonly")
    order: cython.longlong

    def __init__(self, capacity: int, by_credit: bool) -> None:
        self.capacity = max(1, capacity)
        self.by_credit = by_credit
        self.floor = 0.0
        self.saved = 0.0
        self.entries = {}
        self.heap = []
        self.order = 0

    @cython.ccall
    def access(self, key: object, value: cython.double) -> cython.void:
        """A request uses `key`: a hit if it is here; either way it is now held."""
        entries: dict = self.entries
        if key in entries:
            self.saved += value
        entries[key] = None
        while len(entries) > self.capacity and self._evict_one():
            pass

    @cython.ccall
    def release(self, key: object, credit: cython.double) -> cython.void:
        """A request released `key`: if it is here, it is ranked and evictable."""
        entries: dict = self.entries
        if key not in entries:
            return
        rank: cython.double = self.floor + credit if self.by_credit else 0.0
        ranked = (rank, self.order)
        self.order += 1
        entries[key] = ranked
        heappush(self.heap, (rank, ranked[1], key))
        if len(self.heap) > 64 + 4 * len(entries):
            heap = [(r[0], r[1], k) for k, r in entries.items() if r is not None]
            heap.sort()
            self.heap = heap

    @cython.cfunc
    def _evict_one(self) -> cython.bint:
        heap: list = self.heap
        entries: dict = self.entries
        while heap:
            rank, order, key = heappop(heap)
            if entries.get(key) == (rank, order):
                del entries[key]
                if rank > self.floor:
                    self.floor = rank
                return True
        return False

    @cython.ccall
    def decay(self, factor: cython.double) -> cython.void:
        self.saved *= factor


@cython.final
@cython.cclass
class ShadowDuel:
    """`learned`'s two shadows, each with `capacity` entries, and its referee: after every
    `window` sampled accesses, the learned ranking is used (``use_learned``) while its
    shadow saved at least ``1 - margin`` times what the LRU shadow saved; then both
    scores halve. ``switches`` counts the changes of ranking."""

    learned = cython.declare(ShadowCache, visibility="readonly")
    lru = cython.declare(ShadowCache, visibility="readonly")
    window = cython.declare(cython.Py_ssize_t, visibility="public")
    margin = cython.declare(cython.double, visibility="public")
    use_learned = cython.declare(cython.bint, visibility="public")
    switches = cython.declare(cython.Py_ssize_t, visibility="public")
    accesses = cython.declare(cython.Py_ssize_t, visibility="readonly")  # sampled ones

    def __init__(self, capacity: int, window: int, margin: float) -> None:
        self.learned = ShadowCache(capacity, True)
        self.lru = ShadowCache(capacity, False)
        self.window = window
        self.margin = margin
        self.use_learned = True
        self.switches = 0
        self.accesses = 0

    def resize(self, capacity: int) -> None:
        self.learned.capacity = self.lru.capacity = max(1, capacity)

    @cython.ccall
    def access(self, key: object, value: cython.double) -> cython.void:
        """A sampled `key` worth `value` was accessed: both shadows see it, and every
        `window` sampled accesses the referee chooses the ranking."""
        self.learned.access(key, value)
        self.lru.access(key, value)
        self.accesses += 1
        if self.accesses % self.window == 0:
            self.referee()

    @cython.ccall
    def release(self, key: object, credit: cython.double) -> cython.void:
        """A sampled `key` was released with `credit`."""
        self.learned.release(key, credit)
        self.lru.release(key, 0.0)

    @cython.ccall
    def referee(self) -> cython.void:
        use_learned: cython.bint = self.learned.saved >= (1 - self.margin) * self.lru.saved
        if use_learned != self.use_learned:
            self.switches += 1
        self.use_learned = use_learned
        self.learned.decay(0.5)
        self.lru.decay(0.5)
