"""The interface between the cache and an eviction policy.

The cache owns the prefix index and the block lifecycle; a policy only ranks. The cache
tells the policy what happened to an index node, and asks it which evictable leaves to
evict and whether a new block is worth admitting.

Candidates. A node is an eviction *candidate* while it is in the index, held by no
request (state EVICTABLE) and has no children in the index (a leaf). The cache keeps the
policy's candidate set exact with `add_candidate` / `discard_candidate`, so evicting only
candidates keeps the index prefix-closed. `choose_victims` returns candidates and must not
change anything: the cache removes them and reports each with `remove`.

Every method must run in O(log n) or better (amortised) in the number of cached blocks.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from heapq import heapify, heappop, heappush
from itertools import count
from typing import TYPE_CHECKING, ClassVar

if TYPE_CHECKING:
    from kvplug.core.index import Node


class EvictionPolicy(ABC):
    """One eviction strategy. Subclasses set `name` and implement the three abstract methods."""

    name: ClassVar[str]

    def bind(self, block_size: int, num_blocks: int) -> None:
        """Called once by the cache that uses the policy."""

    def admit(self, node: Node) -> bool:
        """Return False to keep a new block out of the index (it is then freed with its request)."""
        return True

    def insert(self, node: Node) -> None:
        """`node` was just published into the index."""

    def hit(self, node: Node) -> None:
        """A lookup reused `node`."""

    def release(self, node: Node) -> None:
        """The last request holding `node` let go of it; it is now evictable.

        `node.from_end` (blocks of that request after this one) and `node.request_hit`
        (whether that request reused cached blocks) describe the release.
        """

    def remove(self, node: Node) -> None:
        """`node` left the index (evicted or invalidated). It is never a candidate again."""

    @abstractmethod
    def add_candidate(self, node: Node) -> None:
        """`node` became an evictable leaf."""

    @abstractmethod
    def discard_candidate(self, node: Node) -> None:
        """`node` stopped being an evictable leaf (it was hit, grew a child, or is leaving)."""

    @abstractmethod
    def choose_victims(self, n: int) -> list[Node]:
        """Up to `n` distinct current candidates, the first to evict first. Changes nothing."""

    @abstractmethod
    def __len__(self) -> int:
        """The number of current candidates."""


class RankedPolicy(EvictionPolicy):
    """A policy that ranks each node with one number when it is released (lowest evicted
    first) and keeps its candidates in a binary heap: O(log n) per operation.

    Subclasses implement `rank`; ties go to the node released first. Discarding a
    candidate only forgets it; its heap entry is dropped when it reaches the top (an
    entry is current while its node is a candidate released with that rank and order),
    and the heap is rebuilt when stale entries outnumber current ones.
    """

    def __init__(self) -> None:
        self._rank: dict[int, tuple[float, int]] = {}  # serial -> (rank, release order)
        self._heap: list[tuple[float, int, int]] = []  # (rank, release order, serial)
        self._nodes: dict[int, Node] = {}  # serial -> node, for current candidates
        self._releases = count()

    @abstractmethod
    def rank(self, node: Node) -> float:
        """The node's standing when released: lower is evicted sooner."""

    def release(self, node: Node) -> None:
        self._rank[node.serial] = (self.rank(node), next(self._releases))

    def add_candidate(self, node: Node) -> None:
        rank, order = self._rank[node.serial]
        self._nodes[node.serial] = node
        heappush(self._heap, (rank, order, node.serial))

    def discard_candidate(self, node: Node) -> None:
        if self._nodes.pop(node.serial, None) is not None and len(self._heap) > 64 + 2 * len(
            self._nodes
        ):
            self._heap = [(*self._rank[serial], serial) for serial in self._nodes]
            heapify(self._heap)

    def remove(self, node: Node) -> None:
        self._rank.pop(node.serial, None)

    def first_candidate(self) -> Node | None:
        """The next victim, or None if there is no candidate."""
        heap, nodes, ranks = self._heap, self._nodes, self._rank
        while heap:
            rank, order, serial = heap[0]
            if serial in nodes and ranks[serial] == (rank, order):
                return nodes[serial]
            heappop(heap)
        return None

    def choose_victims(self, n: int) -> list[Node]:
        if n == 1:
            first = self.first_candidate()
            return [] if first is None else [first]
        current = sorted((*self._rank[serial], serial) for serial in self._nodes)
        return [self._nodes[serial] for *_, serial in current[:n]]

    def lowest_rank(self) -> float | None:
        """The rank of the next victim, or None if there is no candidate."""
        first = self.first_candidate()
        return None if first is None else self._rank[first.serial][0]

    def __len__(self) -> int:
        return len(self._nodes)
