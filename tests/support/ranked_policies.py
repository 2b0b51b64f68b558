"""Ranked policies for tests that must tell kvplug's order from vLLM's release order."""

from __future__ import annotations

from itertools import count
from typing import Any

from kvplug.policies.base import RankedPolicy
from kvplug.policies.lru import LRUPolicy


class NewestFirst(RankedPolicy):
    """The reverse of vLLM's order: the block released last goes first (ties of rank
    break by release, oldest first, so the rank must decide)."""

    name = "newest-first"

    def __init__(self) -> None:
        super().__init__()
        self._released = count()

    def rank(self, node: Any) -> float:
        return -float(next(self._released))


class TrackedLRU(LRUPolicy):
    """kvplug's lru ranked through the eviction core: the pool only skips the core (its
    untracked fast path) for `LRUPolicy` itself."""

    name = "tracked-lru"
    release_order = False  # ranked through the eviction core like any other policy
