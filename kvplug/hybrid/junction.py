"""The junction: the longest prefix every state group can serve.

A hybrid model can resume a prompt at position ``k`` (in units) only if every group has
what it needs there:

- full attention: the KV of every unit before ``k``;
- sliding window: the KV of the ``window_units`` units before ``k`` (fewer if ``k`` is
  smaller), and nothing older;
- Mamba: a checkpoint taken at exactly ``k``: a state taken anywhere else is wrong there.

Position 0 needs nothing, so the junction is never undefined. This module computes it, and
each kind's own longest hit, from what the groups hold along one path: engine-neutral, so
kvplug's hybrid cache, the engine adapters and the tests share one definition. Invariant:
the junction is at most every kind's own hit, and it is a position where every kind is
served.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

from kvplug.core.groups import GroupKind


class PathStep(Protocol):
    """What the groups hold for one unit of a path (the unit ending at its depth)."""

    kv: bool  # full-attention KV of this unit
    window_kv: bool  # sliding-window KV of this unit
    checkpoint: bool  # Mamba state taken at the end of this unit


@dataclass(frozen=True)
class Holdings:
    """A plain `PathStep`, for tests and adapters that hold no nodes."""

    kv: bool = False
    window_kv: bool = False
    checkpoint: bool = False


@dataclass(frozen=True)
class Hits:
    """`junction`: what the model can be served; `by_kind`: each kind's own longest hit."""

    junction: int
    by_kind: dict[GroupKind, int]


def longest_hits(
    path: Sequence[PathStep], kinds: set[GroupKind], window_units: int, limit: int | None = None
) -> Hits:
    """The junction and each kind's own hit along `path`, at most `limit` units deep.

    ``path[i]`` is the unit ending at position ``i + 1``.
    """
    depth_limit = len(path) if limit is None else min(limit, len(path))
    has_full = GroupKind.FULL in kinds
    has_window = GroupKind.SLIDING_WINDOW in kinds
    has_mamba = GroupKind.MAMBA in kinds
    full = window = mamba = junction = 0
    full_run = True  # every unit so far has full-attention KV
    window_run = 0  # consecutive units with sliding-window KV, ending at this depth
    for depth in range(1, depth_limit + 1):
        step = path[depth - 1]
        full_run = full_run and step.kv
        window_run = window_run + 1 if step.window_kv else 0
        if full_run:
            full = depth
        window_ok = window_run >= min(window_units, depth)
        if window_ok:
            window = depth
        if step.checkpoint:
            mamba = depth
        if (
            (full_run or not has_full)
            and (window_ok or not has_window)
            and (step.checkpoint or not has_mamba)
        ):
            junction = depth
    by_kind = {}
    if has_full:
        by_kind[GroupKind.FULL] = full
    if has_window:
        by_kind[GroupKind.SLIDING_WINDOW] = window
    if has_mamba:
        by_kind[GroupKind.MAMBA] = mamba
    return Hits(junction, by_kind)


__all__ = ["Hits", "Holdings", "PathStep", "longest_hits"]
