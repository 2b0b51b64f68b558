"""GreedyDual-Size-Frequency: evict the lowest ``L + frequency * cost / size``.

`L` (the inflation) rises to each victim's priority, so a block not reused for a while
falls behind newly ranked ones: aging driven by the eviction rate, with no constant.
Cost is the block's prefill FLOPs; every block has the same size, so it drops out.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from kvplug.policies.base import RankedPolicy
from kvplug.policies.entry import entry_rank
from kvplug.policies.value import BlockValue

if TYPE_CHECKING:
    from kvplug.policies.node import CachedNode


class GDSFPolicy(RankedPolicy):
    name = "gdsf"
    values_position = True  # `value` grows with depth
    reads_keys = False

    def __init__(self, model: str | None = None, tokens_per_block: int | None = None) -> None:
        super().__init__()
        self.value = BlockValue(model, tokens_per_block)
        self.inflation = 0.0

    def bind(self, block_size: int, num_blocks: int) -> None:
        self.value.bind(block_size)

    def rank(self, node: CachedNode) -> float:
        return self.inflation + (node.hits + 1) * self.value(node)

    def remove(self, node: CachedNode) -> None:
        ranked = self._rank.get(node.serial)
        if ranked is not None and node.serial == self.chosen:  # the policy's own victim
            self.inflation = max(self.inflation, entry_rank(ranked))
        super().remove(node)
