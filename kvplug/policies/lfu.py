"""Least frequently used first; among equals, least recently released."""

from __future__ import annotations

from typing import TYPE_CHECKING

from kvplug.policies.base import RankedPolicy

if TYPE_CHECKING:
    from kvplug.policies.node import CachedNode


class LFUPolicy(RankedPolicy):
    name = "lfu"
    reads_keys = False

    def rank(self, node: CachedNode) -> float:
        return float(node.hits)
