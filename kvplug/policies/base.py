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
from typing import TYPE_CHECKING, ClassVar

if TYPE_CHECKING:
    from kvplug.index import Node


class EvictionPolicy(ABC):
    """One eviction strategy. Subclasses set `name` and implement the three abstract methods."""

    name: ClassVar[str]

    def admit(self, node: Node) -> bool:
        """Return False to keep a new block out of the index (it is then freed with its request)."""
        return True

    def insert(self, node: Node) -> None:
        """`node` was just published into the index."""

    def hit(self, node: Node) -> None:
        """A lookup reused `node`."""

    def release(self, node: Node) -> None:
        """The last request holding `node` let go of it; it is now evictable."""

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
