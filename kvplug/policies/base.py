"""The interface between the cache and an eviction policy.

The cache owns the prefix index and the block lifecycle; a policy only ranks. The cache
tells the policy what happened to an index node, and asks it which evictable leaves to
evict and whether a new block is worth admitting.

Candidates. A node is an eviction *candidate* while it is in the index, held by no
request (state EVICTABLE) and has no children in the index (a leaf). The cache keeps the
policy's candidate set exact with `add_candidate` / `discard_candidate`, so evicting only
candidates keeps the index prefix-closed. `choose_victims` returns candidates and must not
change anything: the cache removes them and reports each with `remove`.

Every method must run in O(log n) or better in the number of cached blocks.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from itertools import count, islice
from typing import TYPE_CHECKING, ClassVar

from sortedcontainers import SortedList

if TYPE_CHECKING:
    from kvplug.index import Node


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
    first) and keeps its candidates in a sorted list: O(log n) per operation.

    Subclasses implement `rank`; ties go to the node released first.
    """

    def __init__(self) -> None:
        self._rank: dict[int, tuple[float, int]] = {}  # serial -> (rank, release order)
        self._candidates: SortedList[tuple[tuple[float, int], int]] = SortedList()
        self._nodes: dict[int, Node] = {}
        self._releases = count()

    @abstractmethod
    def rank(self, node: Node) -> float:
        """The node's standing when released: lower is evicted sooner."""

    def release(self, node: Node) -> None:
        self._rank[node.serial] = (self.rank(node), next(self._releases))

    def add_candidate(self, node: Node) -> None:
        self._candidates.add((self._rank[node.serial], node.serial))
        self._nodes[node.serial] = node

    def discard_candidate(self, node: Node) -> None:
        if self._nodes.pop(node.serial, None) is not None:
            self._candidates.remove((self._rank[node.serial], node.serial))

    def remove(self, node: Node) -> None:
        self._rank.pop(node.serial, None)

    def choose_victims(self, n: int) -> list[Node]:
        return [self._nodes[serial] for _, serial in islice(self._candidates, n)]

    def lowest_rank(self) -> float | None:
        """The rank of the next victim, or None if there is no candidate."""
        return self._candidates[0][0][0] if self._candidates else None

    def __len__(self) -> int:
        return len(self._candidates)
