"""The cost-aware scoring evictor: keep what saves the most prefill compute per byte.

When a block becomes evictable it is ranked by GreedyDual's rule,

    H = L + (1 + w * min(reuses, 3)) * P(reuse | class) * value / bytes

and the evictable leaf with the lowest H goes first.

- `value` is the prefill FLOPs its tokens would cost again at its depth (`BlockValue`);
  every block has the same size, so bytes only scale the score.
- `P(reuse | class)` is learned online. A block's class is what the cache knows when it is
  released: how often it has been reused (1, 2, 3+), or, if never, how close it sits to
  the end of its request (0, 1, 2, 3+ blocks after it) and whether that request reused
  the cache; and, for both, how many tokens that request generated (log2 buckets; requests
  that end in a short answer, such as agent and tool steps, tend to be continued) and
  whether it named a session (a conversation or user id its client sent: a session's
  turn tends to be followed by its next; a request that names none is in the same
  classes as before sessions were known, so a workload without them is ranked as
  without this field). Each
  release opens a trial for the block's class. A hit closes it as reused. An eviction
  moves the block's key to a ghost history: a later re-insert closes the trial as reused
  and gives the block its reuse count back; falling out of the history closes it as not.
- `reuses`, its hits since it entered the cache (saturating at 3, like the classes), is
  GreedyDual-Size-Frequency's frequency term: of two blocks with the same odds, the one
  reused more is more often right. Its weight `w` (`frequency_weight`, 0.5 by default)
  sets how much: the class already conditions `P` on the reuses, so `w` counts them a
  second time, and at 0 the credit is the odds alone. At 1 (GDSF's own term) the blocks
  of finished conversations, reused at each of their turns, outrank a new conversation's
  first turn where the cache holds every live one; 0.5 keeps most of the term's gain
  where the cache is short (docs: policies).
- `L` is the inflation: it rises to each victim's H (a block the policy chose), so every
  score decays relative to newly ranked blocks at the pace at which the workload evicts.
  No half-life is set.
  Ranks never change once given (but for the tier rule below), so every operation is
  O(log n).

Tiers. A block another tier holds (``held_elsewhere``: a CPU offload or LMCache copied it
out, or it was loaded from there) costs only a reload if evicted, so with `tier_pricing`
(on by default) its `value` is ``min(recompute, reload)``, the reload priced by
`kvplug.policies.reload.HostLink` (`host_link_gbps`, `prefill_tflops`). When a block
becomes held elsewhere while evictable, it is re-ranked at once (`tier_changed`) to the
lower of its rank and the rank it would get now; a rank is never raised by a tier.

Nodes of several blocks. An engine whose nodes each hold several blocks (SGLang's radix
tree: a node spans many pages) sets `spans_blocks`; each node's ``blocks`` then weighs
what it teaches, so that the policy learns per block, as in a cache of blocks: a closed
trial counts its node's blocks, a ghost stands for the blocks its node held, and the
ghost history holds `ghost_ratio` times the cache's blocks, not nodes. Such an engine
keys a node by its prefix up to its last block, whatever the node's boundaries, and
reports the keys of the blocks a new node holds before its last (`ghosts_inside`): a
victim's prefix that comes back inside a longer node is recognised as a return.

A shared root is never a candidate while it has children, and its own H ages like any
other, so hits below it do not make it immortal. Admission is the same test: a released
block enters the ranking at its own H, so a block worth less than everything cached is
the next victim and pushes out nothing better.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence
from heapq import heappush
from typing import TYPE_CHECKING

from kvplug.errors import ConfigError
from kvplug.policies.base import RankedPolicy
from kvplug.policies.entry import (
    DOUBLE,
    KEY_MASK,
    RANK_SHIFT,
    SIGN_BIT,
    WHOLE_ORDER_SHIFT,
    entry_rank,
    key_rank,
    make_entry,
    rank_key,
)
from kvplug.policies.reload import HostLink
from kvplug.policies.value import BlockValue

if TYPE_CHECKING:
    from kvplug.core.model_spec import ModelSpec
    from kvplug.policies.node import CachedNode

ReuseClass = tuple[int, ...]

DEFAULT_FREQUENCY_WEIGHT = 0.5  # `w`, see above

# a ghost is ``(blocks - 1) << BLOCKS_SHIFT | reuses << 10 | class code`` (blocks: those
# its node held; always 1, and so absent, unless the policy `spans_blocks`)
BLOCKS_SHIFT = 40
REUSES_MASK = (1 << (BLOCKS_SHIFT - 10)) - 1


def ghost_blocks(ghost: int) -> int:
    """The blocks the node a ghost stands for held."""
    return (ghost >> BLOCKS_SHIFT) + 1


def ghost_reuses(ghost: int) -> int:
    """The reuses a ghost remembers."""
    return (ghost >> 10) & REUSES_MASK


class CostPolicy(RankedPolicy):
    name = "cost"
    values_position = True  # `value` grows with depth

    def __init__(
        self,
        model: str | ModelSpec | None = None,
        tokens_per_block: int | None = None,
        ghost_ratio: float = 2.0,
        frequency_weight: float = DEFAULT_FREQUENCY_WEIGHT,
        tier_pricing: bool = True,
        host_link_gbps: float = 25.0,
        prefill_tflops: float = 400.0,
    ) -> None:
        super().__init__()
        if not isinstance(tier_pricing, bool):
            raise ConfigError(f"tier_pricing must be true or false, got {tier_pricing!r}")
        if not isinstance(frequency_weight, int | float) or not frequency_weight >= 0:
            raise ConfigError(
                f"frequency_weight must be a number >= 0 (1: GDSF's frequency term, 0: none), "
                f"got {frequency_weight!r}"
            )
        self.value = BlockValue(model, tokens_per_block)
        self.ghost_ratio = ghost_ratio
        self.frequency_weight = frequency_weight
        self.prices_tiers = tier_pricing
        self.host_link = HostLink(host_link_gbps, prefill_tflops)
        self._reload: float | None = None  # `value.reload(host_link)`, once bound
        self._tiers_seen = False  # a block was ever held elsewhere (then `_credits` looks)
        self.inflation = 0.0
        self._inflation_key = rank_key(0.0)  # `inflation`'s key (`kvplug.policies.entry`)
        # Classes travel as small int codes (see `credit`), hashed and stored with no
        # tuple made per release; `_classes` names each code's class.
        self._classes: dict[int, ReuseClass] = {}
        self._trial: dict[int, int] = {}  # serial -> class code of its open trial
        self._credit: dict[int, int] = {}  # serial -> reuses remembered from its ghost
        # key -> reuses << 10 | class code (codes are below 1024): an int, not a tuple,
        # so a ghost allocates nothing the garbage collector tracks
        self._ghosts: OrderedDict[bytes, int] = OrderedDict()
        self._ghost_capacity = 0
        # nodes hold several blocks each (`node.blocks`), weighing trials and ghosts
        self.spans_blocks = False
        self._ghost_blocks = 0  # blocks the ghosts stand for, while `spans_blocks`
        # closed trials and reuses per class code (codes are below 1024)
        self._tried: list[int] = [0] * 1024
        self._reused: list[int] = [0] * 1024
        # code -> reuse_probability(its class), while no trial of it closed since
        self._probability: dict[int, float] = {}
        # whether `rank` is this class's own (then `release_n` ranks a batch in one loop)
        own = type(self)
        self._own_rank = own.rank is CostPolicy.rank and own.credit is CostPolicy.credit
        self._own_remove = own.remove is CostPolicy.remove
        self._own_insert = own.insert is CostPolicy.insert
        self._own_hit = own.hit is CostPolicy.hit

    def bind(self, block_size: int, num_blocks: int) -> None:
        self.value.bind(block_size)
        self._ghost_capacity = int(self.ghost_ratio * num_blocks)

    def reuse_probability(self, code: int) -> float:
        """Laplace-smoothed share of closed trials in the class with this code that ended
        in a reuse."""
        return (self._reused[code] + 1) / (self._tried[code] + 2)

    def _name_class(self, code: int, node: CachedNode) -> None:
        """Remember that `code` stands for `node`'s class (the first time it is seen)."""
        if code not in self._classes:
            self._classes[code] = self.classify(node)

    def reuses(self, node: CachedNode) -> int:
        return node.hits + self._credit.get(node.serial, 0)

    def classify(self, node: CachedNode) -> ReuseClass:
        hits = self.reuses(node)
        output = min(node.request_output.bit_length(), 12)
        session = int(node.request_session)
        if hits:
            return (min(hits, 3), output, session)
        return (0, min(node.from_end, 3), int(node.request_hit), output, session)

    def credit(self, node: CachedNode) -> float:
        """GreedyDual's credit for `node`, opening its class's trial."""
        return self._credits((node,))[0]

    def _credits(
        self, nodes: Sequence[CachedNode], entries: dict[int, int] | None = None
    ) -> list[float]:
        """`credit` for each of `nodes`, in order: the hot path of every release. With
        `entries`, each node's release entry (`release`'s) is written there instead, and
        nothing is returned.

        `classify`, `reuses` and `reuse_probability` are inlined here and must stay in
        step with them. A class is computed as an int code, one per class (reused:
        ``reuses << 8 | session << 7 | output``; never reused: ``session << 7 |
        (from_end << 1 | request_hit) << 4 | output``, below 256), and its probability
        read from a cache."""
        credit_of, trial, cached = self._credit, self._trial, self._probability
        by_depth = self.value.by_depth
        deepest = len(by_depth)
        weight = self.frequency_weight
        reload = self.reload_value() if self._tiers_seen else None
        credits: list[float] = []
        releases, inflation = self._releases, self.inflation
        pack, from_bytes = DOUBLE.pack, int.from_bytes
        for node in nodes:
            serial, hits = node.serial, node.hits
            reuses = hits + credit_of.get(serial, 0) if credit_of else hits
            output = node.request_output.bit_length()
            if output > 12:
                output = 12
            if node.request_session:
                output |= 128
            if reuses:
                code = (reuses if reuses < 3 else 3) << 8 | output
            else:
                from_end = node.from_end
                code = ((from_end if from_end < 3 else 3) << 1 | bool(node.request_hit)) << 4
                code |= output
            trial[serial] = code
            probability = cached.get(code)
            if probability is None:
                self._name_class(code, node)
                probability = cached[code] = self.reuse_probability(code)
            depth = node.depth
            value = by_depth[depth] if depth < deepest else self.value(node)
            if reload is not None and node.held_elsewhere and value > reload:
                value = reload
            credit = (1 + weight * (hits if hits < 3 else 3)) * probability * value
            if entries is None:
                credits.append(credit)
                continue
            # make_entry(inflation + credit, next(releases), serial), inlined
            bits = from_bytes(pack(inflation + credit + 0.0), "little")
            key = bits ^ KEY_MASK if bits & SIGN_BIT else bits | SIGN_BIT
            entries[serial] = key << RANK_SHIFT | next(releases) << WHOLE_ORDER_SHIFT | serial
        return credits

    def rank(self, node: CachedNode) -> float:
        return self.inflation + self.credit(node)

    def reload_value(self) -> float:
        """What a block held elsewhere costs to bring back, in `value`'s units."""
        if self._reload is None:
            self._reload = self.value.reload(self.host_link)
        return self._reload

    def tier_changed(self, node: CachedNode, evictable: bool) -> None:
        if not self.prices_tiers:
            return
        self._tiers_seen = True
        serial = node.serial
        entry = self._rank.get(serial)
        if entry is None or not evictable or not node.held_elsewhere:
            return
        rank = self.rank(node)
        if rank >= entry_rank(entry):
            return
        entry = self._rank[serial] = make_entry(rank, next(self._releases), serial)
        if serial in self._nodes:  # a candidate: its old heap entry is stale now
            heappush(self._heap, entry)

    def release_n(self, nodes: Sequence[CachedNode]) -> None:
        if not self._own_rank:  # a subclass ranks differently: one node at a time
            super().release_n(nodes)
            return
        self._credits(nodes, self._rank)

    @property
    def ghost_capacity(self) -> int:
        return self._ghost_capacity

    def insert(self, node: CachedNode) -> None:
        ghost = self._ghosts.pop(node.key, None)
        if ghost is not None:  # evicted, and wanted again: it was reused after all
            self._returned(node, ghost)

    def _returned(self, node: CachedNode, ghost: int) -> None:
        """`node` came back as `ghost` (popped): its trial closes as reused and `node`
        takes its reuses back (the most, of several ghosts inside one node)."""
        blocks = 1
        if self.spans_blocks:
            blocks = ghost_blocks(ghost)
            self._ghost_blocks -= blocks
        self._close(ghost & 1023, True, blocks)
        reuses = ghost_reuses(ghost) + 1
        if reuses > self._credit.get(node.serial, 0):
            self._credit[node.serial] = reuses

    def ghosts_inside(self, node: CachedNode, keys: Sequence[bytes]) -> None:
        """`node`, just inserted, holds the blocks keyed `keys` before its last (an
        engine node of several blocks, keyed by its prefix at each block): each found in
        the ghost history came back (see `insert`)."""
        ghosts = self._ghosts
        if not ghosts:
            return
        for key in keys:
            ghost = ghosts.pop(key, None)
            if ghost is not None:
                self._returned(node, ghost)

    def insert_n(self, nodes: Sequence[CachedNode]) -> None:
        if self._own_insert:
            self._ghosts_return(nodes)
        else:  # a subclass inserts differently: one node at a time
            super().insert_n(nodes)

    def _ghosts_return(self, nodes: Sequence[CachedNode]) -> None:
        """`CostPolicy.insert` for each of `nodes`, in order, in one loop."""
        ghosts = self._ghosts
        if not ghosts:
            return
        forget = ghosts.pop
        for node in nodes:
            ghost = forget(node.key, None)
            if ghost is not None:
                self._returned(node, ghost)

    def hit(self, node: CachedNode) -> None:
        code = self._trial.pop(node.serial, None)
        if code is not None:
            self._close(code, True, node.blocks if self.spans_blocks else 1)

    def hit_n(self, nodes: Sequence[CachedNode]) -> None:
        if not self._own_hit or self.spans_blocks:  # one node at a time
            super().hit_n(nodes)
            return
        trials, tried, reused, probability = (
            self._trial,
            self._tried,
            self._reused,
            self._probability,
        )
        for node in nodes:  # `hit`, inlined
            code = trials.pop(node.serial, None)
            if code is not None:
                tried[code] += 1  # _close(code, reused=True)
                reused[code] += 1
                probability.pop(code, None)

    def remove(self, node: CachedNode) -> None:
        serial = node.serial
        ranked = self._rank.pop(serial, None)  # RankedPolicy.remove's whole work
        # L rises to the policy's own victims only: a block dropped for another reason
        # (a hybrid junction's dependents, an invalidation) says nothing about the
        # value of what stays
        if ranked is not None and serial == self.chosen:
            key = ranked >> RANK_SHIFT  # compared as keys, which sort as the ranks do
            if key > self._inflation_key:
                self._inflation_key = key
                self.inflation = key_rank(key)
        code = self._trial.pop(serial, None)
        if code is not None and self.spans_blocks:
            self._file_ghost(node, node.hits + self._credit.get(serial, 0), code)
        elif code is not None:
            ghosts = self._ghosts
            ghosts[node.key] = (node.hits + self._credit.get(serial, 0)) << 10 | code  # reuses()
            while len(ghosts) > self._ghost_capacity:
                _, old = ghosts.popitem(last=False)
                self._close(old & 1023, reused=False)
        if self._credit:
            self._credit.pop(serial, None)

    def _file_ghost(self, node: CachedNode, reuses: int, code: int) -> None:
        """`node`, of `node.blocks` blocks, left with its trial open (`spans_blocks`): its
        ghost joins, and the oldest leave while the ghosts stand for more blocks than
        the history holds, closing their trials as not reused."""
        ghosts = self._ghosts
        blocks = max(node.blocks, 1)
        previous = ghosts.get(node.key)
        ghosts[node.key] = (blocks - 1) << BLOCKS_SHIFT | min(reuses, REUSES_MASK) << 10 | code
        self._ghost_blocks += blocks - (0 if previous is None else ghost_blocks(previous))
        while self._ghost_blocks > self._ghost_capacity and ghosts:
            old = ghosts.popitem(last=False)[1]
            self._ghost_blocks -= ghost_blocks(old)
            self._close(old & 1023, False, ghost_blocks(old))

    def remove_victims(self, nodes: Sequence[CachedNode]) -> None:
        if not self._own_remove or self.spans_blocks:  # one node at a time
            super().remove_victims(nodes)
            return
        # `remove` for each victim (each was `chosen`), inlined
        ranks, trials, credits, ghosts = self._rank, self._trial, self._credit, self._ghosts
        tried, probability = self._tried, self._probability
        capacity = self._ghost_capacity
        top = self._inflation_key
        for node in nodes:
            serial = node.serial
            ranked = ranks.pop(serial, None)
            if ranked is not None and ranked >> RANK_SHIFT > top:
                top = ranked >> RANK_SHIFT
            code = trials.pop(serial, None)
            if code is not None:
                ghosts[node.key] = (node.hits + credits.get(serial, 0)) << 10 | code
                while len(ghosts) > capacity:
                    old = ghosts.popitem(last=False)[1] & 1023
                    tried[old] += 1  # _close(old, reused=False)
                    probability.pop(old, None)
            if credits:
                credits.pop(serial, None)
        if top > self._inflation_key:
            self._inflation_key = top
            self.inflation = key_rank(top)
        if nodes:
            self.chosen = nodes[-1].serial

    def _close(self, code: int, reused: bool, blocks: int = 1) -> None:
        """A trial of class `code` closed, `reused` or not, weighing `blocks`."""
        self._tried[code] += blocks
        if reused:
            self._reused[code] += blocks
        self._probability.pop(code, None)

    def learned(self) -> dict[ReuseClass, tuple[int, float]]:
        """Each class seen so far: (closed trials, estimated reuse probability)."""
        return {
            cls: (self._tried[code], self.reuse_probability(code))
            for code, cls in self._classes.items()
        }
