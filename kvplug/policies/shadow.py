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
same decisions. A shadow keeps its entries in typed arrays by slot and its evictable ones
in an indexed binary heap of slots ordered by ``(rank, order)``, so an access or a release
allocates nothing and compares no Python objects; it evicts exactly what a heap of
``(rank, order, key)`` tuples with lazy deletion would (each release gets a new order, so
no two entries tie), which is what the duel uses as plain Python (`LazyShadowCache`, since
`heapq` is C and a heap written in Python is not).
"""

from __future__ import annotations

from array import array
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

    Each key held here has a slot (`slots`: key to slot; ``keys[slot]`` its key, None for
    a free slot); a slot whose entry is released (evictable) has a rank, an order and a
    place in the heap (``pos[slot]``; -1 while a request holds it).

    Invariants (`check_invariants`): `slots` and ``keys`` name each other and every other
    slot is free; the heap holds exactly the evictable slots, each at its ``pos``, every
    one ordered after its parent by ``(rank, order)``; once an `access` returns, more than
    `capacity` entries are held only while none is evictable (a release makes an entry
    evictable, but evicts nothing). `entries` and `heap` show the same state as a dict
    (key: None while held, else ``(rank, order)``) and as ``(rank, order, key)`` triples."""

    capacity = cython.declare(cython.Py_ssize_t, visibility="public")
    floor = cython.declare(cython.double, visibility="public")
    saved = cython.declare(cython.double, visibility="public")  # hits' value since `decay`
    by_credit: cython.bint
    slots: dict
    keys: list
    free: list
    rank: cython.double[:]
    order: cython.longlong[:]
    pos: cython.int[:]
    heap_slots: cython.int[:]
    size: cython.Py_ssize_t  # evictable entries: the heap's length
    next_order: cython.longlong

    def __init__(self, capacity: int, by_credit: bool) -> None:
        self.capacity = max(1, capacity)
        self.by_credit = by_credit
        self.floor = 0.0
        self.saved = 0.0
        self.slots = {}
        self.keys = []
        self.free = []
        self.size = 0
        self.next_order = 0
        self._allocate(16)

    @cython.ccall
    def access(self, key: object, value: cython.double) -> cython.void:
        """A request uses `key`: a hit if it is here; either way it is now held."""
        found = self.slots.get(key)
        slot: cython.int
        if found is not None:
            self.saved += value
            slot = found
            if self.pos[slot] >= 0:
                self._remove_at(self.pos[slot])
        else:
            self._new_slot(key)
        while len(self.slots) > self.capacity and self.size > 0:
            self._evict_first()

    @cython.ccall
    def release(self, key: object, credit: cython.double) -> cython.void:
        """A request released `key`: if it is here, it is ranked and evictable."""
        found = self.slots.get(key)
        if found is None:
            return
        slot: cython.int = found
        rank: cython.double = self.floor + credit if self.by_credit else 0.0
        if self.pos[slot] >= 0:
            self._remove_at(self.pos[slot])
        self.rank[slot] = rank
        self.order[slot] = self.next_order
        self.next_order += 1
        self._push(slot)

    @cython.ccall
    def decay(self, factor: cython.double) -> cython.void:
        self.saved *= factor

    @property
    def entries(self) -> dict:
        """Each key held here: None while a request holds it, else its ``(rank, order)``."""
        shown = {}
        slot: cython.Py_ssize_t
        for slot in range(len(self.keys)):
            key = self.keys[slot]
            if key is not None:
                shown[key] = None if self.pos[slot] < 0 else (self.rank[slot], self.order[slot])
        return shown

    @property
    def heap(self) -> list:
        """The evictable entries as ``(rank, order, key)`` triples, in heap order."""
        i: cython.Py_ssize_t
        triples = []
        for i in range(self.size):
            slot = self.heap_slots[i]
            triples.append((self.rank[slot], self.order[slot], self.keys[slot]))
        return triples

    def check_invariants(self) -> None:
        """Raise AssertionError if an invariant of the class doc does not hold."""
        keys = self.keys
        assert len(self.slots) + len(self.free) == len(keys)
        for key, slot in self.slots.items():
            assert keys[slot] == key, f"slot {slot}: {keys[slot]!r}, not {key!r}"
        assert all(keys[slot] is None for slot in self.free)
        evictable = {
            slot for slot in range(len(keys)) if keys[slot] is not None and self.pos[slot] >= 0
        }
        assert evictable == {self.heap_slots[i] for i in range(self.size)}
        for i in range(self.size):
            slot = self.heap_slots[i]
            assert self.pos[slot] == i, f"slot {slot} at {i}, pos {self.pos[slot]}"
            if i:
                assert not self._less(slot, self.heap_slots[(i - 1) >> 1]), f"heap at {i}"

    # -- slots -------------------------------------------------------------------------------
    @cython.cfunc
    def _allocate(self, size: cython.Py_ssize_t) -> cython.void:
        rank = array("d", [0.0]) * size
        order = array("q", [0]) * size
        pos = array("i", [-1]) * size
        heap_slots = array("i", [0]) * size
        i: cython.Py_ssize_t
        for i in range(len(self.keys)):
            rank[i] = self.rank[i]
            order[i] = self.order[i]
            pos[i] = self.pos[i]
        for i in range(self.size):
            heap_slots[i] = self.heap_slots[i]
        self.rank, self.order, self.pos, self.heap_slots = rank, order, pos, heap_slots

    @cython.cfunc
    def _new_slot(self, key: object) -> cython.void:
        slot: cython.Py_ssize_t
        if self.free:
            slot = self.free.pop()
            self.keys[slot] = key
        else:
            slot = len(self.keys)
            if slot == len(self.pos):
                self._allocate(2 * slot)
            self.keys.append(key)
        self.pos[slot] = -1
        self.slots[key] = slot

    @cython.cfunc
    def _evict_first(self) -> cython.void:
        slot: cython.int = self.heap_slots[0]
        self._remove_at(0)
        del self.slots[self.keys[slot]]
        self.keys[slot] = None
        self.free.append(slot)
        if self.rank[slot] > self.floor:
            self.floor = self.rank[slot]

    # -- the heap of evictable slots, by (rank, order) ---------------------------------------
    @cython.cfunc
    @cython.inline
    def _less(self, a: cython.int, b: cython.int) -> cython.bint:
        if self.rank[a] < self.rank[b]:
            return True
        return self.rank[a] == self.rank[b] and self.order[a] < self.order[b]

    @cython.cfunc
    def _push(self, slot: cython.int) -> cython.void:
        at: cython.Py_ssize_t = self.size
        self.size += 1
        self.heap_slots[at] = slot
        self.pos[slot] = at
        self._sift_up(at)

    @cython.cfunc
    def _remove_at(self, at: cython.Py_ssize_t) -> cython.void:
        slot: cython.int = self.heap_slots[at]
        self.pos[slot] = -1
        self.size -= 1
        if at == self.size:
            return
        last: cython.int = self.heap_slots[self.size]
        self.heap_slots[at] = last
        self.pos[last] = at
        if at > 0 and self._less(last, self.heap_slots[(at - 1) >> 1]):
            self._sift_up(at)
        else:
            self._sift_down(at)

    @cython.cfunc
    def _sift_up(self, at: cython.Py_ssize_t) -> cython.void:
        slot: cython.int = self.heap_slots[at]
        above: cython.int
        up: cython.Py_ssize_t
        while at > 0:
            up = (at - 1) >> 1
            above = self.heap_slots[up]
            if not self._less(slot, above):
                break
            self.heap_slots[at] = above
            self.pos[above] = at
            at = up
        self.heap_slots[at] = slot
        self.pos[slot] = at

    @cython.cfunc
    def _sift_down(self, at: cython.Py_ssize_t) -> cython.void:
        slot: cython.int = self.heap_slots[at]
        size: cython.Py_ssize_t = self.size
        child: cython.Py_ssize_t
        while True:
            child = 2 * at + 1
            if child >= size:
                break
            if child + 1 < size and self._less(self.heap_slots[child + 1], self.heap_slots[child]):
                child += 1
            if not self._less(self.heap_slots[child], slot):
                break
            self.heap_slots[at] = self.heap_slots[child]
            self.pos[self.heap_slots[at]] = at
            at = child
        self.heap_slots[at] = slot
        self.pos[slot] = at


class LazyShadowCache:
    """`ShadowCache`'s plain-Python form, which `ShadowDuel` uses where the module is not
    compiled: a dict of entries (key: None while held, else ``(rank, order)``) and a heap
    of ``(rank, order, key)`` triples whose stale ones are skipped when popped (`heapq`'s
    C heap beats an indexed heap written in Python). The same evictions, floor and
    savings as `ShadowCache` (a property test drives both alike)."""

    def __init__(self, capacity: int, by_credit: bool) -> None:
        self.capacity = max(1, capacity)
        self.by_credit = by_credit
        self.floor = 0.0
        self.saved = 0.0
        self.entries: dict = {}
        self.heap: list = []
        self.order = 0

    def access(self, key: object, value: float) -> None:
        """`ShadowCache.access`."""
        entries = self.entries
        if key in entries:
            self.saved += value
        entries[key] = None
        while len(entries) > self.capacity and self._evict_one():
            pass

    def release(self, key: object, credit: float) -> None:
        """`ShadowCache.release`."""
        entries = self.entries
        if key not in entries:
            return
        rank = self.floor + credit if self.by_credit else 0.0
        entries[key] = (rank, self.order)
        heappush(self.heap, (rank, self.order, key))
        self.order += 1
        if len(self.heap) > 64 + 4 * len(entries):
            heap = [(r[0], r[1], k) for k, r in entries.items() if r is not None]
            heap.sort()
            self.heap = heap

    def decay(self, factor: float) -> None:
        self.saved *= factor

    def check_invariants(self) -> None:
        """Raise AssertionError unless every ranked entry is in the heap."""
        live = {(r[0], r[1], k) for k, r in self.entries.items() if r is not None}
        assert live <= set(self.heap)

    def _evict_one(self) -> bool:
        heap, entries = self.heap, self.entries
        while heap:
            rank, order, key = heappop(heap)
            if entries.get(key) == (rank, order):
                del entries[key]
                if rank > self.floor:
                    self.floor = rank
                return True
        return False


def new_shadow(capacity: int, by_credit: bool) -> object:
    """A shadow cache: `ShadowCache` compiled, `LazyShadowCache` as plain Python."""
    if COMPILED:
        return ShadowCache(capacity, by_credit)
    return LazyShadowCache(capacity, by_credit)


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
        self.learned = new_shadow(capacity, True)
        self.lru = new_shadow(capacity, False)
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
