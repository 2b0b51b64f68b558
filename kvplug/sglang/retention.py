"""Retention in SGLang: a finished request's cached path held by one more tree lock.

A request asks with ``kvplug_retain_s`` in its sampling params' ``custom_params``
(``"sampling_params": {"custom_params": {"kvplug_retain_s": 300}}``), or its tenant's
default (`kvplug.config.RetentionConfig`). `kvplug.core.retention.RetentionBook` decides
which retentions are live; `TreeRetention` does the holding in SGLang's own terms: once
SGLang has inserted the finished request's tokens into the radix tree, the node its
insert ended on is locked once more (`UnifiedRadixCache.lock`, which holds every node on
the path), so no policy can choose it; the lock is released (`unlock`) when the
retention ends: it expires (checked at each lookup and each eviction), its tenant's cap
needs room, or an allocation's eviction falls short (`KVPlugRadixCache.evict_for_alloc`
then ends the oldest retention and evicts again). A retention's blocks are the physical
pages of its path, so a tenant's retentions sharing a prefix count its pages once.

A bad value is not served: the request ran already, kvplug logs why and counts it
(``kvplug_retentions_refused``). Only full-attention trees retain, and only with one
tensor-parallel rank (each rank keeps its own copy of the tree, and SGLang keeps the
copies equal by making the same calls in the same order; a retention ending on each
rank's own clock would let them differ): elsewhere an ask is refused and counted, and a
tenant default stops start-up.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Mapping
from typing import Any

from kvplug.core.retention import EngineRetentions, Retention, RetentionBook
from kvplug.engine_stats import PoolStats

RETAIN_PARAM = "kvplug_retain_s"  # per request: sampling_params.custom_params

logger = logging.getLogger("sglang.kvplug")


def refusal_for(full_attention: bool, tp_size: int) -> str | None:
    """Why a kvplug radix cache cannot retain (see the module doc), or None."""
    if not full_attention:
        return (
            "retention keeps full-attention prefixes only, and this model's tree has "
            "sliding-window or Mamba state"
        )
    if tp_size > 1:
        return (
            f"with {tp_size} tensor-parallel ranks each rank's copy of the tree would end "
            "retentions on its own clock"
        )
    return None


class TreeRetention(EngineRetentions):
    """The live retentions of one kvplug radix cache (see the module doc)."""

    def __init__(
        self,
        cache: Any,
        book: RetentionBook,
        stats: PoolStats,
        defaults: Mapping[str, float] | None = None,
        refusal: str | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        """`refusal`: why this cache cannot retain (`refusal_for`), or None."""
        super().__init__(book, stats, defaults, refusal, clock, logger)
        self.cache = cache
        self.locks: dict[int, Any] = {}  # retention serial -> its tree lock

    def asked(self, req: Any, tenant: str) -> float | None:
        """The seconds `req` asks to be kept (`EngineRetentions.seconds_asked`)."""
        custom = getattr(req.sampling_params, "custom_params", None) or {}
        return self.seconds_asked(custom.get(RETAIN_PARAM), tenant, req.rid, RETAIN_PARAM)

    def hold(self, node: Any, pages: list[int], tenant: str, seconds: float) -> Retention | None:
        """Keep the path ending at `node` (its physical `pages`) for `seconds`, as far
        as `tenant`'s cap allows; the retention, or None if nothing is kept."""
        retention, lapsed = self.book.retain(tenant, pages, seconds, self.clock())
        if retention is not None:
            self.locks[retention.serial] = self.cache.lock(node)
            self.stats.retentions += 1
        for ended in lapsed:
            self._release(ended)
        return retention

    def retained_blocks(self) -> int:
        return sum(self.book.by_tenant().values())

    def _release(self, retention: Retention) -> None:
        self.cache.unlock(self.locks.pop(retention.serial))

    def check_invariants(self) -> None:
        """Raise AssertionError unless every live retention holds exactly one lock."""
        self.book.check_invariants()
        assert set(self.locks) == set(self.book.live), "retention locks out of step"
