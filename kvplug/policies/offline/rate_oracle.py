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

`returning-oracle` knows less: a prefix's count only once it has returned (a second
request has reached it); until then, the trace's mean count per prefix. It tells how much
of `rate-oracle`'s gain needs only the future of prefixes already seen coming back, which
is what an online policy could hope to estimate from their past.
"""

from __future__ import annotations

from bisect import bisect_right
from collections.abc import Callable, Hashable, Mapping, Sequence
from typing import TYPE_CHECKING

from kvplug.errors import ConfigError
from kvplug.policies.base import RankedPolicy
from kvplug.policies.value import BlockValue

if TYPE_CHECKING:
    from kvplug.policies.node import CachedNode


class RateOraclePolicy(RankedPolicy):
    name = "rate-oracle"
    offline = True

    def __init__(
        self,
        uses: Callable[[CachedNode], float] | None = None,
        model: str | None = None,
        tokens_per_block: int | None = None,
    ) -> None:
        super().__init__()
        self._uses = uses
        self._requests: Mapping[Hashable, Sequence[int]] = {}
        self.value = BlockValue(model, tokens_per_block)

    def bind(self, block_size: int, num_blocks: int) -> None:
        self.value.bind(block_size)

    def set_oracle(self, uses: Callable[[CachedNode], float]) -> None:
        self._uses = uses

    def foresee(self, requests: Mapping[Hashable, Sequence[int]]) -> None:
        """A block's count is its number of requests."""
        self._requests = requests
        self.set_oracle(lambda node: len(requests.get(node.key, ())))

    def rank(self, node: CachedNode) -> float:
        if self._uses is None:
            raise ConfigError(
                "the rate-oracle policy needs every request in advance: it runs only in "
                "trace replays"
            )
        return self._uses(node) * self.value(node)


class ReturningOraclePolicy(RateOraclePolicy):
    """`rate-oracle` that knows a prefix's count only after it has returned (module doc).

    The replay gives it, per block key, the indices of the requests that reach it
    (`foresee`) and advances `now`, the index of the request being admitted. A block
    ranks as ``uses * value``, where ``uses`` is its count over the whole trace if at least
    two requests up to `now` reached it, else the mean count of the trace's keys (each key
    passes through "reached once" exactly once, so this is the expected count given what
    is known)."""

    name = "returning-oracle"

    def __init__(self, model: str | None = None, tokens_per_block: int | None = None) -> None:
        super().__init__(None, model, tokens_per_block)
        self.now = 0
        self.prior = 1.0

    def foresee(self, requests: Mapping[Hashable, Sequence[int]]) -> None:
        self._requests = requests
        counts = [len(indices) for indices in requests.values()]
        self.prior = sum(counts) / len(counts) if counts else 1.0
        self.set_oracle(self.known_uses)

    def known_uses(self, node: CachedNode) -> float:
        indices = self._requests.get(node.key, ())
        return len(indices) if bisect_right(indices, self.now) >= 2 else self.prior
