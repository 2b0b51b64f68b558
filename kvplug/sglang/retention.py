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

from kvplug.core.retention import Retention, RetentionBook, check_seconds
from kvplug.engine_stats import PoolStats
from kvplug.errors import ConfigError

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


class TreeRetention:
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
        if defaults and refusal is not None:
            raise ConfigError(
                f"kvplug config: retention.default_seconds cannot be served: {refusal}; "
                "drop retention.default_seconds"
            )
        self.cache = cache
        self.book = book
        self.stats = stats
        self.defaults = dict(defaults or {})
        self.refusal = refusal
        self.clock = clock
        self.locks: dict[int, Any] = {}  # retention serial -> its tree lock

    def asked(self, req: Any, tenant: str) -> float | None:
        """The seconds `req` asks to be kept (its tenant's default if it names none), or
        None: none asked, or a bad ask (logged and counted)."""
        custom = getattr(req.sampling_params, "custom_params", None) or {}
        value = custom.get(RETAIN_PARAM, self.defaults.get(tenant))
        if value is None:
            return None
        try:
            if self.refusal is not None:
                raise ConfigError(self.refusal)
            return check_seconds(value, self.book.max_seconds)
        except ConfigError as exc:
            self.stats.retentions_refused += 1
            logger.warning(
                "kvplug: request %s: %s=%r not served (%s)", req.rid, RETAIN_PARAM, value, exc
            )
            return None

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

    def expire(self) -> int:
        """End the retentions whose time has passed; how many ended."""
        if not self.book.live:
            return 0
        ended = self.book.expire(self.clock())
        for retention in ended:
            self._release(retention)
        return len(ended)

    def lapse_oldest(self) -> bool:
        """End the oldest live retention (an eviction fell short); whether one ended."""
        retention = self.book.lapse_oldest()
        if retention is None:
            return False
        self._release(retention)
        return True

    def retained_blocks(self) -> int:
        return sum(self.book.by_tenant().values())

    def _release(self, retention: Retention) -> None:
        self.cache.unlock(self.locks.pop(retention.serial))

    def check_invariants(self) -> None:
        """Raise AssertionError unless every live retention holds exactly one lock."""
        self.book.check_invariants()
        assert set(self.locks) == set(self.book.live), "retention locks out of step"
