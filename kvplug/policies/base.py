"""The interface between a cache and an eviction policy.

A policy only ranks. The cache (kvplug's `KVCache`, or an engine adapter) tells it what
happened to a cached block, through the eviction core (`kvplug.core.eviction`), and asks
it which candidate to evict next and whether a new block is worth admitting. Policies
read blocks through the `kvplug.policies.node.CachedNode` contract and nothing else.

Candidates. A block is an eviction *candidate* while it is cached, held by nobody and has
no cached children (a leaf). `kvplug.core.eviction.EvictionCore` keeps the policy's
candidate set exact with `add_candidate` / `discard_candidate`, so evicting only
candidates keeps every cached prefix whole. `choose_victims` returns candidates and must
not change anything: the cache removes them and reports each with `remove`.

Every method must run in O(log n) or better (amortised) in the number of cached blocks.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Hashable, Iterator, Mapping, Sequence
from heapq import heapify, heappop, heappush
from itertools import count
from typing import TYPE_CHECKING, ClassVar

from kvplug.policies.entry import (
    SERIAL_MASK,
    entry_rank,
    make_entry,
    restored_entry,
)

if TYPE_CHECKING:
    from kvplug.policies.node import CachedNode


class EvictionPolicy(ABC):
    """One eviction strategy. Subclasses set `name` and implement the three abstract methods.

    Capabilities, declared on the class and read by the caches instead of the name:
    `offline` (it needs every request in advance: the replay calls `foresee` and keeps
    `now` at the index of the request being admitted; no engine runs it) and
    `release_order` (its victim is always the candidate released longest ago, so an
    engine whose free queue is kept in release order may evict from it unchanged) and
    `values_position` (a block's rank depends on its depth, so the tail of an engine's
    many-block node is worth less than its head: SGLang's adapter then evicts only the
    tail pages it needs of a victim node, not the whole node).
    """

    name: ClassVar[str]
    offline: ClassVar[bool] = False
    release_order: ClassVar[bool] = False
    values_position: ClassVar[bool] = False
    # it reads ``node.key`` (an engine whose keys take work to make, SGLang's radix
    # nodes, makes none for a policy that does not)
    reads_keys: ClassVar[bool] = True
    now: int = 0  # offline policies: the replay's clock
    # it values a block another tier holds as a reload (`tier_changed`); an engine's own
    # "evict first" lane for such blocks then gives way to the policy's ranking
    prices_tiers: bool = False
    # an engine whose nodes each hold several blocks (``node.blocks``) sets it, so that a
    # policy that learns weighs what each node teaches by its blocks (`CostPolicy`)
    spans_blocks: bool = False

    def foresee(self, requests: Mapping[Hashable, Sequence[int]]) -> None:
        """Offline policies: each block key -> the sorted indices of the requests whose
        lookup can reach it, over the whole trace."""
        raise TypeError(f"policy {self.name!r} is online: it takes no future")

    def bind(self, block_size: int, num_blocks: int) -> None:
        """Called once by the cache that uses the policy."""

    @property
    def ghost_capacity(self) -> int:
        """The blocks of victims the policy remembers by key once bound (0: none)."""
        return 0

    def ghosts_inside(self, node: CachedNode, keys: Sequence[bytes]) -> None:
        """`node`, just inserted, also holds the blocks keyed `keys`, before its last (an
        engine node spanning several blocks): a policy with a `ghost_capacity` takes
        back the victims it remembers among them."""

    def admit(self, node: CachedNode) -> bool:
        """Return False to keep a new block out of the cache (it is freed with its request)."""
        return True

    def insert(self, node: CachedNode) -> None:
        """`node` was just cached (held by the request that wrote it)."""

    def insert_n(self, nodes: Sequence[CachedNode]) -> None:
        """`insert` for each of `nodes`, in order (one request's new blocks, cached
        together). A policy may override this to do the same work with less per node."""
        for node in nodes:
            self.insert(node)

    def hit(self, node: CachedNode) -> None:
        """A lookup reused `node`."""

    def hit_n(self, nodes: Sequence[CachedNode]) -> None:
        """`hit` for each of `nodes`, in order (one request's prefix hits). A policy may
        override this to do the same work with less per node."""
        for node in nodes:
            self.hit(node)

    def release(self, node: CachedNode) -> None:
        """The last request holding `node` let go of it; it is now evictable.

        `node.from_end` (blocks of that request after this one) and `node.request_hit`
        (whether that request reused cached blocks) describe the release.
        """

    def touch(self, node: CachedNode) -> None:
        """`node` was accessed, held or not. Only engines that order by access rather than
        by release report this (SGLang stamps every node a lookup or insert walks); a
        policy ordered by recency takes a node's place from its latest access."""

    def tier_changed(self, node: CachedNode, evictable: bool) -> None:
        """`node.held_elsewhere` changed (another tier took or dropped a copy of it). A
        policy that `prices_tiers` may re-rank it now if it is `evictable` (released and not
        held since); otherwise its next release ranks it by the flag."""

    def release_n(self, nodes: Sequence[CachedNode]) -> None:
        """`release` for each of `nodes`, in order (one request's blocks, freed together).
        No candidate changes in between, so a policy whose `release` does not read its
        candidate set may override this to do the same work with less per node."""
        for node in nodes:
            self.release(node)

    def remove(self, node: CachedNode) -> None:
        """`node` left the cache (evicted or invalidated). It is never a candidate again."""

    @abstractmethod
    def add_candidate(self, node: CachedNode) -> None:
        """`node` became an evictable leaf."""

    @abstractmethod
    def discard_candidate(self, node: CachedNode) -> None:
        """`node` stopped being an evictable leaf (it was hit, grew a child, or is leaving)."""

    @abstractmethod
    def choose_victims(self, n: int) -> list[CachedNode]:
        """Up to `n` distinct current candidates, the first to evict first. Changes nothing."""

    def first_candidate(self) -> CachedNode | None:
        """``choose_victims(1)``'s one victim, or None if there is no candidate."""
        victims = self.choose_victims(1)
        return victims[0] if victims else None

    def add_candidates(self, nodes: Sequence[CachedNode]) -> None:
        """`add_candidate` for each of `nodes`."""
        for node in nodes:
            self.add_candidate(node)

    def pop_first(self) -> CachedNode | None:
        """`first_candidate`, no longer a candidate (the caller then removes it), or None."""
        node = self.first_candidate()
        if node is not None:
            self.discard_candidate(node)
        return node

    def remove_victims(self, nodes: Sequence[CachedNode]) -> None:
        """Each of `nodes`, in order, was the policy's own next victim (taken with
        `pop_first`, nothing released in between) and left the cache: `remove` for each,
        as right after its `pop_first`. A policy may override this to do the same work
        with less per node."""
        for node in nodes:
            self.remove(node)

    @abstractmethod
    def __len__(self) -> int:
        """The number of current candidates."""


class RankedPolicy(EvictionPolicy):
    """A policy that ranks each node with one number when it is released (lowest evicted
    first) and keeps its candidates in a binary heap: O(log n) per operation.

    Subclasses implement `rank`; ties go to the node released first. Discarding a
    candidate only forgets it; its heap entry is dropped when it reaches the top (an
    entry is current while its node is a candidate released with that entry), and the
    heap is rebuilt when stale entries outnumber current ones. A release makes one entry
    (`kvplug.policies.entry`: an int that sorts as ``(rank, release order, serial)``),
    kept in ``_rank`` and pushed as is.
    """

    def __init__(self) -> None:
        # serial -> its entry at its last release (`kvplug.policies.entry`); a restored
        # entry's order is fractional (`restore`)
        self._rank: dict[int, int] = {}
        self._heap: list[int] = []  # entries
        self._nodes: dict[int, CachedNode] = {}  # serial -> node, for current candidates
        self._releases = count()
        self.chosen = -1  # serial of the last victim `first_candidate` named

    @abstractmethod
    def rank(self, node: CachedNode) -> float:
        """The node's standing when released: lower is evicted sooner."""

    def release(self, node: CachedNode) -> None:
        serial = node.serial
        self._rank[serial] = make_entry(self.rank(node), next(self._releases), serial)

    def release_n(self, nodes: Sequence[CachedNode]) -> None:
        ranks, rank, releases = self._rank, self.rank, self._releases
        for node in nodes:
            serial = node.serial
            ranks[serial] = make_entry(rank(node), next(releases), serial)

    def add_candidate(self, node: CachedNode) -> None:
        serial = node.serial
        self._nodes[serial] = node
        heappush(self._heap, self._rank[serial])

    def add_candidates(self, nodes: Sequence[CachedNode]) -> None:
        candidates, heap, ranks = self._nodes, self._heap, self._rank
        for node in nodes:
            serial = node.serial
            candidates[serial] = node
            heappush(heap, ranks[serial])

    def discard_candidate(self, node: CachedNode) -> None:
        if self._nodes.pop(node.serial, None) is not None and len(self._heap) > 64 + 2 * len(
            self._nodes
        ):
            self._heap = [self._rank[serial] for serial in self._nodes]
            heapify(self._heap)

    def remove(self, node: CachedNode) -> None:
        self._rank.pop(node.serial, None)

    def remove_victims(self, nodes: Sequence[CachedNode]) -> None:
        remove = self.remove
        for node in nodes:
            self.chosen = node.serial  # as its pop_first left it
            remove(node)

    def candidate_heap(self) -> tuple[list[int], dict[int, CachedNode], dict[int, int]]:
        """The candidate heap's parts, for the eviction core's batched eviction
        (`kvplug.core.eviction.EvictionCore.pop_victims`), which pops and pushes entries
        as `pop_first` and `add_candidate` would: the heap of entries, the candidates by
        serial, and every ranked node's current entry by serial. Valid until the next
        `discard_candidate` (which may rebuild the heap)."""
        return self._heap, self._nodes, self._rank

    def first_candidate(self) -> CachedNode | None:
        """The next victim, or None if there is no candidate."""
        heap, nodes, ranks = self._heap, self._nodes, self._rank
        while heap:
            entry = heap[0]
            serial = entry & SERIAL_MASK
            node = nodes.get(serial)
            if node is not None and ranks[serial] == entry:
                self.chosen = serial
                return node
            heappop(heap)
        return None

    def pop_first(self) -> CachedNode | None:
        heap, nodes, ranks = self._heap, self._nodes, self._rank
        while heap:
            entry = heappop(heap)
            serial = entry & SERIAL_MASK
            node = nodes.get(serial)
            if node is not None and ranks[serial] == entry:  # current: see first_candidate
                del nodes[serial]
                self.chosen = serial
                return node
        return None

    def choose_victims(self, n: int) -> list[CachedNode]:
        if n == 1:
            first = self.first_candidate()
            return [] if first is None else [first]
        current = sorted(self._rank[serial] for serial in self._nodes)
        return [self._nodes[entry & SERIAL_MASK] for entry in current[:n]]

    def iter_ranked(self) -> Iterator[tuple[int, CachedNode]]:
        """The current candidates with their entries, lowest (evicted first) first, without
        changing anything: the heap read in order through a frontier of its positions,
        O(log n) per candidate and nothing copied. The caller changes nothing meanwhile."""
        heap, nodes, ranks = self._heap, self._nodes, self._rank
        if not heap:
            return
        frontier = [(heap[0], 0)]
        size = len(heap)
        last = -1
        while frontier:
            entry, at = heappop(frontier)
            for child in (2 * at + 1, 2 * at + 2):
                if child < size:
                    heappush(frontier, (heap[child], child))
            serial = entry & SERIAL_MASK
            node = nodes.get(serial)
            # a candidate discarded and added again has its entry in the heap twice (the
            # first copy left lazily); equal entries come out one after the other
            if node is not None and ranks[serial] == entry and entry != last:
                last = entry
                yield entry, node

    def lowest_rank(self) -> float | None:
        """The rank of the next victim, or None if there is no candidate."""
        first = self.first_candidate()
        return None if first is None else self.rank_of(first)

    def entry_of(self, node: CachedNode) -> int:
        """`node`'s place in the eviction order at its latest release (an entry of
        `kvplug.policies.entry`); a smaller entry is evicted sooner."""
        return self._rank[node.serial]

    def restore(self, node: CachedNode) -> None:
        """`node` is released again without a use: it keeps its last rank and its place
        among the nodes of that rank. Its entry gets a new release order halfway between
        the old one and the next whole one (`restored_entry`), which sorts the same
        against every other entry and makes heap entries left from before stale."""
        serial = node.serial
        self._rank[serial] = restored_entry(self._rank[serial])

    def has_rank(self, node: CachedNode) -> bool:
        """Whether `node` was ranked at a release since it was cached."""
        return node.serial in self._rank

    def rank_of(self, node: CachedNode) -> float:
        """The rank `node` was given at its latest release (it must have been released)."""
        return entry_rank(self._rank[node.serial])

    def __len__(self) -> int:
        return len(self._nodes)
