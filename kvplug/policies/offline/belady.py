"""Belady's offline policy: evict the leaf whose next use lies farthest in the future.

It needs the future, so it exists only in trace replays: the replay gives it `next_use`
(the index of the next request that can reuse a block, or infinity) and advances its
clock. On a prefix tree, leaf-first Belady is not provably optimal, but it shows the
headroom an online policy could still win.
"""

from __future__ import annotations

from bisect import bisect_right
from collections.abc import Callable, Hashable, Mapping, Sequence
from typing import TYPE_CHECKING

from kvplug.errors import ConfigError
from kvplug.policies.base import RankedPolicy

if TYPE_CHECKING:
    from kvplug.policies.node import CachedNode


class BeladyPolicy(RankedPolicy):
    name = "belady"
    offline = True

    def __init__(self, next_use: Callable[[CachedNode, int], float] | None = None) -> None:
        super().__init__()
        self._next_use = next_use
        self.now = 0  # the replay's clock: index of the request being admitted

    def set_oracle(self, next_use: Callable[[CachedNode, int], float]) -> None:
        self._next_use = next_use

    def foresee(self, requests: Mapping[Hashable, Sequence[int]]) -> None:
        def next_use(node: CachedNode, now: int) -> float:
            times = requests.get(node.key)
            if not times:
                return float("inf")
            i = bisect_right(times, now)
            return times[i] if i < len(times) else float("inf")

        self.set_oracle(next_use)

    def rank(self, node: CachedNode) -> float:
        if self._next_use is None:
            raise ConfigError("the belady policy needs the future: it runs only in trace replays")
        return -self._next_use(node, self.now)
