"""A dense eviction core with `cost`'s or `learned`'s ranking: nodes are an engine's block ids.

`DenseCostCore` makes the decisions of `kvplug.core.eviction.EvictionCore` running
`kvplug.policies.cost.CostPolicy` (and `DenseLearnedCore`, running
`kvplug.policies.learned.LearnedPolicy`), victim for victim and rank for rank, for caches
whose blocks are numbered ``0 .. num_nodes - 1`` (vLLM's block ids). Where the generic core keeps
a record object per block, dicts keyed by serial and a heap of Python ints, this one keeps
typed arrays indexed by block id and an indexed binary heap of block ids ordered by
``(rank, release order)``, so that, compiled, a block event costs a few array writes and
no Python object. It is written in Cython's pure-Python mode: built as an extension where
a compiler is present (``COMPILED``), and run as plain Python otherwise. Both run the same
tests, and both make the generic core's decisions (a differential test checks it).

What `CostPolicy` learns stays on the policy object: its closed trials and reuses per
class (``_tried``, ``_reused``), its classes (``_classes``), its inflation. The core
writes them as the policy would, so ``learned()`` and ``inflation`` read the same. Its
ghost history of evicted keys is the core's own (`VictimHistory`, shared with the cache's
record of recent victims): the same entries, in the same order, as the policy's.

Per block (an *identity*: a block renews it each time it caches a new hash, `insert_chain`)
the core keeps a serial (-1: no identity), its parent and the parent's serial at link
time (a link is live while they match), how many cached blocks name it as live parent,
whether it is evictable, and what the policy reads (hits, depth, the releasing request's
``from_end``, ``request_hit``, output length and session, whether another tier holds it), its open
trial, its remembered reuses and, once released, its rank and release order (fixed point,
`kvplug.policies.entry.FRACTION_BITS` fractional bits: a restored release sits halfway to
the next whole one).

It also keeps the cache's *fresh* blocks (free, holding nothing reusable) as a list linked
through two arrays, in hand-out order (`push_fresh`, `pop_fresh`), so that an engine's free
queue needs no Python object per block either.

Invariants (`check_invariants`):

- the heap holds exactly the evictable identities with no cached children that were
  not released unranked (`release_unranked`: an engine's rules evict those), each once,
  and ``pos`` names each one's slot; only an evictable identity is unranked; every heap
  slot sorts no earlier than its parent slot by ``(rank, order)``;
- ``num_evictable`` counts the evictable identities; ``children[b]`` counts the live
  identities whose live parent is ``b``;
- the fresh list holds ``num_fresh`` blocks, none of them a live identity;
- only live identities have a protection level (`protect_n`), and ``num_protected``
  counts them.
"""

from __future__ import annotations

from array import array
from collections.abc import Iterator
from typing import Any

import cython

from kvplug.policies.entry import FRACTION_BITS, rank_key

COMPILED: bool = cython.compiled
# a release order in fixed point (`kvplug.policies.entry`): one whole release, and the
# fraction's bits, as C constants when compiled
_ONE = cython.declare(cython.longlong, 1 << FRACTION_BITS)
_FRACTION = cython.declare(cython.longlong, (1 << FRACTION_BITS) - 1)


_GHOST = cython.declare(cython.char, 1)
_RECENT = cython.declare(cython.char, 2)


@cython.final
@cython.cclass
class VictimHistory:
    """A cache's recent victims' keys as two records kept over one ring, in the order
    their identities ended: the *ghosts* (a victim whose reuse trial was open, with its
    reuses and class code packed in an int: `CostPolicy`'s ghost history, the latest
    `ghost_capacity`) and the *recent* victims (the latest `recent_capacity`, whose
    re-cache counts as churn). Each record keeps exactly what an `OrderedDict` of its own
    would (a key filed again keeps its place; trimming drops the oldest; taking a key
    back removes it), but a victim filed into both at once is one entry, so it costs one
    index insert and, once it has left both records, one delete (two `OrderedDict`s cost
    four dict operations and two linked nodes). A key filed into a record it is not in
    while the other record holds it gets an entry of its own at the tail, as that
    record's `OrderedDict` would append it.

    The ring holds absolute positions at slot ``position & mask``: each filed key, its
    hash, its ghost value and its flags (which records hold it; none: dead, its key
    dropped). The ring grows or is compacted, never overwritten, when it fills. The
    index finds a key's position: an open-addressing table of (hash, position) pairs,
    linear probing, deletion by backward shift, at most half full; a hash match is
    confirmed against the ring's key, so a lookup is exact. It keeps the hashes in C
    arrays: a filing, a lookup or a deletion reads no key object but the one looked up
    (a dict of the keys read each entry's key while it probed and deleted). The index is
    sized by the entries filed, not by the ring (it doubles when it would pass half
    full), and the ring by its live entries (it doubles when more than half its slots are
    live at a compaction): a cache of many blocks keeps each lookup's random reads within
    a table a quarter of the size a ring-sized index would be.

    Invariants (`check`): the index holds exactly the positions of the slots with flags,
    each under its key's hash; a key has at most one entry per record (flag); every
    position below ``ghost_head`` (``recent_head``)
    holds no ghost (recent) flag; ``num_ghosts`` and ``num_recent`` count the flags and
    stay within their capacities once a filing call returns.

    With `recent_shift` the recent record keeps a sample of the victims: only keys whose
    hash is a multiple of ``2**recent_shift`` are filed there or found there (a cache
    counts each one found as that many; `recent_sampling` sizes it).

    As a mapping it is the recent record (what a pool's ``_evicted`` record of recent
    victims answers: ``history[key] = None``, ``pop``, ``len``, ``popitem``)."""

    keys: list
    hashes: cython.longlong[:]
    flags: cython.char[:]
    values: cython.longlong[:]
    index: cython.longlong[:]  # (hash, position) pairs; position -1: empty
    index_mask: cython.Py_ssize_t  # pairs in the index, less one
    num_filed: cython.Py_ssize_t
    mask: cython.Py_ssize_t
    tail: cython.longlong
    ghost_head: cython.longlong
    recent_head: cython.longlong
    num_ghosts = cython.declare(cython.Py_ssize_t, visibility="readonly")
    num_recent = cython.declare(cython.Py_ssize_t, visibility="readonly")
    ghost_capacity = cython.declare(cython.Py_ssize_t, visibility="readonly")
    recent_capacity = cython.declare(cython.Py_ssize_t, visibility="readonly")
    recent_shift = cython.declare(cython.int, visibility="readonly")
    recent_mask: cython.longlong

    def __init__(self, ghost_capacity: int, recent_capacity: int, recent_shift: int = 0) -> None:
        self.ghost_capacity = ghost_capacity
        self.recent_capacity = recent_capacity
        self.recent_shift = recent_shift
        self.recent_mask = (1 << recent_shift) - 1
        self.num_filed = 0
        self.tail = 0
        self.ghost_head = 0
        self.recent_head = 0
        self.num_ghosts = 0
        self.num_recent = 0
        self._allocate(64)
        self._allocate_index(64)

    # -- what a cache reports -------------------------------------------------------------
    @cython.ccall
    def file(self, key: object, ghost: cython.longlong, recent: cython.bint) -> cython.void:
        """A victim's `key`: a ghost with value `ghost` (reuses << 10 | class code; -1:
        none), and with `recent` a recent victim's (if that record keeps any), whose
        oldest beyond capacity leave. The caller trims the ghosts
        (`drop_oldest_ghost`), closing the dropped trials. A key outside the recent
        record's sample is filed as a ghost only."""
        flags: cython.char = 0
        if ghost >= 0:
            flags = _GHOST
        hashed: cython.longlong = hash(key)  # (a key's hash is kept on the key)
        if recent and self.recent_capacity > 0 and not hashed & self.recent_mask:
            flags |= _RECENT
        if not flags:
            return
        slot: cython.Py_ssize_t = self._file(key, hashed, flags)
        if slot >= 0:
            self.values[slot] = ghost
        while self.num_recent > self.recent_capacity:
            self._drop_oldest_recent()

    @cython.ccall
    def take_ghost(self, key: object) -> cython.longlong:
        """`key` is cached again: its ghost's value, which leaves (-1: it had none)."""
        position: cython.longlong = self._find(key, hash(key), _GHOST)
        if position < 0:
            return -1
        slot: cython.Py_ssize_t = position & self.mask
        self.num_ghosts -= 1
        self._unflag(position, _GHOST)
        return self.values[slot]

    @cython.ccall
    def take_recent(self, key: object) -> cython.bint:
        """`key` is cached again: whether it was a recent victim's (then it leaves); a
        key outside the record's sample never was."""
        hashed: cython.longlong = hash(key)
        if hashed & self.recent_mask:
            return False
        position: cython.longlong = self._find(key, hashed, _RECENT)
        if position < 0:
            return False
        self.num_recent -= 1
        self._unflag(position, _RECENT)
        return True

    @cython.ccall
    def drop_oldest_ghost(self) -> cython.longlong:
        """The oldest ghost leaves; its value."""
        if not self.num_ghosts:
            raise KeyError("no ghost to drop")
        while not self.flags[self.ghost_head & self.mask] & _GHOST:
            self.ghost_head += 1
        position: cython.longlong = self.ghost_head
        self.ghost_head += 1
        self.num_ghosts -= 1
        self._unflag(position, _GHOST)
        return self.values[position & self.mask]

    @cython.ccall
    def drop_oldest_recent(self) -> object:
        """The oldest recent victim's key leaves; the key."""
        if not self.num_recent:
            raise KeyError("no recent victim to drop")
        key = self.keys[self._oldest_recent() & self.mask]
        self._drop_oldest_recent()
        return key

    # -- the mapping a pool's record of recent victims answers -----------------------------
    def __setitem__(self, key: object, value: object) -> None:
        self.file(key, -1, True)

    def file_recent(self, objects: list, name: str) -> None:
        """``self[key] = None`` for the key (attribute `name`) of each of `objects`, in
        order: a run of victims noted as recent in one pass."""
        for item in objects:
            self.file(getattr(item, name), -1, True)

    def pop(self, key: object, default: object = None) -> object:
        """None if `key` was a recent victim's (it leaves), else `default`: `dict.pop`
        for a record whose values are None."""
        return None if self.take_recent(key) else default

    def popitem(self, last: bool = True) -> tuple:
        if last or not self.num_recent:
            raise KeyError("VictimHistory pops only its oldest recent victim (last=False)")
        return (self.drop_oldest_recent(), None)

    def __len__(self) -> int:
        return self.num_recent

    def __iter__(self) -> Iterator[Any]:
        return iter(self.recent_keys())

    def __contains__(self, key: object) -> bool:
        hashed: cython.longlong = hash(key)
        return not hashed & self.recent_mask and self._find(key, hashed, _RECENT) >= 0

    # -- views ----------------------------------------------------------------------------
    @property
    def weight(self) -> int:
        """The victims a key found in the recent record stands for: ``2**recent_shift``."""
        return self.recent_mask + 1

    @property
    def footprint(self) -> tuple[int, int]:
        """(ring slots, index pairs): what it holds memory for. Each is at most four
        times the most entries it has held (and at least 64)."""
        return (self.mask + 1, self.index_mask + 1)

    def ghost_items(self) -> list[tuple[Any, int]]:
        """The ghosts, oldest first, as (key, value): an `OrderedDict`'s ``items()``."""
        return [
            (self.keys[p & self.mask], self.values[p & self.mask])
            for p in range(self.ghost_head, self.tail)
            if self.flags[p & self.mask] & _GHOST
        ]

    def recent_keys(self) -> list[Any]:
        """The recent victims' keys, oldest first."""
        return [
            self.keys[p & self.mask]
            for p in range(self.recent_head, self.tail)
            if self.flags[p & self.mask] & _RECENT
        ]

    def check(self) -> None:
        """Raise AssertionError if an invariant of the class doc does not hold."""
        size = self.mask + 1
        low = min(self.ghost_head, self.recent_head)
        assert self.tail - low <= size, "ring span"
        ghosts = recent = 0
        filed = {}
        for p in range(low, self.tail):
            slot = p & self.mask
            flags = self.flags[slot]
            for flag in (_GHOST, _RECENT):
                if flags & flag:
                    assert (self.keys[slot], flag) not in filed, "a key twice in a record"
                    filed[(self.keys[slot], flag)] = p
            if flags & _GHOST:
                assert p >= self.ghost_head, "a ghost below its head"
                ghosts += 1
            if flags & _RECENT:
                assert p >= self.recent_head, "a recent victim below its head"
                assert not hash(self.keys[slot]) & self.recent_mask, "a recent key unsampled"
                recent += 1
        assert len(set(filed.values())) == self.num_filed, "filed entries"
        for (key, flag), p in filed.items():
            assert self._find(key, hash(key), flag) == p, "a filed key the index misses"
            assert self.hashes[p & self.mask] == hash(key), "a stale hash"
        occupied = [i for i in range(self.index_mask + 1) if self.index[2 * i + 1] >= 0]
        assert len(occupied) == self.num_filed, "index entries"
        assert 2 * self.num_filed <= self.index_mask + 1, "the index over half full"
        assert ghosts == self.num_ghosts <= max(self.ghost_capacity, 0), "ghost count"
        assert recent == self.num_recent <= max(self.recent_capacity, 0), "recent count"

    # -- internals ------------------------------------------------------------------------
    @cython.cfunc
    def _file(self, key: object, hashed: cython.longlong, flags: cython.char) -> cython.Py_ssize_t:
        """`key` (whose hash is `hashed`) in the records of `flags` (a record holding it
        already keeps its place); the slot of its ghost (-1: none)."""
        if self.tail - min(self.ghost_head, self.recent_head) > self.mask:
            self._make_room()
        ghost: cython.longlong = -1
        new: cython.char = flags
        if self.num_filed:
            if flags & _GHOST:
                ghost = self._find(key, hashed, _GHOST)
                if ghost >= 0:
                    new &= ~_GHOST
            if flags & _RECENT and self._find(key, hashed, _RECENT) >= 0:
                new &= ~_RECENT
        if new:  # an entry at the tail for the records the key is not in
            if 2 * (self.num_filed + 1) > self.index_mask + 1:
                self._allocate_index(2 * (self.index_mask + 1))
                self._reindex()
            position: cython.longlong = self.tail
            slot: cython.Py_ssize_t = position & self.mask
            self.keys[slot] = key
            self.hashes[slot] = hashed
            self.flags[slot] = new
            self.tail += 1
            self._index_insert(hashed, position)
            self.num_filed += 1
            if new & _GHOST:
                self.num_ghosts += 1
                ghost = position
            if new & _RECENT:
                self.num_recent += 1
        return ghost & self.mask if ghost >= 0 else -1

    @cython.cfunc
    def _oldest_recent(self) -> cython.longlong:
        """The oldest recent victim's position (there is one); the head moves to it."""
        while not self.flags[self.recent_head & self.mask] & _RECENT:
            self.recent_head += 1
        return self.recent_head

    @cython.cfunc
    def _drop_oldest_recent(self) -> cython.void:
        position: cython.longlong = self._oldest_recent()
        self.recent_head += 1
        self.num_recent -= 1
        self._unflag(position, _RECENT)

    @cython.cfunc
    def _unflag(self, position: cython.longlong, flag: cython.char) -> cython.void:
        slot: cython.Py_ssize_t = position & self.mask
        self.flags[slot] &= ~flag
        if not self.flags[slot]:
            self._index_delete(self.hashes[slot], position)
            self.num_filed -= 1
            self.keys[slot] = None
        if not self.num_ghosts:
            self.ghost_head = self.tail
        if not self.num_recent:
            self.recent_head = self.tail

    @cython.cfunc
    def _make_room(self) -> cython.void:
        """The ring is full. With more than half of its slots live, the live slots
        move to a ring twice as large, each at its own position (the index, which holds
        positions, stays as it is); else they are refiled in order from the tail on (new
        positions), in a ring as large, and the index is rebuilt. Either leaves at least
        half the ring free, so a filing moves at most one entry, amortized."""
        size: cython.Py_ssize_t = self.mask + 1
        low: cython.longlong = min(self.ghost_head, self.recent_head)
        p: cython.longlong
        slot: cython.Py_ssize_t
        live: cython.Py_ssize_t = 0
        for p in range(low, self.tail):
            if self.flags[p & self.mask]:
                live += 1
        keys: list = self.keys
        hashes: cython.longlong[:] = self.hashes
        flags: cython.char[:] = self.flags
        values: cython.longlong[:] = self.values
        mask: cython.Py_ssize_t = self.mask
        grow: cython.bint = 2 * live > size
        self._allocate(2 * size if grow else size)
        at: cython.longlong = self.tail
        if not grow:
            self.ghost_head = self.recent_head = -1
            self._allocate_index(self.index_mask + 1)
        for p in range(low, self.tail):
            slot = p & mask
            if not flags[slot]:
                continue
            if grow:
                at = p
            self.keys[at & self.mask] = keys[slot]
            self.hashes[at & self.mask] = hashes[slot]
            self.flags[at & self.mask] = flags[slot]
            self.values[at & self.mask] = values[slot]
            if not grow:
                self._index_insert(hashes[slot], at)
                if flags[slot] & _GHOST and self.ghost_head < 0:
                    self.ghost_head = at
                if flags[slot] & _RECENT and self.recent_head < 0:
                    self.recent_head = at
                at += 1
        if grow:
            return
        self.tail = at
        if self.ghost_head < 0:
            self.ghost_head = at
        if self.recent_head < 0:
            self.recent_head = at

    @cython.cfunc
    def _allocate(self, size: cython.Py_ssize_t) -> cython.void:
        """An empty ring of `size` slots (a power of two); the index is left as it is."""
        self.keys = [None] * size
        self.hashes = array("q", [0]) * size
        self.flags = array("b", [0]) * size
        self.values = array("q", [0]) * size
        self.mask = size - 1

    @cython.cfunc
    def _allocate_index(self, pairs: cython.Py_ssize_t) -> cython.void:
        """An empty index of `pairs` (hash, position) pairs (a power of two)."""
        self.index = array("q", [0, -1]) * pairs
        self.index_mask = pairs - 1

    @cython.cfunc
    def _reindex(self) -> cython.void:
        """File every live slot's position in the (empty) index."""
        p: cython.longlong
        for p in range(min(self.ghost_head, self.recent_head), self.tail):
            if self.flags[p & self.mask]:
                self._index_insert(self.hashes[p & self.mask], p)

    @cython.cfunc
    @cython.boundscheck(False)
    @cython.wraparound(False)
    def _find(self, key: object, hashed: cython.longlong, flag: cython.char) -> cython.longlong:
        """The position of `key`'s entry in the record of `flag` (-1: none)."""
        index: cython.longlong[:] = self.index
        i: cython.Py_ssize_t = hashed & self.index_mask
        position: cython.longlong
        while True:
            position = index[2 * i + 1]
            if position < 0:
                return -1
            if index[2 * i] == hashed and self.flags[position & self.mask] & flag:
                found = self.keys[position & self.mask]
                if found is key or found == key:
                    return position
            i = (i + 1) & self.index_mask

    @cython.cfunc
    @cython.boundscheck(False)
    @cython.wraparound(False)
    def _index_insert(self, hashed: cython.longlong, position: cython.longlong) -> cython.void:
        index: cython.longlong[:] = self.index
        i: cython.Py_ssize_t = hashed & self.index_mask
        while index[2 * i + 1] >= 0:
            i = (i + 1) & self.index_mask
        index[2 * i] = hashed
        index[2 * i + 1] = position

    @cython.cfunc
    @cython.boundscheck(False)
    @cython.wraparound(False)
    def _index_delete(self, hashed: cython.longlong, position: cython.longlong) -> cython.void:
        """Remove the entry of `position`, filed under `hashed`, shifting back the entries
        after it in its probe run that may move (linear probing's deletion)."""
        index: cython.longlong[:] = self.index
        mask: cython.Py_ssize_t = self.index_mask
        i: cython.Py_ssize_t = hashed & mask
        while index[2 * i + 1] != position:
            i = (i + 1) & mask
        j: cython.Py_ssize_t = i
        home: cython.Py_ssize_t
        while True:
            j = (j + 1) & mask
            if index[2 * j + 1] < 0:
                break
            home = index[2 * j] & mask
            # the entry at j may fill the hole at i unless its home lies in (i, j]
            if (i <= j and (home <= i or home > j)) or (i > j and home <= i and home > j):
                index[2 * i] = index[2 * j]
                index[2 * i + 1] = index[2 * j + 1]
                i = j
        index[2 * i + 1] = -1


# the fewest victims a sampled record of recent victims keeps (`recent_sampling`)
RECENT_SAMPLE_FLOOR = 1024


def recent_sampling(victims: int) -> tuple[int, int]:
    """``(recent_capacity, recent_shift)`` of a `VictimHistory` recording the latest
    `victims` victims as a sample of one key in ``2**recent_shift``: the largest power of
    two that leaves at least `RECENT_SAMPLE_FLOOR` of them (every key below twice that).
    A churn count from it is an estimate (each key found counts ``2**recent_shift``);
    filing and looking up a key outside the sample reads only its hash."""
    shift = max(0, (victims // RECENT_SAMPLE_FLOOR).bit_length() - 1)
    return (victims >> shift, shift)


_RankBits = cython.union(rank=cython.double, bits=cython.ulonglong)


@cython.cfunc
def _rank_key(rank: cython.double) -> object:
    """`kvplug.policies.entry.rank_key`, compiled: the bits of `rank` read in place."""
    if not cython.compiled:
        return rank_key(rank)
    both = cython.declare(_RankBits)
    both.rank = rank + 0.0  # (-0.0 as 0.0, as `rank_key` does)
    if both.bits >> 63:
        return ~both.bits
    return both.bits | (cython.cast(cython.ulonglong, 1) << 63)


@cython.cclass
class DenseCostCore:
    """`EvictionCore` with `CostPolicy`'s ranking over blocks ``0 .. num_nodes - 1``
    (see the module doc). `keys` is the cache's list of each block's key (its hash), read
    when a block's key goes to the ghost history or comes back from it, and cleared when
    `pop_victims` evicts it. With `objects` (the cache's block objects, by id),
    `pop_victims` returns those instead of ids. Its `history` (`VictimHistory`) keeps
    the policy's ghost history and, with `recent_capacity`, the cache's record of its
    latest victims (churn: `record_objects` counts a key back from it). The cache's
    objects carry their id as ``block_id``, their current key as `key_attribute` and the
    tokens it covers as `tokens_attribute` (`record_objects`, `release_objects`,
    `prepend_objects`, `push_fresh`)."""

    serial: cython.longlong[:]
    parent: cython.int[:]
    parent_serial: cython.longlong[:]
    children: cython.int[:]
    evictable: cython.char[:]
    hits: cython.int[:]
    depth: cython.int[:]
    from_end: cython.int[:]
    request_hit: cython.char[:]
    request_output: cython.longlong[:]
    request_session: cython.char[:]
    held: cython.char[:]
    trial: cython.short[:]
    credit: cython.int[:]
    ranked: cython.char[:]
    unranked: cython.char[:]  # evictable, but not the policy's (`release_unranked`)
    anchored: cython.char[:]  # a mark an engine's rules set per identity (`anchor_blocks`)
    rank: cython.double[:]
    order: cython.longlong[:]
    protection: cython.int[:]  # a waiting request's claim (`protect_n`); 0: none
    num_protected = cython.declare(cython.Py_ssize_t, visibility="readonly")
    since: cython.longlong[:]  # when it last became evictable, in evictions' count
    # blocks holding no key and no holder, a list in hand-out order (`push_fresh`)
    fresh_next: cython.int[:]
    fresh_prev: cython.int[:]
    in_fresh: cython.char[:]
    fresh_head: cython.int
    fresh_tail: cython.int
    num_fresh = cython.declare(cython.Py_ssize_t, visibility="readonly")
    # an engine's rules' evicted-first queue, a ring: (node, its serial, copy) entries
    lane_node: cython.int[:]
    lane_serial: cython.longlong[:]
    lane_copy: cython.char[:]
    lane_head: cython.Py_ssize_t
    lane_mask: cython.Py_ssize_t
    lane_size = cython.declare(cython.Py_ssize_t, visibility="readonly")
    last_victims = cython.declare(cython.Py_ssize_t, visibility="readonly")  # `take_n`'s
    heap: cython.int[:]
    pos: cython.int[:]
    tried: cython.longlong[:]
    reused: cython.longlong[:]
    probability: cython.double[:]
    known: cython.char[:]  # probability[code] is current
    named: cython.char[:]  # classes[code] is set
    size: cython.int
    num_evictable = cython.declare(cython.Py_ssize_t, visibility="readonly")
    next_serial: cython.longlong
    releases: cython.longlong
    entered: cython.longlong
    inflation: cython.double
    chosen_serial: cython.longlong
    weight: cython.double
    prices_tiers: cython.bint
    tiers_seen: cython.bint
    reload: cython.double
    history = cython.declare(VictimHistory, visibility="readonly")
    policy: object
    keys: list
    objects: object
    key_attribute: str
    tokens_attribute: str
    by_depth: list
    classes: dict

    def __init__(
        self,
        policy: Any,
        num_nodes: int,
        keys: list,
        objects: list | None = None,
        recent_capacity: int = 0,
        key_attribute: str = "key",
        tokens_attribute: str = "key_tokens",
    ) -> None:
        n = num_nodes
        self.policy = policy
        self.keys = keys
        self.objects = objects
        self.key_attribute = key_attribute
        self.tokens_attribute = tokens_attribute
        self.serial = array("q", [-1]) * n
        self.parent = array("i", [-1]) * n
        self.parent_serial = array("q", [-1]) * n
        self.children = array("i", [0]) * n
        self.evictable = array("b", [0]) * n
        self.hits = array("i", [0]) * n
        self.depth = array("i", [0]) * n
        self.from_end = array("i", [0]) * n
        self.request_hit = array("b", [0]) * n
        self.request_output = array("q", [0]) * n
        self.request_session = array("b", [0]) * n
        self.held = array("b", [0]) * n
        self.trial = array("h", [-1]) * n
        self.credit = array("i", [0]) * n
        self.ranked = array("b", [0]) * n
        self.unranked = array("b", [0]) * n
        self.anchored = array("b", [0]) * n
        self.rank = array("d", [0.0]) * n
        self.order = array("q", [0]) * n
        self.protection = array("i", [0]) * n
        self.num_protected = 0
        self.since = array("q", [0]) * n
        self.fresh_next = array("i", [-1]) * n
        self.fresh_prev = array("i", [-1]) * n
        self.in_fresh = array("b", [0]) * n
        self.fresh_head = -1
        self.fresh_tail = -1
        self.lane_node = array("i", [0]) * 64
        self.lane_serial = array("q", [0]) * 64
        self.lane_copy = array("b", [0]) * 64
        self.lane_head = 0
        self.lane_mask = 63
        self.lane_size = 0
        self.num_fresh = 0
        self.last_victims = 0
        self.entered = 0
        self.heap = array("i", [0]) * max(n, 1)
        self.pos = array("i", [-1]) * n
        # the policy's own tallies, as typed arrays it keeps reading (`reuse_probability`)
        policy._tried = array("q", policy._tried)
        policy._reused = array("q", policy._reused)
        self.tried = policy._tried
        self.reused = policy._reused
        self.probability = array("d", [0.0]) * 1024
        self.known = array("b", [0]) * 1024
        self.named = array("b", [0]) * 1024
        self.size = 0
        self.num_evictable = 0
        self.next_serial = 0
        self.releases = 0
        self.inflation = policy.inflation
        self.chosen_serial = -1
        self.weight = policy.frequency_weight
        self.prices_tiers = policy.prices_tiers
        self.tiers_seen = False
        self.reload = 0.0
        self.history = VictimHistory(policy._ghost_capacity, *recent_sampling(recent_capacity))
        self.by_depth = policy.value.by_depth
        self.classes = policy._classes

    # -- what the cache reports ----------------------------------------------------------
    @cython.boundscheck(False)
    @cython.wraparound(False)
    def insert_chain(
        self, nodes: list, depths: list, parent: cython.int, loose: cython.bint = False
    ) -> None:
        """Each of `nodes` (block ids) cached under a new identity at its depth (`depths`,
        parallel), each below the one before it and the first below `parent` (-1: none);
        with `loose`, each below none (a group whose blocks need no blocks before them).
        A key back from the ghost history closes its trial as reused and gives the block
        its reuses back."""
        self._insert_chain(nodes, depths, parent, loose)

    @cython.cfunc
    @cython.boundscheck(False)
    @cython.wraparound(False)
    def _insert_chain(
        self, nodes: list, depths: list, parent: cython.int, loose: cython.bint
    ) -> cython.void:
        n: cython.Py_ssize_t = len(nodes)
        if n == 0:
            return
        serial: cython.longlong[:] = self.serial
        children: cython.int[:] = self.children
        if loose:
            parent = -1
        if parent >= 0:
            children[parent] += 1
            if children[parent] == 1 and self.evictable[parent]:
                self._discard(parent)
        above: cython.int = parent
        history: VictimHistory = self.history
        keys: list = self.keys
        node: cython.int
        i: cython.Py_ssize_t
        ghost: cython.longlong
        for i in range(n):
            node = nodes[i]
            serial[node] = self.next_serial
            self.next_serial += 1
            self.parent[node] = above
            self.parent_serial[node] = -1 if above < 0 else serial[above]
            children[node] = 0 if loose or i == n - 1 else 1
            self.evictable[node] = 0
            self.unranked[node] = 0
            self.depth[node] = depths[i]
            self.hits[node] = 0
            self.from_end[node] = 0
            self.request_hit[node] = 0
            self.request_output[node] = 0
            self.request_session[node] = 0
            self.held[node] = 0
            self.trial[node] = -1
            self.credit[node] = 0
            self.ranked[node] = 0
            self.anchored[node] = 0
            if self.protection[node]:  # the block's former identity's claim
                self.protection[node] = 0
                self.num_protected -= 1
            if not loose:
                above = node
        if history.num_ghosts:
            for i in range(n):
                node = nodes[i]
                ghost = history.take_ghost(keys[node])
                if ghost >= 0:
                    self._close(ghost & 1023, True)
                    self.credit[node] = (ghost >> 10) + 1
        self._inserted(nodes)

    @cython.cfunc
    def _inserted(self, nodes: list) -> cython.void:
        """After `insert_chain`: a subclass's hook."""

    @cython.cfunc
    def _was_hit(self, node: cython.int) -> cython.void:
        """After each hit of `hit_n`: a subclass's hook."""

    @cython.cfunc
    def _releasing(self) -> cython.void:
        """Before `release_n` ranks its nodes: a subclass's hook."""

    @cython.cfunc
    def _released(self) -> cython.void:
        """After `release_n` ranked its nodes: a subclass's hook."""

    @cython.boundscheck(False)
    @cython.wraparound(False)
    def release_n(
        self,
        nodes: list,
        from_ends: object,
        request_hit: cython.bint,
        output: cython.longlong,
        session: cython.bint = False,
    ) -> None:
        """Nothing holds `nodes` any more (one request's blocks, freed together): each is
        ranked and, if it has no cached children, offered. With `from_ends` (a list
        parallel to `nodes`), each learns its releasing request first: its ``from_end``,
        `request_hit`, `output` tokens and whether it named a `session`; with None, it
        keeps what it knew."""
        if from_ends is not None:
            self.note_release(nodes, from_ends, request_hit, output, session)
        self._offer(nodes)

    @cython.boundscheck(False)
    @cython.wraparound(False)
    @cython.boundscheck(False)
    @cython.wraparound(False)
    def record_objects(
        self,
        objects: list,
        start: cython.Py_ssize_t,
        end: cython.Py_ssize_t,
        parent: cython.int,
        block_size: cython.int,
        loose: cython.bint = False,
    ) -> tuple:
        """A request's newly keyed objects ``objects[start:end]`` given identities, each
        below the one before it (the first below `parent`; one holding no key breaks the
        chain), a run at a time (`insert_chain`), at the depth its key's token count
        (`tokens_attribute`; none: a whole block of `block_size`) puts it. Each key is
        noted in the cache's keys, and counted as churn if it was a recent victim's (it
        leaves the history's recent record; each counts the record's `weight`). Stops
        before the first object whose block already has a key the cache accounts for,
        which the cache records itself. Returns
        (where it stopped, the parent there, identities made, churn). With `loose`, none
        is below another (`insert_chain`)."""
        keys: list = self.keys
        history: VictimHistory = self.history
        name = self.key_attribute
        tokens_name = self.tokens_attribute
        run: list = []
        depths: list = []
        recorded: cython.Py_ssize_t = 0
        churn: cython.Py_ssize_t = 0
        weight: cython.Py_ssize_t = history.weight
        i: cython.Py_ssize_t
        node: cython.int
        depth: cython.int
        for i in range(start, end):
            item = objects[i]
            key = getattr(item, name)
            if key is None:
                if run:
                    self._insert_chain(run, depths, parent, loose)
                    run, depths = [], []
                parent = -1
                continue
            node = item.block_id
            if keys[node] is not None:
                if run:
                    self._insert_chain(run, depths, parent, loose)
                    parent = run[len(run) - 1]
                return (i, parent, recorded, churn)
            if history.num_recent and history.take_recent(key):
                churn += weight
            keys[node] = key
            tokens = getattr(item, tokens_name)
            depth = (block_size if tokens is None or tokens == 0 else tokens) // block_size - 1
            depths.append(depth if depth > 0 else 0)
            run.append(node)
            recorded += 1
        if run:
            self._insert_chain(run, depths, parent, loose)
        return (end, parent, recorded, churn)

    def release_objects(
        self,
        objects: list,
        request_hit: cython.bint,
        output: cython.longlong,
        session: cython.bint = False,
    ) -> list:
        """`release_n` for a request's freed objects (with ``block_id`` and the key
        attribute `key_attribute`, the first to be evicted first), in one pass: one
        holding no key joins the fresh list's end (`push_fresh`); one holding the key the
        cache accounts for for its block is released with its position in `objects` as
        its ``from_end``. The first holding another key, and every object after it, are
        returned as ``(position, object)`` for the cache to handle in order, after these.
        """
        nodes: list = []
        odd: list = self._collect(objects, request_hit, output, session, nodes)
        if nodes:
            self._offer(nodes)
        return odd

    def collect_objects(
        self,
        objects: list,
        request_hit: cython.bint,
        output: cython.longlong,
        session: cython.bint = False,
    ) -> tuple:
        """`release_objects` without the release: the block ids it would release (each
        having learned its releasing request, as `note_release` does), and the objects it
        would return, for an engine's rules to release them (`release_ranked`,
        `release_unranked`)."""
        nodes: list = []
        odd: list = self._collect(objects, request_hit, output, session, nodes)
        return (nodes, odd)

    @cython.cfunc
    @cython.boundscheck(False)
    @cython.wraparound(False)
    def _collect(
        self,
        objects: list,
        request_hit: cython.bint,
        output: cython.longlong,
        session: cython.bint,
        nodes: list,
    ) -> list:
        n: cython.Py_ssize_t = len(objects)
        i: cython.Py_ssize_t
        node: cython.int
        keys: list = self.keys
        name = self.key_attribute
        odd: list = []
        for i in range(n):
            item = objects[i]
            key = getattr(item, name)
            if key is None:
                self._fresh_append(item.block_id)
                continue
            if odd:
                odd.append((i, item))
                continue
            node = item.block_id
            held = keys[node]
            if held is not key and held != key:
                odd.append((i, item))
                continue
            self.from_end[node] = i
            self.request_hit[node] = request_hit
            self.request_output[node] = output
            self.request_session[node] = session
            nodes.append(node)
        return odd

    @cython.cfunc
    @cython.boundscheck(False)
    @cython.wraparound(False)
    def _offer(self, nodes: list) -> cython.void:
        """Rank each of `nodes` (released together) and offer it if it is a leaf."""
        n: cython.Py_ssize_t = len(nodes)
        i: cython.Py_ssize_t
        node: cython.int
        self._releasing()
        for i in range(n):
            self._rank_release(nodes[i])
        self._released()
        evictable: cython.char[:] = self.evictable
        children: cython.int[:] = self.children
        since: cython.longlong[:] = self.since
        for i in range(n):
            node = nodes[i]
            evictable[node] = 1
            self.unranked[node] = 0
            since[node] = self.entered
            self.entered += 1
            if children[node] == 0:
                self._push(node)
        self.num_evictable += n

    def release_ranked(self, nodes: list) -> None:
        """`release_n` of `nodes` keeping what each knew of its releasing request (an
        engine's rules noted it first: `note_release`)."""
        self._offer(nodes)

    @cython.boundscheck(False)
    @cython.wraparound(False)
    def note_release(
        self,
        nodes: list,
        from_ends: list,
        request_hit: cython.bint,
        output: cython.longlong,
        session: cython.bint = False,
    ) -> None:
        """Each of `nodes` learns its releasing request (`release_n`'s first step), before
        an engine's rules release it ranked or not."""
        i: cython.Py_ssize_t
        node: cython.int
        for i in range(len(nodes)):
            node = nodes[i]
            self.from_end[node] = from_ends[i]
            self.request_hit[node] = request_hit
            self.request_output[node] = output
            self.request_session[node] = session

    def release_unranked(self, nodes: list) -> None:
        """Nothing holds `nodes` (blocks without cached children) any more, and the
        engine's rules evict them themselves, ahead of the policy's choice: evictable,
        but neither ranked nor candidates (so the policy learns nothing from them)."""
        self._release_unranked(nodes)

    @cython.cfunc
    def _release_unranked(self, nodes: list) -> cython.void:
        node: cython.int
        for node in nodes:
            self.evictable[node] = 1
            self.unranked[node] = 1
            self.since[node] = self.entered
            self.entered += 1
        self.num_evictable += len(nodes)

    def restore_n(self, nodes: list) -> None:
        """Nodes withdrawn without a use (another tier held them while it copied them
        out) are evictable again with the standing of their last release, the tier
        lowering it (`tier_changed`); one never ranked is released anew."""
        fresh = [node for node in nodes if not self.ranked[node]]
        if fresh:
            self.release_n(fresh, None, False, 0)
        node: cython.int
        fraction: cython.longlong
        for node in nodes:
            if self.evictable[node]:
                continue
            fraction = self.order[node] & _FRACTION
            self.order[node] += ((fraction + _ONE) >> 1) - fraction
            self.evictable[node] = 1
            self.since[node] = self.entered
            self.entered += 1
            self.num_evictable += 1
            if self.children[node] == 0:
                self._push(node)
            self.tier_changed(node)

    @cython.boundscheck(False)
    @cython.wraparound(False)
    def touch_objects(self, objects: list, null_counts: cython.bint) -> int:
        """An engine's touch of a request's prefix hit (vLLM's `BlockPool.touch`), in
        one pass: each object whose key the cache accounts for is hit (`hit_n`), each
        free one leaves the fresh list or the candidates (`reclaim`), and each gains a
        reference (``ref_cnt``). A null object (``is_null``) is skipped, or with
        `null_counts` only gains its reference. Returns how many were hit."""
        keys: list = self.keys
        name = self.key_attribute
        hit: cython.Py_ssize_t = 0
        node: cython.int
        code: cython.int
        for item in objects:
            if item.is_null:
                if null_counts:
                    item.ref_cnt += 1
                continue
            node = item.block_id
            key = keys[node]
            if key is not None and key == getattr(item, name):
                hit += 1
                self.hits[node] += 1
                code = self.trial[node]
                if code >= 0:
                    self.trial[node] = -1
                    self._close(code, True)
                self._was_hit(node)
            if item.ref_cnt == 0:
                if self.in_fresh[node]:
                    self._fresh_unlink(node)
                else:
                    self.reclaim(node)
            item.ref_cnt += 1
        return hit

    @cython.boundscheck(False)
    @cython.wraparound(False)
    def hit_n(self, nodes: list) -> None:
        """A lookup reused each of `nodes`: a hit, which closes its open trial as reused."""
        node: cython.int
        code: cython.int
        hits: cython.int[:] = self.hits
        trial: cython.short[:] = self.trial
        for node in nodes:
            hits[node] += 1
            code = trial[node]
            if code >= 0:
                trial[node] = -1
                self._close(code, True)
            self._was_hit(node)

    def reclaim(self, node: cython.int) -> None:
        """An evictable `node` is held again (a prefix hit); no-op if it is not."""
        if self.evictable[node]:
            self.evictable[node] = 0
            self.unranked[node] = 0
            self.num_evictable -= 1
            if self.children[node] == 0:
                self._discard(node)

    def held_elsewhere(self, node: cython.int, held: cython.bint) -> None:
        """Another tier holds a copy of `node` (or, `held` False, no longer does)."""
        if self.held[node] == held:
            return
        self.held[node] = held
        if self.evictable[node]:
            self.tier_changed(node)
        elif self.prices_tiers:
            self.tiers_seen = True

    def tier_changed(self, node: cython.int) -> None:
        """`node`, evictable, became held elsewhere: a policy that prices tiers re-ranks
        it now to the lower of its rank and a reload's (`CostPolicy.tier_changed`)."""
        if not self.prices_tiers:
            return
        self.tiers_seen = True
        if not self.ranked[node] or not self.held[node]:
            return
        ranked: cython.double = self._rank_now(node)
        if ranked >= self.rank[node]:
            return
        self.rank[node] = ranked
        self.order[node] = self.releases * _ONE
        self.releases += 1
        if self.pos[node] >= 0:
            self._sift_up(self.pos[node])

    def remove(self, node: cython.int) -> None:
        """`node` left the cache other than as the policy's victim (invalidated, or its
        engine dropped its key): it leaves the tree, and its key goes to the ghost
        history if its trial is open. Its identity ends."""
        self._remove(node)

    @cython.cfunc
    def _remove(self, node: cython.int) -> cython.void:
        if self.evictable[node]:
            self.evictable[node] = 0
            self.unranked[node] = 0
            self.num_evictable -= 1
            if self.children[node] == 0:
                self._discard(node)
        self._leave(node)
        if self.ranked[node]:
            self.ranked[node] = 0
            # L rises to the policy's own victims only (`CostPolicy.remove`)
            if self.serial[node] == self.chosen_serial and self.rank[node] > self.inflation:
                self._inflate(self.rank[node])
        self._forget(node, False)

    @cython.boundscheck(False)
    @cython.wraparound(False)
    def pop_victims(self, n: cython.Py_ssize_t) -> list:
        """The policy's next `n` victims (fewer once none is left), in order, each removed
        and its identity ended and its key cleared: a parent whose last child leaves
        becomes a candidate. Block ids, or the cache's objects (see the class doc)."""
        victims: list = []
        taken: cython.Py_ssize_t = 0
        node: cython.int
        above: cython.int
        top: cython.double = self.inflation
        serial: cython.longlong[:] = self.serial
        children: cython.int[:] = self.children
        evictable: cython.char[:] = self.evictable
        keys: list = self.keys
        objects = self.objects
        recent: cython.bint = self.history.recent_capacity > 0
        following: cython.int = -1  # a parent known to be the next victim
        while taken < n:
            if following >= 0:
                node = following
                following = -1
            elif self.size > 0:
                node = self.heap[0]
                self._remove_at(0)
            else:
                break
            evictable[node] = 0
            above = self.parent[node]
            if above >= 0 and serial[above] == self.parent_serial[node]:
                children[above] -= 1
                if children[above] == 0 and evictable[above] and not self.unranked[above]:
                    # below every candidate: the next victim, with no push and pop (a
                    # request's chain, ranked tail lowest, goes in one run)
                    if taken + 1 < n and (self.size == 0 or self._less(above, self.heap[0])):
                        following = above
                    else:
                        self._push(above)
            if self.rank[node] > top:
                top = self.rank[node]
            self.ranked[node] = 0
            self.chosen_serial = serial[node]
            self._forget(node, recent)
            keys[node] = None
            victims.append(node if objects is None else objects[node])
            taken += 1
        self.num_evictable -= taken
        if top > self.inflation:
            self._inflate(top)
        return victims

    def next_victim(self) -> int:
        """The candidate the policy evicts first (-1: none). Changes nothing but which
        victim counts as the policy's own (`remove` then raises the inflation)."""
        if self.size == 0:
            return -1
        self.chosen_serial = self.serial[self.heap[0]]
        return self.heap[0]

    # -- an engine's rules' evicted-first queue (`kvplug.vllm.anchors.BlockNodes`) -------
    def release_hybrid(self, nodes: list, group_classes: bytes, copies: tuple) -> None:
        """Release `nodes` as a hybrid model's rules sort them (`BlockNodes.release_hybrid`):
        a node's class is its group's in `group_classes` (`_class_of_group`): 1, a window,
        queued first and released unranked unless anchored; 2, full attention, ranked,
        and queued first as a copy while another block holds its key in the engine's map
        (`held_by_another`, with `copies` its copy index); anything else ranked."""
        self._release_hybrid(nodes, group_classes, copies)

    def release_hybrid_objects(
        self,
        objects: list,
        request_hit: cython.bint,
        output: cython.longlong,
        group_classes: bytes,
        copies: tuple,
        session: cython.bint = False,
    ) -> list:
        """`collect_objects` and `release_hybrid` of the block ids it collects, in one
        call: a hybrid model's release of a request's freed objects; returns the objects
        `collect_objects` returns, for the cache to handle in order, after these."""
        nodes: list = []
        odd: list = self._collect(objects, request_hit, output, session, nodes)
        if nodes:
            self._release_hybrid(nodes, group_classes, copies)
        return odd

    @cython.cfunc
    @cython.boundscheck(False)
    @cython.wraparound(False)
    def _release_hybrid(self, nodes: list, group_classes: bytes, copies: tuple) -> cython.void:
        keys: list = self.keys
        index: dict = copies[0]
        values: cython.bint = copies[1]
        ranked: list = []
        unranked: list = []
        i: cython.Py_ssize_t
        node: cython.int
        kind: cython.int
        for i in range(len(nodes)):
            node = nodes[i]
            key = keys[node]
            kind = _class_of_group(key, group_classes)
            if kind == 1 and not self.anchored[node]:
                self._queue_first(node, False)
                unranked.append(node)
                continue
            if kind == 2 and _held_by_another(index, values, keys, key, node):
                self._queue_first(node, True)
            ranked.append(node)
        if ranked:
            self._offer(ranked)
        if unranked:
            self._release_unranked(unranked)

    def queue_first(self, node: cython.int, copy: cython.bint) -> None:
        """Queue `node`'s current identity to be evicted first (`copy`: a full-attention
        copy, which goes first only while another block holds its key). A full queue
        first drops the entries that can never go first (another identity's, an anchored
        window's), so it stays within a few times the blocks."""
        self._queue_first(node, copy)

    @cython.cfunc
    def _queue_first(self, node: cython.int, copy: cython.bint) -> cython.void:
        if self.lane_size > self.lane_mask:
            self._compact_lane()
            if 4 * self.lane_size > 3 * (self.lane_mask + 1):
                self._grow_lane()
        at: cython.Py_ssize_t = (self.lane_head + self.lane_size) & self.lane_mask
        self.lane_node[at] = node
        self.lane_serial[at] = self.serial[node]
        self.lane_copy[at] = copy
        self.lane_size += 1

    def first_entries(self) -> list[tuple[int, int, bool]]:
        """The queue's entries, first first: (node, serial at queueing, copy)."""
        entries = []
        for i in range(self.lane_size):
            at = (self.lane_head + i) & self.lane_mask
            entries.append((self.lane_node[at], self.lane_serial[at], bool(self.lane_copy[at])))
        return entries

    def next_first(self, copies: tuple) -> int:
        """Pop entries until one whose identity is live, a candidate and still first (a
        window: unanchored; a copy: while another block holds its key, `held_by_another`
        with `copies`), and return it (-1: none)."""
        node: cython.int
        while self.lane_size:
            node = self._pop_first(copies)
            if node >= 0:
                return node
        return -1

    @cython.boundscheck(False)
    @cython.wraparound(False)
    def take_first(self, n: cython.Py_ssize_t, copies: tuple) -> list:
        """Up to `n` victims from the queue, first first (as `next_first` finds them), each
        removed (`remove`) and its key cleared: the cache's objects (see the class doc)."""
        victims: list = []
        keys: list = self.keys
        objects = self.objects
        node: cython.int
        while self.lane_size and len(victims) < n:
            node = self._pop_first(copies)
            if node < 0:
                continue
            self._remove(node)
            keys[node] = None
            victims.append(node if objects is None else objects[node])
        return victims

    def take_hybrid(
        self, n: cython.Py_ssize_t, retiring: object, entries: dict, copies: tuple, rules: tuple
    ) -> tuple:
        """Up to `n` victims as a hybrid model's rules choose them
        (`kvplug.vllm.anchors.HybridRules.next_victim`, which the record pool runs), each
        removed and its key cleared: the cache's objects, and how many were retired
        dependents. `retiring` is the rules' queue of ``(node, serial, needed key)``,
        `entries` and `copies` the engine's map (`is_held`), `rules` the rules' group
        facts (`HybridRules.victim_rules`). Stops short of `n` only where no victim is
        left (the caller then falls back as the rules do)."""
        keys: list = self.keys
        objects = self.objects
        victims: list = []
        retired: cython.Py_ssize_t = 0
        node: cython.int
        while len(victims) < n:
            if not retiring:
                victims += self.take_first(n - len(victims), copies)
                if len(victims) >= n:
                    break
            node, found = self._hybrid_victim(retiring, entries, copies, rules)
            retired += found
            if node < 0:
                break
            self._remove(node)
            keys[node] = None
            victims.append(node if objects is None else objects[node])
        return (victims, retired)

    @cython.cfunc
    def _hybrid_victim(self, retiring: object, entries: dict, copies: tuple, rules: tuple) -> tuple:
        """`HybridRules.next_victim` over this core: (the next victim or -1, whether it
        is a retired dependent)."""
        keys: list = self.keys
        full: set = rules[2]
        node: cython.int
        while retiring:
            node, serial, needed = retiring.popleft()
            if is_held(entries, copies, keys, needed):
                continue
            if self.serial[node] == serial and self.evictable[node] and not self.children[node]:
                if keys[node][-4:] in full:
                    retiring.extend(self._dependents(node, entries, copies, rules))
                    self._retire_dead_parent(node, entries, copies, rules, retiring)
                return (node, 1)
        while self.lane_size:
            node = self._pop_first(copies)
            if node >= 0:
                return (node, 0)
        if self.size == 0:
            return (-1, 0)
        node = self.heap[0]
        self.chosen_serial = self.serial[node]
        retiring.extend(self._dependents(node, entries, copies, rules))
        if keys[node][-4:] in full:
            self._retire_dead_parent(node, entries, copies, rules, retiring)
        return (node, 0)

    @cython.cfunc
    def _dependents(self, victim: cython.int, entries: dict, copies: tuple, rules: tuple) -> list:
        """`HybridRules.dependents` over this core."""
        keys: list = self.keys
        key = keys[victim]
        retiring_suffixes: set = rules[1]
        if key[-4:] not in retiring_suffixes:
            return []
        if rules[5] and _held_by_another(copies[0], copies[1], keys, key, victim):
            return []
        found: list = []
        node: cython.int
        for node in holders_at(entries, keys, key[:-4], rules[0], key):
            if self.evictable[node]:
                found.append((node, self.serial[node], key))
        return found

    @cython.cfunc
    def _retire_dead_parent(
        self, victim: cython.int, entries: dict, copies: tuple, rules: tuple, retiring: object
    ) -> cython.void:
        """`HybridRules._retire_dead_parent` over this core."""
        keys: list = self.keys
        parent: cython.int = self.parent[victim]
        if parent < 0 or self.serial[parent] != self.parent_serial[victim]:
            return
        if self.children[parent] != 1 or not self.evictable[parent]:
            return
        widest: cython.int = rules[4]
        hashes: list = []
        node: cython.int = parent
        above: cython.int
        _step: cython.int
        for _step in range(min(widest, self.depth[parent] + 1)):
            if node < 0:
                return  # cannot tell
            hashes.append(keys[node][:-4])
            above = self.parent[node]
            node = above if above >= 0 and self.serial[above] == self.parent_serial[node] else -1
        for suffix, window in rules[3]:
            if not all_held(entries, copies, keys, hashes, suffix, window):
                retiring.append((parent, self.serial[parent], keys[victim]))
                return

    @cython.cfunc
    def _pop_first(self, copies: tuple) -> cython.int:
        """Pop the queue's first entry: its node if it still goes first, else -1."""
        at: cython.Py_ssize_t = self.lane_head
        node: cython.int = self.lane_node[at]
        self.lane_head = (at + 1) & self.lane_mask
        self.lane_size -= 1
        if self.serial[node] != self.lane_serial[at]:
            return -1
        if not self.evictable[node] or self.children[node] != 0:
            return -1
        if self.lane_copy[at]:
            keys: list = self.keys
            held = _held_by_another(copies[0], copies[1], keys, keys[node], node)
            return node if held else -1
        return -1 if self.anchored[node] else node

    @cython.cfunc
    def _compact_lane(self) -> cython.void:
        kept: cython.Py_ssize_t = 0
        i: cython.Py_ssize_t
        at: cython.Py_ssize_t
        to: cython.Py_ssize_t
        node: cython.int
        for i in range(self.lane_size):
            at = (self.lane_head + i) & self.lane_mask
            node = self.lane_node[at]
            if self.serial[node] != self.lane_serial[at]:
                continue
            if not self.lane_copy[at] and self.anchored[node]:
                continue
            to = (self.lane_head + kept) & self.lane_mask
            self.lane_node[to] = node
            self.lane_serial[to] = self.lane_serial[at]
            self.lane_copy[to] = self.lane_copy[at]
            kept += 1
        self.lane_size = kept

    @cython.cfunc
    def _grow_lane(self) -> cython.void:
        size: cython.Py_ssize_t = self.lane_size
        capacity: cython.Py_ssize_t = 2 * (self.lane_mask + 1)
        nodes = array("i", [0]) * capacity
        serials = array("q", [0]) * capacity
        copies = array("b", [0]) * capacity
        i: cython.Py_ssize_t
        at: cython.Py_ssize_t
        for i in range(size):
            at = (self.lane_head + i) & self.lane_mask
            nodes[i] = self.lane_node[at]
            serials[i] = self.lane_serial[at]
            copies[i] = self.lane_copy[at]
        self.lane_node = nodes
        self.lane_serial = serials
        self.lane_copy = copies
        self.lane_head = 0
        self.lane_mask = capacity - 1

    # -- the fresh list: free blocks that hold nothing reusable ---------------------------
    @cython.boundscheck(False)
    @cython.wraparound(False)
    def push_fresh(self, blocks: list, first: cython.bint) -> None:
        """Free `blocks` (objects with a ``block_id``) that hold nothing reusable: with
        `first`, to go out before every fresh block, ``blocks[0]`` first; else after every
        one, in order. A block already in the list moves."""
        n: cython.Py_ssize_t = len(blocks)
        i: cython.Py_ssize_t
        if first:
            for i in range(n - 1, -1, -1):
                self._fresh_prepend(blocks[i].block_id)
        else:
            for i in range(n):
                self._fresh_append(blocks[i].block_id)

    @cython.boundscheck(False)
    @cython.wraparound(False)
    def prepend_objects(self, objects: list) -> list:
        """`push_fresh` to the front, ``objects[0]`` first, for each of `objects` that
        holds no key (`key_attribute`); those that hold one are returned, in order, for
        the cache to free as it frees keyed blocks to go first."""
        keyed: list = []
        name = self.key_attribute
        i: cython.Py_ssize_t
        for i in range(len(objects) - 1, -1, -1):
            item = objects[i]
            if getattr(item, name) is not None:
                keyed.append(item)
                continue
            self._fresh_prepend(item.block_id)
        keyed.reverse()
        return keyed

    def take_n(self, n: cython.Py_ssize_t) -> list:
        """An engine's hand-out of `n` free blocks (the cache's objects): fresh ones
        first (`pop_fresh`), then the policy's victims (`pop_victims`), fewer once none
        is left; `last_victims` says how many were victims."""
        taken: list = self.pop_fresh(n) if self.num_fresh else []
        self.last_victims = 0
        if len(taken) < n:
            victims: list = self.pop_victims(n - len(taken))
            self.last_victims = len(victims)
            taken.extend(victims)
        return taken

    def pop_fresh(self, n: cython.Py_ssize_t) -> list:
        """Up to `n` fresh blocks from the head of the list, taken out of it (the cache's
        objects)."""
        taken: list = []
        node: cython.int
        objects = self.objects
        while n > 0 and self.fresh_head >= 0:
            node = self.fresh_head
            self._fresh_unlink(node)
            taken.append(objects[node])
            n -= 1
        return taken

    def remove_fresh(self, node: cython.int) -> bool:
        """Take `node` out of the fresh list; whether it was there."""
        if not self.in_fresh[node]:
            return False
        self._fresh_unlink(node)
        return True

    def is_fresh(self, node: cython.int) -> bool:
        return bool(self.in_fresh[node])

    def fresh_nodes(self) -> list[int]:
        """The fresh blocks' ids in hand-out order."""
        found = []
        node: cython.int = self.fresh_head
        while node >= 0:
            found.append(node)
            node = self.fresh_next[node]
        return found

    @cython.cfunc
    def _fresh_prepend(self, node: cython.int) -> cython.void:
        self._fresh_unlink(node)
        self.fresh_prev[node] = -1
        self.fresh_next[node] = self.fresh_head
        if self.fresh_head >= 0:
            self.fresh_prev[self.fresh_head] = node
        else:
            self.fresh_tail = node
        self.fresh_head = node
        self.in_fresh[node] = 1
        self.num_fresh += 1

    @cython.cfunc
    def _fresh_append(self, node: cython.int) -> cython.void:
        self._fresh_unlink(node)
        self.fresh_next[node] = -1
        self.fresh_prev[node] = self.fresh_tail
        if self.fresh_tail >= 0:
            self.fresh_next[self.fresh_tail] = node
        else:
            self.fresh_head = node
        self.fresh_tail = node
        self.in_fresh[node] = 1
        self.num_fresh += 1

    @cython.cfunc
    def _fresh_unlink(self, node: cython.int) -> cython.void:
        if not self.in_fresh[node]:
            return
        before: cython.int = self.fresh_prev[node]
        after: cython.int = self.fresh_next[node]
        if before >= 0:
            self.fresh_next[before] = after
        else:
            self.fresh_head = after
        if after >= 0:
            self.fresh_prev[after] = before
        else:
            self.fresh_tail = before
        self.in_fresh[node] = 0
        self.num_fresh -= 1

    # -- what the cache reads ------------------------------------------------------------
    def __len__(self) -> int:
        """The number of candidates (evictable leaves)."""
        return self.size

    def is_live(self, node: cython.int) -> bool:
        return self.serial[node] >= 0

    def is_evictable(self, node: cython.int) -> bool:
        return bool(self.evictable[node])

    def is_held_elsewhere(self, node: cython.int) -> bool:
        return bool(self.held[node])

    def is_ranked(self, node: cython.int) -> bool:
        return bool(self.ranked[node])

    def serial_of(self, node: cython.int) -> int:
        return self.serial[node]

    def depth_of(self, node: cython.int) -> int:
        return self.depth[node]

    def is_candidate(self, node: cython.int) -> bool:
        """Evictable with no cached children (ranked or not)."""
        return bool(self.evictable[node]) and self.children[node] == 0

    def is_anchored(self, node: cython.int) -> bool:
        return bool(self.anchored[node])

    @cython.boundscheck(False)
    @cython.wraparound(False)
    def anchor_blocks(self, objects: list, group_classes: bytes) -> None:
        """Mark the current identity of each of `objects` (the cache's, with ``block_id``
        and `key_attribute`) whose key is the one the cache accounts for and whose group
        (`_group_of`) has class 1 in `group_classes` (an engine's rules read the mark:
        `is_anchored`)."""
        i: cython.Py_ssize_t
        for i in range(len(objects)):
            self._anchor(objects[i], group_classes)

    @cython.boundscheck(False)
    @cython.wraparound(False)
    def anchor_windows(
        self,
        objects: list,
        start: cython.Py_ssize_t,
        end: cython.Py_ssize_t,
        window: cython.Py_ssize_t,
        ends: tuple,
        group_classes: bytes,
    ) -> None:
        """`anchor_blocks` of ``objects[max(e - window, start) : min(e, end)]`` for each
        position `e` in `ends`: the window of blocks before each of them, among those a
        request just cached."""
        e: cython.Py_ssize_t
        i: cython.Py_ssize_t
        for e in ends:
            for i in range(max(e - window, start), min(e, end)):
                self._anchor(objects[i], group_classes)

    @cython.cfunc
    def _anchor(self, item: object, group_classes: bytes) -> cython.void:
        key = getattr(item, self.key_attribute)
        if key is None:
            return
        node: cython.int = item.block_id
        held = self.keys[node]
        if held is None or (held is not key and held != key):
            return
        if _class_of_group(key, group_classes) == 1:
            self.anchored[node] = 1

    def live_parent(self, node: cython.int) -> int:
        """`node`'s parent if the link is live, else -1."""
        above: cython.int = self.parent[node]
        if above >= 0 and self.serial[above] == self.parent_serial[node]:
            return above
        return -1

    def cached_children(self, node: cython.int) -> int:
        return self.children[node]

    def hit_count(self, node: cython.int) -> int:
        return self.hits[node]

    def request_output_of(self, node: cython.int) -> int:
        return self.request_output[node]

    def entry(self, node: cython.int) -> tuple[int, float, int]:
        """`node`'s place in the eviction order: (protection, rank, release order in fixed
        point)."""
        return (self.protection[node], self.rank[node], self.order[node])

    def protection_of(self, node: cython.int) -> int:
        return self.protection[node]

    def protect_n(self, nodes: list, levels: list) -> None:
        """Give each of `nodes` (live identities) its protection level in `levels`
        (parallel; 0: none): a protected candidate goes after every candidate of a lower
        level, whatever its rank (`kvplug.core.queue_protection`). A block's level lasts
        until it is changed here or the block takes a new identity."""
        i: cython.Py_ssize_t
        node: cython.int
        level: cython.int
        old: cython.int
        for i in range(len(nodes)):
            node = nodes[i]
            level = levels[i]
            old = self.protection[node]
            if level == old or self.serial[node] < 0:
                continue
            self.protection[node] = level
            if old == 0:
                self.num_protected += 1
            elif level == 0:
                self.num_protected -= 1
            if self.pos[node] >= 0:
                if level > old:
                    self._sift_down(self.pos[node])
                else:
                    self._sift_up(self.pos[node])

    def evictable_nodes(self) -> list[int]:
        """Every evictable node, in the order they became evictable (first first)."""
        found = [node for node in range(len(self.serial)) if self.evictable[node]]
        return sorted(found, key=lambda node: self.since[node])

    def candidates(self) -> list[int]:
        """The current candidates in heap order (the first is the next victim)."""
        return [self.heap[i] for i in range(self.size)]

    def check_invariants(self) -> None:
        """Raise AssertionError if an invariant of the module doc does not hold."""
        n = len(self.serial)
        counted = [0] * n
        for node in range(n):
            if self.serial[node] >= 0:
                above = self.live_parent(node)
                if above >= 0:
                    counted[above] += 1
        evictable = 0
        for node in range(n):
            if self.serial[node] < 0:
                assert self.pos[node] < 0, f"block {node}: no identity, in the heap"
                continue
            assert self.children[node] == counted[node], f"block {node}: child count"
            evictable += self.evictable[node]
            leaf = bool(self.evictable[node]) and counted[node] == 0 and not self.unranked[node]
            assert (self.pos[node] >= 0) == leaf, f"block {node}: heap membership"
            assert self.evictable[node] or not self.unranked[node], f"block {node}: unranked"
            if leaf:
                assert self.heap[self.pos[node]] == node, f"block {node}: heap slot"
        assert evictable == self.num_evictable, "evictable count"
        protected = [node for node in range(n) if self.protection[node]]
        assert all(self.serial[node] >= 0 for node in protected), "a claim without an identity"
        assert len(protected) == self.num_protected, "protected count"
        for i in range(1, self.size):
            assert not self._less(self.heap[i], self.heap[(i - 1) >> 1]), "heap order"
        fresh = self.fresh_nodes()
        assert len(fresh) == self.num_fresh == sum(self.in_fresh), "fresh count"
        assert all(self.serial[node] < 0 for node in fresh), "a fresh block with an identity"
        self.history.check()

    # -- internals ----------------------------------------------------------------------
    @cython.cfunc
    def _forget(self, node: cython.int, victim: cython.bint) -> cython.void:
        """The end of `node`'s identity: its open trial's key goes to the ghost history
        (which forgets its oldest beyond capacity, closing those trials unreused) and,
        a `victim`'s, to the record of recent victims."""
        code: cython.int = self.trial[node]
        ghost: cython.longlong = -1
        if code >= 0:
            self.trial[node] = -1
            ghost = (self.hits[node] + self.credit[node]) << 10 | code
        if ghost >= 0 or victim:
            history: VictimHistory = self.history
            history.file(self.keys[node], ghost, victim)
            while history.num_ghosts > history.ghost_capacity:
                self._close(history.drop_oldest_ghost() & 1023, False)
        self.credit[node] = 0
        self.serial[node] = -1
        if self.protection[node]:
            self.protection[node] = 0
            self.num_protected -= 1

    @cython.cfunc
    def _leave(self, node: cython.int) -> cython.void:
        above: cython.int = self.parent[node]
        if above >= 0 and self.serial[above] == self.parent_serial[node]:
            self.children[above] -= 1
            if self.children[above] == 0 and self.evictable[above] and not self.unranked[above]:
                self._push(above)

    @cython.cfunc
    def _inflate(self, rank: cython.double) -> cython.void:
        self.inflation = rank
        self.policy.inflation = rank
        self.policy._inflation_key = _rank_key(rank)

    @cython.cfunc
    def _close(self, code: cython.int, reused: cython.bint) -> cython.void:
        self.tried[code] += 1
        if reused:
            self.reused[code] += 1
        self.known[code] = 0

    @cython.cfunc
    @cython.cdivision(True)
    def _credit(self, node: cython.int) -> cython.double:
        """GreedyDual's credit for `node` (`CostPolicy._credits`, the same arithmetic in
        the same order), opening its class's trial."""
        hits: cython.longlong = self.hits[node]
        reuses: cython.longlong = hits + self.credit[node]
        output: cython.int = _bit_length(self.request_output[node])
        code: cython.int
        from_end: cython.int
        if output > 12:
            output = 12
        if self.request_session[node]:
            output |= 128
        if reuses:
            code = (reuses if reuses < 3 else 3) << 8 | output
        else:
            from_end = self.from_end[node]
            code = ((from_end if from_end < 3 else 3) << 1 | self.request_hit[node]) << 4
            code |= output
        self.trial[node] = code
        if not self.known[code]:
            if not self.named[code]:  # (a trial's close unsets `known`, not `named`)
                if code not in self.classes:
                    self.classes[code] = _class_of(code)
                self.named[code] = 1
            self.probability[code] = (self.reused[code] + 1) / cython.cast(
                cython.double, self.tried[code] + 2
            )
            self.known[code] = 1
        probability: cython.double = self.probability[code]
        value: cython.double = self._value(self.depth[node])
        if self.tiers_seen and self.held[node]:
            if self.reload == 0.0:
                self.reload = self.policy.reload_value()
            if value > self.reload:
                value = self.reload
        return (1 + self.weight * (hits if hits < 3 else 3)) * probability * value

    @cython.cfunc
    def _value(self, depth: cython.int) -> cython.double:
        """The prefill value of a block at `depth` (`BlockValue.at_depth`)."""
        if depth < len(self.by_depth):
            return self.by_depth[depth]
        value: cython.double = self.policy.value.at_depth(depth)
        self.by_depth = self.policy.value.by_depth
        return value

    @cython.cfunc
    def _rank_release(self, node: cython.int) -> cython.void:
        credit: cython.double = self._credit(node)
        self._set_rank(node, self.inflation + credit + 0.0)

    @cython.cfunc
    def _rank_now(self, node: cython.int) -> cython.double:
        """The rank `node` would be given now (`CostPolicy.rank`, opening its trial)."""
        return self.inflation + self._credit(node)

    @cython.cfunc
    def _set_rank(self, node: cython.int, rank: cython.double) -> cython.void:
        self.rank[node] = rank
        self.order[node] = self.releases * _ONE
        self.releases += 1
        self.ranked[node] = 1

    # the heap: block ids ordered by (rank, order); pos[b] is b's slot, -1 outside
    @cython.cfunc
    @cython.inline
    def _less(self, a: cython.int, b: cython.int) -> cython.bint:
        if self.protection[a] != self.protection[b]:
            return self.protection[a] < self.protection[b]
        if self.rank[a] < self.rank[b]:
            return True
        return self.rank[a] == self.rank[b] and self.order[a] < self.order[b]

    @cython.cfunc
    def _push(self, node: cython.int) -> cython.void:
        at: cython.int = self.size
        self.size += 1
        self.heap[at] = node
        self.pos[node] = at
        self._sift_up(at)

    @cython.cfunc
    def _discard(self, node: cython.int) -> cython.void:
        at: cython.int = self.pos[node]
        if at >= 0:
            self._remove_at(at)

    @cython.cfunc
    def _remove_at(self, at: cython.int) -> cython.void:
        node: cython.int = self.heap[at]
        self.pos[node] = -1
        self.size -= 1
        if at == self.size:
            return
        last: cython.int = self.heap[self.size]
        self.heap[at] = last
        self.pos[last] = at
        if at > 0 and self._less(last, self.heap[(at - 1) >> 1]):
            self._sift_up(at)
        else:
            self._sift_down(at)

    @cython.cfunc
    def _sift_up(self, at: cython.int) -> cython.void:
        node: cython.int = self.heap[at]
        above: cython.int
        up: cython.int
        while at > 0:
            up = (at - 1) >> 1
            above = self.heap[up]
            if not self._less(node, above):
                break
            self.heap[at] = above
            self.pos[above] = at
            at = up
        self.heap[at] = node
        self.pos[node] = at

    @cython.cfunc
    def _sift_down(self, at: cython.int) -> cython.void:
        node: cython.int = self.heap[at]
        size: cython.int = self.size
        child: cython.int
        while True:
            child = 2 * at + 1
            if child >= size:
                break
            if child + 1 < size and self._less(self.heap[child + 1], self.heap[child]):
                child += 1
            if not self._less(self.heap[child], node):
                break
            self.heap[at] = self.heap[child]
            self.pos[self.heap[at]] = at
            at = child
        self.heap[at] = node
        self.pos[node] = at


@cython.cclass
class DenseLearnedCore(DenseCostCore):
    """`DenseCostCore` with `kvplug.policies.learned.LearnedPolicy`'s ranking: `cost`'s
    credit, a running mean of credits, the sampled keys' releases, accesses and hits fed to
    the policy's shadow duel (`kvplug.policies.shadow.ShadowDuel`, which stays on the
    policy, as its referee does), and, while the referee prefers release order, ranks in
    release order on `cost`'s scale. The generic policy's decisions, rank for rank (the
    same differential tests)."""

    sample: cython.char[:]  # the key of its identity is in the shadows' sample
    mask: cython.int
    mean: cython.double
    lru_rank: cython.double
    use_learned: cython.bint
    duel: object

    def __init__(self, policy: Any, num_nodes: int, keys: list, *args: Any) -> None:
        super().__init__(policy, num_nodes, keys, *args)
        self.sample = array("b", [0]) * num_nodes
        self.mask = (1 << policy.sample_shift) - 1
        self.mean = policy._mean_credit
        self.lru_rank = policy._lru_rank
        self.duel = policy.duel
        self.use_learned = self.duel.use_learned

    @cython.cfunc
    def _inserted(self, nodes: list) -> cython.void:
        node: cython.int
        keys: list = self.keys
        for node in nodes:
            self.sample[node] = (keys[node][0] & self.mask) == 0
        for node in nodes:
            if self.sample[node]:
                self.duel.access(keys[node], self._value(self.depth[node]))

    @cython.cfunc
    def _was_hit(self, node: cython.int) -> cython.void:
        if self.sample[node]:
            self.duel.access(self.keys[node], self._value(self.depth[node]))

    @cython.cfunc
    def _releasing(self) -> cython.void:
        self.use_learned = self.duel.use_learned

    @cython.cfunc
    def _rank_release(self, node: cython.int) -> cython.void:
        credit: cython.double = self._credit(node)
        self.mean += (credit - self.mean) / 1024
        if self.sample[node]:
            self.duel.release(self.keys[node], credit)
        if self.use_learned:
            self._set_rank(node, self.inflation + credit + 0.0)
            return
        if self.inflation + self.mean > self.lru_rank:
            self.lru_rank = self.inflation + self.mean
        self._set_rank(node, self.lru_rank + 0.0)

    @cython.cfunc
    def _released(self) -> cython.void:
        self.policy._mean_credit = self.mean
        self.policy._lru_rank = self.lru_rank

    @cython.cfunc
    def _rank_now(self, node: cython.int) -> cython.double:
        """`LearnedPolicy.rank` while the learned ranking is in use: the credit also moves
        the running mean and reaches the shadows."""
        credit: cython.double = self._credit(node)
        self.mean += (credit - self.mean) / 1024
        self.policy._mean_credit = self.mean
        if self.sample[node]:
            self.duel.release(self.keys[node], credit)
        return self.inflation + credit

    def tier_changed(self, node: cython.int) -> None:
        if self.duel.use_learned:  # in release order, a tier changes nothing
            DenseCostCore.tier_changed(self, node)
        elif self.prices_tiers:
            self.tiers_seen = True


@cython.boundscheck(False)
@cython.wraparound(False)
def count_new_keys(
    objects: list,
    start: cython.Py_ssize_t,
    end: cython.Py_ssize_t,
    name: str,
    recent: VictimHistory,
    before: list | None = None,
) -> tuple[int, int]:
    """Of ``objects[start:end]``, just given keys (attribute `name`; None: none): how many
    hold one, and how many of those keys were recent victims (each leaves `recent`, the
    cache's record of recent victims, and counts its `weight`: a re-cache, churn). With
    `before` (their keys before, parallel), only a key that changed counts as given, and
    as held only where there was none before. One compiled pass for an engine pool that
    keeps no identities (vLLM's own queue under ``lru``)."""
    keyed: cython.Py_ssize_t = 0
    again: cython.Py_ssize_t = 0
    i: cython.Py_ssize_t
    for i in range(start, end):
        key = getattr(objects[i], name)
        if key is None:
            continue
        if before is not None:
            old = before[i - start]
            if old is key or old == key:
                continue
            if old is not None:
                keyed -= 1  # (counted below: it held one already)
        keyed += 1
        if recent.num_recent and recent.take_recent(key):
            again += recent.weight
    return (keyed, again)


@cython.boundscheck(False)
@cython.wraparound(False)
def keys_of(objects: list, start: cython.Py_ssize_t, end: cython.Py_ssize_t, name: str) -> list:
    """The key (attribute `name`) of each of ``objects[start:end]``, in one pass."""
    return [getattr(objects[i], name) for i in range(start, end)]


@cython.boundscheck(False)
@cython.wraparound(False)
def count_keyed(objects: list, name: str) -> int:
    """How many of `objects` hold a key (attribute `name`; None: none): a prefix hit's
    blocks counted in one compiled pass, for an engine pool that keeps no identities."""
    keyed: cython.Py_ssize_t = 0
    for item in objects:
        if getattr(item, name) is not None:
            keyed += 1
    return keyed


@cython.boundscheck(False)
@cython.wraparound(False)
def any_copy(
    objects: list,
    start: cython.Py_ssize_t,
    end: cython.Py_ssize_t,
    name: str,
    index: dict,
    values: cython.bint,
) -> bool:
    """Whether an engine's map may hold more than one block under the key (attribute
    `name`) of one of ``objects[start:end]``: `index` has the key and, with `values`, its
    value there is a dict (`kvplug.vllm.compat.copy_index`)."""
    i: cython.Py_ssize_t
    for i in range(start, end):
        key = getattr(objects[i], name)
        if key is None:
            continue
        found = index.get(key)
        if found is not None and (not values or isinstance(found, dict)):
            return True
    return False


def held_by_another(copies: tuple, keys: list, key: object, node: cython.int) -> bool:
    """Whether a block other than `node` holds `key` in an engine's map, as its pool
    accounts for it (``keys[block] == key``): `copies` is the map's copy index (an
    ``(index, values)`` pair, `kvplug.vllm.compat.copy_index`), where a key held by
    more than one block maps to a dict keyed by their block ids."""
    return _held_by_another(copies[0], copies[1], keys, key, node)


@cython.cfunc
def _held_by_another(
    index: dict, values: cython.bint, keys: list, key: object, node: cython.int
) -> cython.bint:
    found = index.get(key)
    if found is None or (values and not isinstance(found, dict)):
        return False
    ids: dict = found  # keyed by the block ids holding it (both layouts)
    for other in ids:  # noqa: SIM110 (a loop Cython compiles; any() makes a generator)
        if other != node and keys[other] == key:
            return True
    return False


@cython.cfunc
def _one_block_id(entries: dict, key: object) -> cython.int:
    """The block an engine's map names first for `key` (-1: none), read from the map's
    entries in each of vLLM's layouts (`kvplug.vllm.compat.map_entries`): a key's value
    is its block, a dict of its blocks by block id, or its block id."""
    found = entries.get(key)
    if found is None:
        return -1
    if isinstance(found, int):
        return found
    if isinstance(found, dict):
        for block_id in found:  # the first, as the map's own get_one_block takes it
            return block_id
        return -1
    return found.block_id


def is_held(entries: dict, copies: tuple, keys: list, key: object) -> bool:
    """Whether some block holds `key` in an engine's map, as its pool accounts for it
    (``keys[block] == key``): the block the map names first, or another
    (`held_by_another`). `entries` and `copies` are the map's
    (`kvplug.vllm.compat.map_entries`, `kvplug.vllm.compat.copy_index`)."""
    node: cython.int = _one_block_id(entries, key)
    if node < 0:
        return False
    held = keys[node]
    if held is key or held == key:
        return True
    return _held_by_another(copies[0], copies[1], keys, key, node)


def all_held(
    entries: dict, copies: tuple, keys: list, positions: list, suffix: bytes, count: cython.int
) -> bool:
    """Whether ``position + suffix`` is held (`is_held`) for each of the first `count` of
    `positions`: one group's blocks over a window."""
    i: cython.Py_ssize_t
    index: dict = copies[0]
    values: cython.bint = copies[1]
    node: cython.int
    for i in range(min(count, len(positions))):
        key = positions[i] + suffix
        node = _one_block_id(entries, key)
        if node < 0:
            return False
        held = keys[node]
        if held is not key and held != key and not _held_by_another(index, values, keys, key, node):
            return False
    return True


def holders_at(entries: dict, keys: list, position: bytes, suffixes: list, skip: object) -> list:
    """For each of `suffixes` in order, the block holding ``position + suffix`` as the
    pool accounts for it, where the map's first block for that key does (keys other than
    `skip`): the blocks of the other groups at one position."""
    found: list = []
    node: cython.int
    for suffix in suffixes:
        other = position + suffix
        if other == skip:
            continue
        node = _one_block_id(entries, other)
        if node >= 0 and keys[node] == other:
            found.append(node)
    return found


@cython.cfunc
@cython.boundscheck(False)
@cython.wraparound(False)
def _class_of_group(key: bytes, group_classes: bytes) -> cython.int:
    """The class `group_classes` gives the group of an engine's key: vLLM's keys end in
    their group id, four bytes big-endian (0 for a group past its end)."""
    length: cython.Py_ssize_t = len(key)
    group: cython.long = (key[length - 4] & 255) << 24 | (key[length - 3] & 255) << 16
    group |= (key[length - 2] & 255) << 8 | (key[length - 1] & 255)
    if group < len(group_classes):
        return group_classes[group]
    return 0


@cython.cfunc
def _bit_length(x: cython.longlong) -> cython.int:
    n: cython.int = 0
    while x > 0 and n < 13:
        x >>= 1
        n += 1
    return n


def _class_of(code: int) -> tuple[int, ...]:
    """The class a `CostPolicy` class code stands for (`CostPolicy.classify`)."""
    session = (code >> 7) & 1
    if code >= 256:
        return (code >> 8, code & 15, session)
    return (0, (code >> 5) & 3, (code >> 4) & 1, code & 15, session)


def iter_victims(core: Any, gone: list[int]) -> Any:
    """Every evictable node of the `DenseCostCore` `core` in the order successive
    `pop_victims` calls would take them once the evictable nodes `gone` have left first
    (nothing else changing meanwhile), changing nothing (`EvictionCore.iter_victims`):
    the candidates read from the heap in order through a frontier of its slots, merged
    with each parent at the point its last cached child would leave."""
    from heapq import heappop, heappush

    skip = set(gone)
    children_left: dict[int, int] = {}
    promoted: list[tuple[int, float, int, int]] = []

    def leaves(node: int) -> None:
        above = core.live_parent(node)
        if above >= 0 and core.is_evictable(above) and above not in skip:
            left = children_left.get(above, core.cached_children(above)) - 1
            children_left[above] = left
            if left == 0:
                heappush(promoted, (*core.entry(above), above))

    for node in gone:
        leaves(node)
    heap = core.candidates()
    frontier: list[tuple[int, float, int, int, int]] = []
    if heap:
        frontier.append((*core.entry(heap[0]), heap[0], 0))

    def upcoming() -> tuple[int, float, int, int] | None:
        while frontier:
            protection, rank, order, node, at = heappop(frontier)
            for child in (2 * at + 1, 2 * at + 2):
                if child < len(heap):
                    heappush(frontier, (*core.entry(heap[child]), heap[child], child))
            return (protection, rank, order, node)
        return None

    following = upcoming()
    while following is not None or promoted:
        if promoted and (following is None or promoted[0][:3] < following[:3]):
            node = heappop(promoted)[3]
        else:
            assert following is not None
            node = following[3]
            following = upcoming()
            if node in skip:
                continue
        yield node
        leaves(node)
