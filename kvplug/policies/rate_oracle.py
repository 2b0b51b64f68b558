"""`rate-oracle`: keep the blocks reused most often over the whole trace, value weighted.

It needs every request in advance, so, like `belady`, it exists only in trace replays: the
replay gives it `uses` (how many of the trace's requests can reuse a block). It ranks a
released block by ``uses * value`` (the prefill FLOPs the block saves at its depth), and
the leaf with the lowest rank goes first.

This is Coffman and Denning's A0 with costs: when each prefix is requested independently
at a fixed rate (the independent reference model), keeping the highest rate x value is
the best any policy that does not see the exact future can do, and the policy that also
knows every rate exactly does no worse than one that must learn them. On a trace whose
reuses arrive at random times, it bounds what an online policy that predicts *how often*
a prefix returns can reach; `belady` also knows *when*. The ranks never change, so every
operation is O(log n).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

from kvplug.errors import ConfigError
from kvplug.policies.base import RankedPolicy
from kvplug.policies.value import BlockValue

if TYPE_CHECKING:
    from kvplug.policies.node import CachedNode


class RateOraclePolicy(RankedPolicy):
    name = "rate-oracle"

    def __init__(
        self,
        uses: Callable[[CachedNode], int] | None = None,
        model: str | None = None,
        tokens_per_block: int | None = None,
    ) -> None:
        super().__init__()
        self._uses = uses
        self.value = BlockValue(model, tokens_per_block)

    def bind(self, block_size: int, num_blocks: int) -> None:
        self.value.bind(block_size)

    def set_oracle(self, uses: Callable[[CachedNode], int]) -> None:
        self._uses = uses

    def rank(self, node: CachedNode) -> float:
        if self._uses is None:
            raise ConfigError(
                "the rate-oracle policy needs every request in advance: it runs only in "
                "trace replays"
            )
        return self._uses(node) * self.value(node)
