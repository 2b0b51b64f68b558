"""Least frequently used first; among equals, least recently released."""

from __future__ import annotations

from typing import TYPE_CHECKING

from kvplug.policies.base import RankedPolicy

if TYPE_CHECKING:
    from kvplug.core.index import Node


class LFUPolicy(RankedPolicy):
    name = "lfu"

    def rank(self, node: Node) -> float:
        return float(node.hits)
