"""Least recently released first, the order of vLLM's free-block queue.

vLLM frees a request's blocks tail first, so among blocks released together the tail
of a chain goes before its head. The cache releases blocks in that order too, so the
release order alone gives vLLM's order.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from kvplug.policies.base import RankedPolicy

if TYPE_CHECKING:
    from kvplug.policies.node import CachedNode


class LRUPolicy(RankedPolicy):
    name = "lru"

    def rank(self, node: CachedNode) -> float:
        return 0.0  # ties are broken by release order
