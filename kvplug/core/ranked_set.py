"""A ranked set: the members of one kind of cached state, in the order a policy evicts them.

The eviction core (`kvplug.core.eviction`) serves caches whose victims are leaves of a
prefix tree. Some engine state is evicted from any node instead: SGLang's sliding-window
and Mamba components tombstone internal nodes too. For such state the adapter keeps a
`RankedSet` and reports what the engine does with each member:

- `add`: the member gained its state and counts as accessed now (the newest);
  `add_before`: it gained its state at a given place in recency order, right older
  than `newer` (an engine that splits a node places the new part beside the old one);
- `touch`: the member was accessed (the engine moved it to its most-recent end);
- `hit`: a lookup reused it; `remove`: its state left the cache.

Each access releases the member to the policy (`EvictionPolicy.release`): the policy
ranks it again, as of now. A member's order key is (the policy's rank, its recency):
the rank decides, and recency breaks ties, so ``lru`` (one rank for all) orders exactly
by recency. A member keeps its key while the engine holds it (a lock); `first` skips
the members the caller says it may not evict, as the engine's own walk skips them.

Invariants (`check` audits them):

- every member has exactly one current heap entry, carrying its current key; entries of
  removed members and older keys are stale and are dropped when they reach the top (or
  when the heap is rebuilt, once stale entries outnumber current ones);
- recency keys are distinct and follow the engine's order: a `touch` or `add` key is
  above every key given so far, an `add_before` key lies strictly between the keys of
  its neighbours.

The policy must be a `RankedPolicy` (every built-in policy is one): the set reads the
rank the policy recorded at release and keeps the candidates itself, so the policy's own
candidate heap stays empty. Operations are O(log n); `first` is O(k log n) with k the
held members ranked below the victim.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from fractions import Fraction
from heapq import heapify, heappop, heappush
from itertools import count
from typing import Generic, TypeVar

from kvplug.errors import ConfigError
from kvplug.policies.base import EvictionPolicy, RankedPolicy
from kvplug.policies.node import CachedNode

N = TypeVar("N", bound=CachedNode)
Recency = int | Fraction
Key = tuple[float, Recency]


class RankedSet(Generic[N]):
    """One kind of state's members, ranked by `policy` (see the module doc)."""

    def __init__(self, policy: EvictionPolicy) -> None:
        if not isinstance(policy, RankedPolicy):
            raise ConfigError(
                f"policy {getattr(policy, 'name', type(policy).__name__)!r} cannot rank "
                "state evicted from internal nodes (sliding-window or Mamba state): it "
                "must be a kvplug.policies.base.RankedPolicy"
            )
        self.policy: RankedPolicy = policy
        self._members: dict[int, N] = {}  # serial -> member
        self._key: dict[int, Key] = {}  # serial -> its current order key
        self._heap: list[tuple[float, Recency, int]] = []  # (rank, recency, serial)
        self._clock = count(1)

    def __len__(self) -> int:
        return len(self._members)

    def __contains__(self, node: N) -> bool:
        return node.serial in self._members

    def __iter__(self) -> Iterator[N]:
        return iter(self._members.values())

    # -- what the engine reports ---------------------------------------------------------
    def add(self, node: N) -> None:
        """`node` gained its state, accessed now."""
        self._admit(node, next(self._clock))

    def add_before(self, node: N, newer: N, older: N | None) -> None:
        """`node` gained its state right older than `newer` and newer than `older`
        (None: older than every member), both members: as old as `newer`, for the
        policy, and placed between the two in recency."""
        high = self._key[newer.serial][1]
        low = self._key[older.serial][1] if older is not None else high - 1
        assert low < high, "add_before: `older` is not older than `newer`"
        self._admit(node, Fraction(low + high, 2))

    def touch(self, node: N) -> None:
        """`node` was accessed: ranked again, as the newest."""
        self._rank(node, next(self._clock))

    def hit(self, node: N) -> None:
        """A lookup reused `node`."""
        node.hits += 1  # type: ignore[misc]
        self.policy.hit(node)

    def remove(self, node: N) -> None:
        """`node`'s state left the cache."""
        del self._members[node.serial]
        del self._key[node.serial]
        self.policy.remove(node)
        self._compact()

    # -- what the eviction asks ------------------------------------------------------------
    def first(self, evictable: Callable[[N], bool]) -> N | None:
        """The lowest-ranked member `evictable` accepts, or None. Changes no ranking."""
        heap, members, keys = self._heap, self._members, self._key
        skipped: list[tuple[float, Recency, int]] = []
        found: N | None = None
        while heap:
            rank, recency, serial = heap[0]
            if keys.get(serial) != (rank, recency):
                heappop(heap)  # stale
                continue
            node = members[serial]
            if evictable(node):
                found = node
                break
            skipped.append(heappop(heap))
        for entry in skipped:
            heappush(heap, entry)
        return found

    def ordered(self) -> list[N]:
        """Every member, the first to evict first (for audits and tests: O(n log n))."""
        return [self._members[serial] for serial in sorted(self._key, key=self._key.get)]  # type: ignore[arg-type]

    def check(self) -> None:
        """Raise AssertionError if an invariant of the module doc does not hold."""
        assert set(self._members) == set(self._key)
        current = [entry for entry in self._heap if self._key.get(entry[2]) == entry[:2]]
        assert sorted(entry[2] for entry in current) == sorted(self._key), "heap entries"
        recencies = [key[1] for key in self._key.values()]
        assert len(set(recencies)) == len(recencies), "recency keys collide"

    # -- helpers ---------------------------------------------------------------------------
    def _admit(self, node: N, recency: Recency) -> None:
        assert node.serial not in self._members, f"member {node.serial} added twice"
        self._members[node.serial] = node
        self.policy.insert(node)
        self._rank(node, recency)

    def _rank(self, node: N, recency: Recency) -> None:
        self.policy.release(node)
        rank = self.policy.rank_of(node)
        key = (rank, recency)
        self._key[node.serial] = key
        heappush(self._heap, (*key, node.serial))
        self._compact()

    def _compact(self) -> None:
        if len(self._heap) > 64 + 2 * len(self._key):
            self._heap = [(*key, serial) for serial, key in self._key.items()]
            heapify(self._heap)
