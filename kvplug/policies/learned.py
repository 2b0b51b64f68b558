"""`learned`: the `cost` policy's online reuse classes, refereed by a sampled duel with LRU.

The ranking is `cost`'s GreedyDual rule, `L + credit` with `credit = (1 + w * min(reuses, 3))
* P(reuse | class) * value`, where `P` is learned per class from hits and ghost returns
(see `kvplug.policies.cost`). What `learned` adds is a referee, so that a workload the
classes mislead never does worse than LRU:

- Two shadow caches (`ShadowCache`, in the policy's `duel`: a
  `kvplug.policies.shadow.ShadowDuel`, compiled where kvplug was built with a compiler)
  replay the same accesses and releases on a sample of the keys (one in
  `2**sample_shift`, the largest power of two that leaves each shadow at least
  `shadow_blocks` blocks), each with that share of the capacity. One ranks by the learned
  credit, the other by release order (LRU).
- Each counts the prefill value of its hits, decayed by half every `window` sampled
  accesses (by default eight shadow capacities: short windows flip on noise). While the
  LRU shadow is ahead by more than `margin`, the real cache ranks new releases in release
  order (`L` plus the running mean of learned credits, never below the last such rank, so
  the two kinds of rank stay on one scale); otherwise it ranks them by the learned credit.

The shadows ignore the prefix tree (a deep block can hit while its parent missed), so
they referee gross differences, not fine ones; the replay table says where that matters.
Everything is O(log n) per operation; the shadows add one dict operation and at most one
heap operation per sampled access. `explain()` returns the learned state: the mode, the
shadows' scores and the class table.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from kvplug.policies.base import RankedPolicy
from kvplug.policies.cost import DEFAULT_FREQUENCY_WEIGHT, CostPolicy
from kvplug.policies.entry import make_entry
from kvplug.policies.shadow import ShadowDuel, sampled

if TYPE_CHECKING:
    from kvplug.policies.node import CachedNode


class LearnedPolicy(CostPolicy):
    name = "learned"

    def __init__(
        self,
        model: str | None = None,
        tokens_per_block: int | None = None,
        ghost_ratio: float = 2.0,
        shadow_blocks: int = 1024,
        window: int = 0,
        margin: float = 0.0,
        frequency_weight: float = DEFAULT_FREQUENCY_WEIGHT,
        tier_pricing: bool = True,
        host_link_gbps: float = 25.0,
        prefill_tflops: float = 400.0,
    ) -> None:
        super().__init__(
            model,
            tokens_per_block,
            ghost_ratio,
            frequency_weight,
            tier_pricing,
            host_link_gbps,
            prefill_tflops,
        )
        self.shadow_blocks = shadow_blocks
        self.sample_shift = 0  # set by `bind`: sample one key in 2**sample_shift
        self._mean_credit = 1.0
        self._lru_rank = 0.0  # the last rank given in LRU mode
        self.duel = ShadowDuel(1, window, margin)

    def bind(self, block_size: int, num_blocks: int) -> None:
        super().bind(block_size, num_blocks)
        self.sample_shift = max(0, (num_blocks // max(1, self.shadow_blocks)).bit_length() - 1)
        capacity = max(1, num_blocks >> self.sample_shift)
        self.duel.resize(capacity)
        if not self.duel.window:
            self.duel.window = max(256, 8 * capacity)

    @property
    def use_learned(self) -> bool:
        """Whether releases are ranked by the learned credit (else in release order)."""
        return self.duel.use_learned

    @property
    def switches(self) -> int:
        return self.duel.switches

    def rank(self, node: CachedNode) -> float:
        credit = self.credit(node)
        self._mean_credit += (credit - self._mean_credit) / 1024
        if sampled(node.key, self.sample_shift):
            self.duel.release(node.key, credit)
        if self.duel.use_learned:
            return self.inflation + credit
        # release order: never below an earlier LRU-like rank, though the mean moves
        self._lru_rank = max(self._lru_rank, self.inflation + self._mean_credit)
        return self._lru_rank

    def release_n(self, nodes: Sequence[CachedNode]) -> None:
        """`rank` for each of `nodes`, in order, with the credits computed in one pass
        (nothing a credit reads changes in between: the shadows only record)."""
        own = type(self)
        if own.rank is not LearnedPolicy.rank or own.credit is not CostPolicy.credit:
            RankedPolicy.release_n(self, nodes)
            return
        ranks, releases, shift = self._rank, self._releases, self.sample_shift
        inflation, mean, duel = self.inflation, self._mean_credit, self.duel
        use_learned = duel.use_learned  # (a release never moves the referee)
        for node, credit in zip(nodes, self._credits(nodes), strict=True):
            mean += (credit - mean) / 1024
            key = node.key
            if sampled(key, shift):
                duel.release(key, credit)
            if use_learned:
                rank = inflation + credit
            else:
                self._lru_rank = rank = max(self._lru_rank, inflation + mean)
            serial = node.serial
            ranks[serial] = make_entry(rank, next(releases), serial)
        self._mean_credit = mean

    def insert_n(self, nodes: Sequence[CachedNode]) -> None:
        """`insert` for each of `nodes`: the ghosts' returns, then the shadows' accesses
        (neither reads what the other changes)."""
        if type(self).insert is not LearnedPolicy.insert:
            RankedPolicy.insert_n(self, nodes)
            return
        self._ghosts_return(nodes)
        for node in nodes:
            self._shadow_access(node)

    def tier_changed(self, node: CachedNode, evictable: bool) -> None:
        if self.duel.use_learned:  # in release order, a tier changes nothing
            super().tier_changed(node, evictable)
        elif self.prices_tiers:
            self._tiers_seen = True

    def insert(self, node: CachedNode) -> None:
        super().insert(node)
        self._shadow_access(node)

    def hit(self, node: CachedNode) -> None:
        super().hit(node)
        self._shadow_access(node)

    def _shadow_access(self, node: CachedNode) -> None:
        if sampled(node.key, self.sample_shift):
            self.shadow_access(node.key, node.depth)

    def shadow_access(self, key: Any, depth: int) -> None:
        """A sampled `key`, at `depth`, was accessed: both shadows see it, and every
        `window` sampled accesses the referee chooses the ranking."""
        self.duel.access(key, self.value.at_depth(depth))

    def explain(self) -> dict[str, Any]:
        """The learned state: which ranking is in use, the shadows' scores, the classes."""
        return {
            "ranking": "learned" if self.duel.use_learned else "lru",
            "switches": self.duel.switches,
            "shadow_saved": {"learned": self.duel.learned.saved, "lru": self.duel.lru.saved},
            "classes": {str(cls): row for cls, row in sorted(self.learned().items())},
        }
