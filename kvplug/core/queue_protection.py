"""Waiting-queue protection: the cached blocks that waiting requests will hit go last.

A serving engine knows the requests waiting in its queue and, by a lookup that changes
nothing, the cached blocks each would hit. No trace of the past tells a policy as much:
those hits are known to come. The rule, written once for every engine and the replay:

- the first `depth` waiting requests, in the order the engine will start them, each
  *claim* the cached blocks of its prefix hit (every group's, for a hybrid model);
- a claimed block gets protection level 1, an unclaimed one 0, and the eviction core
  evicts by (level, the policy's order) (`kvplug.core.eviction.EvictionCore.protect_n`,
  `kvplug.core.dense`): no claimed block goes while an unclaimed candidate is left, and
  among claimed ones the policy's order decides.

The cores take any level, so other rules are one function away; two were measured on the
Mooncake trace and lost to this one: a level by queue position (the next request's
blocks kept longest, Belady's order for the blocks whose next use is known) fell below
`cost` alone once more than a few requests were read (the policy's rank knows more
about a block than the one waiting request that claims it), and a level per claiming
request did no better than one level for all.

`refresh` runs once per engine step (or replay event): levels for the new claims are
written, claims that lapsed are cleared, and the core skips blocks whose level did not
change. Its cost is bounded by `depth` lookups of at most a prompt each. Invariant: after
`refresh`, ``live`` maps exactly the blocks claimed by that refresh to their levels, and
the target holds those levels (and 0 for every block claimed before but not now).
"""

from __future__ import annotations

from collections.abc import Hashable, Iterable, Sequence
from itertools import islice
from typing import Generic, Protocol, TypeVar

T = TypeVar("T", bound=Hashable)
T_contra = TypeVar("T_contra", contravariant=True)

# the most waiting requests an engine's configuration may have read per step: enough for
# any batch an engine admits in one step, few enough that the scan stays a small part of
# a step (a study may read the whole queue: `QueueProtection` takes any depth below 2**31)
MAX_DEPTH = 256
WHOLE_QUEUE = (1 << 31) - 1  # a depth no queue reaches (levels are 32-bit in the dense core)


class Protectable(Protocol[T_contra]):
    """What protection writes to: an eviction core, or an engine pool in front of one."""

    def protect_n(self, nodes: list[T_contra], levels: list[int]) -> None: ...


CLAIMED = 1  # the protection level of a claimed block


def protection_levels(claims: Iterable[Sequence[T]], depth: int) -> dict[T, int]:
    """The level of every block the first `depth` claims name (a claim: one waiting
    request's hit blocks, in queue order): `CLAIMED`."""
    levels: dict[T, int] = {}
    for claim in islice(claims, depth):
        levels.update(dict.fromkeys(claim, CLAIMED))
    return levels


class QueueProtection(Generic[T]):
    """One cache's protection, refreshed from its waiting queue (see the module doc)."""

    def __init__(self, depth: int, target: Protectable[T]) -> None:
        if not 0 < depth <= WHOLE_QUEUE:
            raise ValueError(f"queue protection depth must be in 1..{WHOLE_QUEUE}, not {depth}")
        self.depth = depth
        self.target = target
        self.live: dict[T, int] = {}

    def refresh(self, claims: Iterable[Sequence[T]]) -> None:
        """Protect the blocks of the first `depth` `claims` (one per waiting request, in
        queue order; read lazily, no further than `depth`) and clear the rest."""
        levels = protection_levels(claims, self.depth)
        live = self.live
        if not levels and not live:
            return
        nodes = list(levels)
        values = list(levels.values())
        for node in live:
            if node not in levels:
                nodes.append(node)
                values.append(0)
        self.target.protect_n(nodes, values)
        self.live = levels

    def clear(self) -> None:
        """Drop every claim (the queue emptied, or the cache was reset)."""
        self.refresh(())
