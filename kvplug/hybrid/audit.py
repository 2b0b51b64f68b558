"""`check_invariants` of a `HybridCache`: the invariants its module docstring states."""

from __future__ import annotations

from typing import TYPE_CHECKING

from kvplug.core.groups import GroupKind
from kvplug.hybrid.policy import GHOST_FLOOR, JunctionCostPolicy

if TYPE_CHECKING:
    from kvplug.hybrid.cache import HybridCache


def check_invariants(cache: HybridCache) -> None:
    """Raise AssertionError if an invariant of `kvplug.hybrid.cache` does not hold."""
    used = pinned = sum(r.live_bytes for r in cache.requests.values())
    cached = {kind: 0 for kind in cache.kinds}
    holders: dict[int, int] = {}
    live: dict[int, int] = {}
    for request in cache.requests.values():
        for node in request.path:
            holders[id(node)] = holders.get(id(node), 0) + 1
        for node in request.path[-cache.window :] if cache.window_bytes and cache.window else ():
            live[id(node)] = live.get(id(node), 0) + 1
    candidates = 0
    for node in cache.nodes():
        assert node.parent.children.get(node.unit) is node, "tree link broken"
        assert node.holders == holders.get(id(node), 0), "holder count off"
        assert node.live == live.get(id(node), 0), "live window count off"
        window = cache.window_bytes if node.window_kv else 0
        checkpoint = cache.checkpoint_bytes if node.checkpoint else 0
        used += cache.kv_bytes + window + checkpoint
        if node.holders:
            pinned += cache.kv_bytes + checkpoint + (0 if node.speculative else window)
        else:
            cached[GroupKind.FULL] += cache.kv_bytes
            if checkpoint:
                cached[GroupKind.MAMBA] += checkpoint
        if window and (node.speculative or not node.holders):
            cached[GroupKind.SLIDING_WINDOW] += window
        record = node.record
        assert (record is not None) == cache._is_junction(node), "junction record stale"
        if record is not None and record.candidate:
            candidates += 1
            assert not node.holders, "a held junction is a candidate"
        speculative = node.window_kv and not node.live and not cache._window_needed(node, None)
        assert node.speculative == speculative, "speculative window state stale"
        assert (node.window_record is not None) == speculative, "window record stale"
        if node.window_record is not None:
            assert node.window_record.candidate
            candidates += 1
        if not node.children and not node.holders:
            assert node.record is not None, "a leaf no junction needs was kept"
    assert used == cache.used, f"used bytes {cache.used} != {used}"
    assert pinned == cache.pinned, f"pinned bytes {cache.pinned} != {pinned}"
    assert cached == cache.cached_by_kind, "bytes by kind off"
    assert cache.used <= cache.capacity, "over capacity"
    assert candidates == len(cache.policy), "policy candidates differ from records"
    policy = cache.policy
    if isinstance(policy, JunctionCostPolicy):  # trimmed at each removal, to before it
        limit = max(GHOST_FLOOR, policy.ghost_ratio * (len(policy._rank) + 1))
        assert len(policy._ghosts) <= limit, "ghost history outgrew the ranked records"
