"""Least recently used first: the order of vLLM's free-block queue, and of SGLang's lru.

vLLM orders blocks by when they were freed: it frees a request's blocks tail first, so
among blocks released together the tail of a chain goes before its head. The cache
releases blocks in that order too, so the release order alone gives vLLM's order.

SGLang orders nodes by their last access, and a node held by a request keeps the place
its last access gave it. Its adapter reports every access (`touch`), so a node released
after being accessed takes its place from that access, not from the release. With no
`touch` (vLLM, kvplug's own cache) the order is the release order.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

from kvplug.policies.base import RankedPolicy
from kvplug.policies.entry import make_entry

if TYPE_CHECKING:
    from kvplug.policies.node import CachedNode


class LRUPolicy(RankedPolicy):
    name = "lru"
    reads_keys = False
    release_order = True  # with no `touch`, its order is the release order

    def __init__(self) -> None:
        super().__init__()
        self._accessed: dict[int, int] = {}  # serial -> order of its latest touch

    def rank(self, node: CachedNode) -> float:
        return 0.0  # ties are broken by release order

    def touch(self, node: CachedNode) -> None:
        self._accessed[node.serial] = next(self._releases)

    def release(self, node: CachedNode) -> None:
        order = self._accessed.get(node.serial)
        if order is None:
            super().release(node)
        else:
            self._rank[node.serial] = make_entry(0.0, order, node.serial)

    def release_n(self, nodes: Sequence[CachedNode]) -> None:
        if not self._accessed:
            super().release_n(nodes)
            return
        for node in nodes:
            self.release(node)

    def remove(self, node: CachedNode) -> None:
        super().remove(node)
        self._accessed.pop(node.serial, None)
