"""Least recently released first, the order of vLLM's free-block queue.

vLLM frees a request's blocks tail first, so among blocks released together the tail
of a chain goes before its head. The cache releases blocks in that order too, so the
release sequence number alone gives vLLM's order.
"""

from __future__ import annotations

from itertools import count, islice
from typing import TYPE_CHECKING

from sortedcontainers import SortedList

from kvplug.policies.base import EvictionPolicy

if TYPE_CHECKING:
    from kvplug.index import Node


class LRUPolicy(EvictionPolicy):
    name = "lru"

    def __init__(self) -> None:
        self._clock = count()
        self._released_at: dict[int, int] = {}  # node serial -> release sequence number
        self._candidates: SortedList[tuple[int, int]] = SortedList()  # (released_at, serial)
        self._nodes: dict[int, Node] = {}

    def release(self, node: Node) -> None:
        self._released_at[node.serial] = next(self._clock)

    def add_candidate(self, node: Node) -> None:
        self._candidates.add((self._released_at[node.serial], node.serial))
        self._nodes[node.serial] = node

    def discard_candidate(self, node: Node) -> None:
        if self._nodes.pop(node.serial, None) is not None:
            self._candidates.remove((self._released_at[node.serial], node.serial))

    def remove(self, node: Node) -> None:
        self._released_at.pop(node.serial, None)

    def choose_victims(self, n: int) -> list[Node]:
        return [self._nodes[serial] for _, serial in islice(self._candidates, n)]

    def __len__(self) -> int:
        return len(self._candidates)
