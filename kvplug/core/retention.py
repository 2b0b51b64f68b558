"""Retention: prefixes that requests asked a cache to keep, per tenant, capped, expiring.

A request may ask that its prompt's cached blocks be kept for a while after it ends (a
system prompt the next request will reuse, a session's history between turns). The book
decides which retentions are live; the adapter holds their blocks as a running request
would (so no policy can choose them) and releases them when the book says a retention
ended, to be ranked like any other release. A retention ends when:

- it expires (`expire`: its seconds have passed);
- its tenant needs room under its cap for a newer one (`retain`: the tenant's oldest
  retentions lapse first; a tenant cannot pin the cache). A retention larger than its
  tenant's whole cap is not kept at all, and nothing fails;
- the cache has nothing else left to evict (`lapse_oldest`, the oldest of all first): a
  retained block is evicted only when no other block can be.

Blocks are the adapter's handles (block ids); a tenant's retained blocks count each block
once, however many of its retentions hold it. `EngineRetentions` is what the engine
adapters share around the book (reading and refusing asks, expiry, lapses).

Invariants (checked by `check_invariants`): each tenant's retained blocks are at most its
cap; the per-tenant counts are exactly the distinct blocks of its live retentions; every
live retention is in the expiry queue.
"""

from __future__ import annotations

import heapq
import logging
import math
from abc import ABC, abstractmethod
from collections import Counter, OrderedDict
from collections.abc import Callable, Hashable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from kvplug.errors import ConfigError

DEFAULT_MAX_SECONDS = 3600.0


@dataclass(frozen=True, slots=True)
class Retention:
    """One live retention: `blocks` (the adapter's handles) kept for `tenant` until
    `until` (the book's clock), numbered in the order asked (`serial`)."""

    serial: int
    tenant: str
    blocks: tuple[Hashable, ...]
    until: float


def check_seconds(seconds: object, max_seconds: float = DEFAULT_MAX_SECONDS) -> float:
    """`seconds` as a retention time, or a `ConfigError` naming what is accepted."""
    if isinstance(seconds, bool) or not isinstance(seconds, (int, float)):
        raise ConfigError(
            f"a retention time must be a number of seconds, got {seconds!r} "
            f"(accepted: more than 0, at most {max_seconds:g})"
        )
    value = float(seconds)
    if not math.isfinite(value) or not 0 < value <= max_seconds:
        raise ConfigError(
            f"a retention time must be more than 0 and at most {max_seconds:g} seconds, "
            f"got {seconds!r}"
        )
    return value


class RetentionBook:
    """The live retentions of one cache (see the module doc). `cap_blocks` is each
    tenant's cap in blocks, `caps` overrides it per tenant; `max_seconds` bounds a
    retention's time."""

    def __init__(
        self,
        cap_blocks: int,
        caps: Mapping[str, int] | None = None,
        max_seconds: float = DEFAULT_MAX_SECONDS,
    ) -> None:
        named = [("cap_blocks", cap_blocks)]
        named += [(f"caps[{tenant!r}]", cap) for tenant, cap in (caps or {}).items()]
        for name, cap in named:
            if isinstance(cap, bool) or not isinstance(cap, int) or cap < 0:
                raise ConfigError(f"{name} must be a whole number of blocks >= 0, got {cap!r}")
        self.cap_blocks = cap_blocks
        self.caps = dict(caps or {})
        self.max_seconds = check_seconds(max_seconds, math.inf)
        self.live: OrderedDict[int, Retention] = OrderedDict()  # oldest first
        self._by_tenant: dict[str, OrderedDict[int, Retention]] = {}
        self._blocks: dict[str, Counter[Hashable]] = {}  # tenant -> block -> retentions
        self._expiry: list[tuple[float, int]] = []  # (until, serial), stale once gone
        self._next_serial = 0

    def __len__(self) -> int:
        return len(self.live)

    def cap_of(self, tenant: str) -> int:
        return self.caps.get(tenant, self.cap_blocks)

    def retained_blocks(self, tenant: str) -> int:
        """The distinct blocks `tenant`'s live retentions hold."""
        return len(self._blocks.get(tenant, ()))

    def by_tenant(self) -> dict[str, int]:
        """Each tenant with a live retention -> its retained blocks."""
        return {tenant: len(blocks) for tenant, blocks in self._blocks.items()}

    def retain(
        self, tenant: str, blocks: Sequence[Hashable], seconds: object, now: float
    ) -> tuple[Retention | None, list[Retention]]:
        """Keep `blocks` for `tenant` for `seconds` from `now`. Returns the retention (None
        if the blocks alone are more than the tenant's cap, or none are given: nothing is
        kept) and the tenant's older retentions that lapsed to make room, oldest first:
        the adapter holds the first and releases the others."""
        until = now + check_seconds(seconds, self.max_seconds)
        held = self._blocks.get(tenant, Counter())
        cap = self.cap_of(tenant)
        distinct = set(blocks)
        if not distinct or len(distinct) > cap:
            return None, []
        lapsed: list[Retention] = []
        mine = self._by_tenant.get(tenant)
        while mine and len(held) + len(distinct - held.keys()) > cap:
            lapsed.append(self._end(next(iter(mine.values()))))
            held = self._blocks.get(tenant, Counter())
        retention = Retention(self._next_serial, tenant, tuple(blocks), until)
        self._next_serial += 1
        self.live[retention.serial] = retention
        self._by_tenant.setdefault(tenant, OrderedDict())[retention.serial] = retention
        self._blocks.setdefault(tenant, Counter()).update(distinct)
        heapq.heappush(self._expiry, (until, retention.serial))
        return retention, lapsed

    def expire(self, now: float) -> list[Retention]:
        """The retentions whose time has passed by `now`, ended, in the order they expired."""
        ended = []
        expiry = self._expiry
        while expiry and expiry[0][0] <= now:
            _, serial = heapq.heappop(expiry)
            retention = self.live.get(serial)
            if retention is not None:
                ended.append(self._end(retention))
        return ended

    def lapse_oldest(self) -> Retention | None:
        """End the oldest live retention (the cache has nothing else to evict); None if
        there is none."""
        if not self.live:
            return None
        return self._end(next(iter(self.live.values())))

    def _end(self, retention: Retention) -> Retention:
        del self.live[retention.serial]
        mine = self._by_tenant[retention.tenant]
        del mine[retention.serial]
        held = self._blocks[retention.tenant]
        held.subtract(set(retention.blocks))
        for block in set(retention.blocks):
            if held[block] <= 0:
                del held[block]
        if not mine:
            del self._by_tenant[retention.tenant]
            del self._blocks[retention.tenant]
        return retention

    def check_invariants(self) -> None:
        """Raise AssertionError if a module-level invariant does not hold."""
        counted: dict[str, Counter[Hashable]] = {}
        for retention in self.live.values():
            counted.setdefault(retention.tenant, Counter()).update(set(retention.blocks))
        assert counted == self._blocks, "per-tenant block counts out of step"
        for tenant, blocks in counted.items():
            assert len(blocks) <= self.cap_of(tenant), f"tenant {tenant!r} over its cap"
            assert list(self._by_tenant[tenant]) == [
                r.serial for r in self.live.values() if r.tenant == tenant
            ]
        queued = {serial for _, serial in self._expiry}
        assert set(self.live) <= queued, "a live retention missing from the expiry queue"


class EngineRetentions(ABC):
    """An engine adapter's side of retention: the `book` decides which retentions are
    live; a subclass holds each retention's blocks in its engine's own terms (`_release`
    lets them go). What every engine shares lives here: reading a request's ask against
    its tenant's default, refusing what cannot be served (a bad value, or a cache that
    cannot retain, `refusal`) by counting it in ``stats.retentions_refused`` rather than
    failing a request that already ran, expiry, and the oldest-first lapse."""

    def __init__(
        self,
        book: RetentionBook,
        stats: Any,
        defaults: Mapping[str, float] | None,
        refusal: str | None,
        clock: Callable[[], float],
        logger: logging.Logger,
    ) -> None:
        if defaults and refusal is not None:
            raise ConfigError(
                f"kvplug config: retention.default_seconds cannot be served: {refusal}; "
                "drop retention.default_seconds"
            )
        self.book = book
        self.stats = stats
        self.defaults = dict(defaults or {})
        self.refusal = refusal
        self.clock = clock
        self.logger = logger

    def seconds_asked(
        self, asked: object, tenant: str, request_id: object, name: str
    ) -> float | None:
        """The seconds a request asks to be kept (`asked`, the value of its parameter
        `name`; None: its tenant's default), or None: none asked, or a bad ask (logged
        and counted)."""
        value = self.defaults.get(tenant) if asked is None else asked
        if value is None:
            return None
        try:
            if self.refusal is not None:
                raise ConfigError(self.refusal)
            return check_seconds(value, self.book.max_seconds)
        except ConfigError as exc:
            self.stats.retentions_refused += 1
            self.logger.warning(
                "kvplug: request %s: %s=%r not served (%s)", request_id, name, value, exc
            )
            return None

    def expire(self) -> int:
        """End the retentions whose time has passed; how many ended."""
        if not self.book.live:
            return 0
        ended = self.book.expire(self.clock())
        for retention in ended:
            self._release(retention)
        return len(ended)

    def lapse_oldest(self) -> bool:
        """End the oldest live retention; whether there was one."""
        retention = self.book.lapse_oldest()
        if retention is None:
            return False
        self._release(retention)
        return True

    @abstractmethod
    def _release(self, retention: Retention) -> None:
        """Let go of what the engine holds for `retention`, which has ended."""
