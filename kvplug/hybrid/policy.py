"""How kvplug's hybrid cache ranks what it keeps: junctions and speculative windows.

Both are `HybridRecord`s, read by a policy through the `CachedNode` contract; one policy
instance ranks both kinds, so one decision spans the groups. `lru` orders them by release.
`cost` is `JunctionCostPolicy`. `belady` (the replay only: it needs the future) evicts
the record whose node the next request to pass it reaches farthest in the future
(`hybrid_requests_reaching`): an offline reference for the victim choice. It is no
bound: a junction serves only the requests whose hit ends there, not every request that
passes its node, and Belady's rule ignores what running requests hold, so in some cells
`cost` saves more.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

from kvplug.errors import UnknownPolicyError
from kvplug.policies import EvictionPolicy, PolicyContext, make_policy
from kvplug.policies.cost import DEFAULT_FREQUENCY_WEIGHT, CostPolicy, ReuseClass
from kvplug.policies.node import CachedNode

if TYPE_CHECKING:
    from kvplug.hybrid.cache import HybridNode

HYBRID_POLICIES = ("lru", "cost", "belady")
OFFLINE_HYBRID_POLICIES = ("belady",)  # the replay's own cache only
GHOST_FLOOR = 64  # ghosts kept however few records are ranked


@dataclass(eq=False, slots=True)
class HybridRecord:
    """A junction or a speculative window as the policy sees it (the `CachedNode`
    contract), plus its worth."""

    serial: int
    key: int
    depth: int
    node: HybridNode
    speculative: bool  # a speculative window, not a junction
    hits: int = 0
    from_end: int = 0
    request_hit: bool = False
    request_output: int = 0
    request_session: bool = False
    held_elsewhere: bool = False
    worth: float = 0.0
    candidate: bool = False


class JunctionCostPolicy(CostPolicy):
    """`cost` over hybrid records: GreedyDual with the record's own worth (FLOPs it saves
    per byte its removal frees) in place of a block's value by depth.

    A record's reuse class always includes its `from_end`, the junctions of the releasing
    request's path below it (0: the deepest): a conversation's earlier turns end in
    junctions its later turns pass, reused once and then rarely again; and whether it is a
    speculative window.

    Its ghost history holds `ghost_ratio` (4 by default) times the records it ranks, not
    times the blocks the bytes would buy: a junction stands for many blocks, so a history
    sized in blocks remembers evicted junctions for tens of cache lifetimes and credits
    reuses no cache of this size could have kept (gemma3-like, Mooncake at 10%: about
    24,000 ghosts beside 1,650 ranked records).
    """

    def classify(self, node: CachedNode) -> ReuseClass:
        output = min(node.request_output.bit_length(), 12)
        return (
            min(self.reuses(node), 3),
            min(node.from_end, 3),
            int(node.request_hit),
            int(node.speculative),  # type: ignore[attr-defined]
            output,
        )

    def credit(self, node: CachedNode) -> float:
        serial = node.serial
        code = (min(self.reuses(node), 3) << 2 | min(node.from_end, 3)) << 1
        code = (code | bool(node.request_hit)) << 1 | node.speculative  # type: ignore[attr-defined]
        code = code << 4 | min(node.request_output.bit_length(), 12)  # below 1024
        self._trial[serial] = code
        probability = self._probability.get(code)
        if probability is None:
            self._name_class(code, node)
            probability = self._probability[code] = self.reuse_probability(code)
        return (1 + self.frequency_weight * min(node.hits, 3)) * probability

    def rank(self, node: HybridRecord) -> float:  # type: ignore[override]
        return self.inflation + self.credit(node) * node.worth

    def __init__(
        self,
        tokens_per_block: int | None = None,
        ghost_ratio: float = 4.0,
        frequency_weight: float = DEFAULT_FREQUENCY_WEIGHT,
    ) -> None:
        super().__init__(
            tokens_per_block=tokens_per_block,
            ghost_ratio=ghost_ratio,
            frequency_weight=frequency_weight,
        )

    def remove(self, node: CachedNode) -> None:
        self._ghost_capacity = max(GHOST_FLOOR, int(self.ghost_ratio * len(self._rank)))
        super().remove(node)

    def insert(self, node: CachedNode) -> None:
        """A speculative window computed again after its eviction was not thereby reused
        (only a junction served there reuses it): its ghost earns no credit, and its trial
        closes as not reused when the ghost ages out."""
        if not node.speculative:  # type: ignore[attr-defined]
            super().insert(node)


def make_hybrid_policy(name: str, block_tokens: int) -> EvictionPolicy:
    """Policy `name` as the hybrid cache runs it: ``cost`` as `JunctionCostPolicy`."""
    if name not in HYBRID_POLICIES:
        raise UnknownPolicyError(
            f"unknown hybrid policy {name!r}; accepted: {', '.join(HYBRID_POLICIES)}"
        )
    context = PolicyContext(tokens_per_block=block_tokens, variants=HYBRID_VARIANTS)
    return make_policy(name, context=context)


# The subclass the hybrid cache runs for a policy name (`PolicyContext.variants`).
HYBRID_VARIANTS: dict[str, type[EvictionPolicy]] = {"cost": JunctionCostPolicy}


def hybrid_requests_reaching(prompts: Sequence[Sequence[int]]) -> dict[int, list[int]]:
    """Each hybrid-cache node key -> the indices of the prompts that pass through it, in
    order (prompt ``i`` is request ``i``; each lists its cacheable units): the future
    `belady` reads. A node's key chains its parent's with its unit, as
    `kvplug.hybrid.cache.HybridCache` keys it (the root's is 0)."""
    uses: dict[int, list[int]] = defaultdict(list)
    for index, units in enumerate(prompts):
        key = 0
        for unit in units:
            key = hash((key, unit))
            uses[key].append(index)
    return dict(uses)


__all__ = [
    "HYBRID_POLICIES",
    "OFFLINE_HYBRID_POLICIES",
    "HybridRecord",
    "JunctionCostPolicy",
    "hybrid_requests_reaching",
    "make_hybrid_policy",
]
