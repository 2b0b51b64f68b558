"""Counters the cache keeps, and the gauges it reports on demand."""

from __future__ import annotations

from collections import Counter
from dataclasses import asdict, dataclass, field


@dataclass
class CacheMetrics:
    """Monotonic counters. Gauges (tokens, slots, waste, states) come from `KVCache.usage()`."""

    requests: int = 0
    lookups: int = 0  # prefix lookups made on admission
    lookup_tokens: int = 0  # prompt tokens those lookups covered
    matched_tokens: int = 0  # of which served from the cache
    allocations: int = 0
    frees: int = 0
    evictions: int = 0
    churn: int = 0  # evicted blocks that were never reused
    invalidations: int = 0  # index entries dropped by `invalidate`
    cow_copies: int = 0
    published: int = 0
    rejected: int = 0  # full blocks the policy did not admit
    # deferred-release age: steps fenced between a block's release and its reuse -> count
    release_ages: Counter[int] = field(default_factory=Counter)

    def record_release(self, age: int) -> None:
        self.release_ages[age] += 1

    def release_age_percentile(self, q: float) -> int:
        """The q-quantile (0..1) of deferred-release ages, in steps; 0 when none."""
        total = sum(self.release_ages.values())
        if total == 0:
            return 0
        rank = q * total
        seen = 0
        for age in sorted(self.release_ages):
            seen += self.release_ages[age]
            if seen >= rank:
                return age
        return max(self.release_ages)

    @property
    def hit_ratio(self) -> float:
        return self.matched_tokens / self.lookup_tokens if self.lookup_tokens else 0.0

    def as_dict(self) -> dict[str, float | int]:
        out = asdict(self)
        del out["release_ages"]
        out["hit_ratio"] = self.hit_ratio
        out["release_age_max"] = max(self.release_ages, default=0)
        out["release_age_p99"] = self.release_age_percentile(0.99)
        return out


@dataclass(frozen=True)
class Usage:
    """A snapshot of what the live requests and the cache hold."""

    logical_tokens: int  # tokens in live block tables, counted per request
    physical_token_slots: int  # slots of the distinct blocks those tables hold
    tail_waste: int  # empty slots in those blocks
    block_table_entries: int
    blocks_by_state: dict[str, int]
    cached_blocks: int  # blocks in the prefix index

    def as_dict(self) -> dict[str, object]:
        return asdict(self)
