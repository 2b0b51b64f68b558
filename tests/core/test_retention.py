"""Retention: the book's caps, expiry and lapses, and a `KVCache` keeping what it retains
(a retained prefix survives a flood that evicts it under `lru`; a tenant cannot pin the
cache; expiry hands it back to the policy; it goes only when nothing else can)."""

from __future__ import annotations

import math

import pytest
from hypothesis import given
from hypothesis import strategies as st

from kvplug.core.cache import KVCache
from kvplug.core.keys import Namespace
from kvplug.core.retention import RetentionBook, check_seconds
from kvplug.errors import ConfigError

# ---------------------------------------------------------------- the book


def test_a_tenant_over_its_cap_loses_its_own_oldest_retentions_first() -> None:
    book = RetentionBook(cap_blocks=4)
    first, _ = book.retain("a", [1, 2], 60, now=0)
    second, _ = book.retain("a", [3], 60, now=1)
    other, _ = book.retain("b", [7, 8, 9], 60, now=2)
    third, lapsed = book.retain("a", [4, 5], 60, now=3)
    assert lapsed == [first] and third is not None
    assert book.retained_blocks("a") == 3 and book.by_tenant() == {"a": 3, "b": 3}
    assert list(book.live.values()) == [second, other, third]
    book.check_invariants()


def test_blocks_shared_by_a_tenants_retentions_count_once() -> None:
    book = RetentionBook(cap_blocks=3)
    book.retain("a", [1, 2], 60, now=0)
    kept, lapsed = book.retain("a", [1, 2, 3], 60, now=1)  # a longer prefix of the same
    assert kept is not None and lapsed == [] and book.retained_blocks("a") == 3
    book.check_invariants()


def test_a_retention_larger_than_the_whole_cap_keeps_nothing_and_fails_nothing() -> None:
    book = RetentionBook(cap_blocks=2, caps={"big": 10})
    book.retain("a", [1], 60, now=0)
    assert book.retain("a", [1, 2, 3], 60, now=1) == (None, [])
    assert book.retained_blocks("a") == 1  # the older one stays
    assert book.retain("big", [1, 2, 3], 60, now=1)[0] is not None
    assert book.retain("a", [], 60, now=1) == (None, [])


def test_retentions_expire_in_time_order_and_lapse_oldest_first() -> None:
    book = RetentionBook(cap_blocks=10)
    long, _ = book.retain("a", [1], 100, now=0)
    short, _ = book.retain("b", [2], 5, now=1)
    mid, _ = book.retain("a", [3], 20, now=2)
    assert book.expire(5.9) == []
    assert book.expire(22.0) == [short, mid]
    assert book.lapse_oldest() == long and book.lapse_oldest() is None
    assert len(book) == 0 and book.by_tenant() == {}


@pytest.mark.parametrize("seconds", [0, -1, math.nan, math.inf, 3601, "300", None, True])
def test_a_bad_retention_time_names_what_is_accepted(seconds) -> None:
    with pytest.raises(ConfigError, match=r"retention time.*(more than 0|at most 3600)"):
        check_seconds(seconds)
    book = RetentionBook(cap_blocks=4)
    with pytest.raises(ConfigError):
        book.retain("a", [1], seconds, now=0)
    assert len(book) == 0


@pytest.mark.parametrize("cap", [-1, 1.5, "4", True])
def test_a_bad_cap_is_refused(cap) -> None:
    with pytest.raises(ConfigError, match="whole number of blocks"):
        RetentionBook(cap_blocks=cap)
    with pytest.raises(ConfigError, match=r"caps\['t'\]"):
        RetentionBook(cap_blocks=4, caps={"t": cap})


operations = st.lists(
    st.one_of(
        st.tuples(
            st.just("retain"),
            st.sampled_from("abc"),
            st.lists(st.integers(0, 9), max_size=6),
            st.sampled_from([1, 5, 30]),
        ),
        st.tuples(st.just("time"), st.sampled_from([0.5, 3, 20])),
        st.tuples(st.just("lapse")),
    ),
    max_size=40,
)


@given(cap=st.integers(0, 6), ops=operations)
def test_the_book_keeps_every_tenant_under_its_cap_through_any_operations(cap, ops) -> None:
    """Against a model: the live retentions are those kept, not yet expired, lapsed or
    displaced, and each tenant's distinct blocks stay under the cap."""
    book, now, model = RetentionBook(cap_blocks=cap), 0.0, {}
    for op in ops:
        if op[0] == "retain":
            _, tenant, blocks, seconds = op
            kept, lapsed = book.retain(tenant, blocks, seconds, now)
            for gone in lapsed:
                assert gone.tenant == tenant and gone.serial == min(
                    s for s, r in model.items() if r.tenant == tenant
                )
                del model[gone.serial]
            assert (kept is None) == (not blocks or len(set(blocks)) > cap)
            if kept is not None:
                model[kept.serial] = kept
        elif op[0] == "time":
            now += op[1]
            for gone in book.expire(now):
                assert gone.until <= now
                del model[gone.serial]
        else:
            gone = book.lapse_oldest()
            assert (gone is None) == (not model)
            if gone is not None:
                assert gone.serial == min(model)
                del model[gone.serial]
        book.check_invariants()
        assert list(book.live) == sorted(model)
        assert all(r.until > now for r in model.values())


# ---------------------------------------------------------------- in the cache


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def _cache(num_blocks: int = 8, cap: int = 4, policy: str = "lru") -> tuple[KVCache, Clock]:
    clock = Clock()
    cache = KVCache(
        num_blocks, 2, policy=policy, retention=RetentionBook(cap_blocks=cap), clock=clock
    )
    return cache, clock


def _run(cache: KVCache, req_id: str, prompt: list[int], retain: float = 0, tenant=None) -> int:
    """One whole request: looked up, prefilled, fenced, optionally retained, finished;
    returns the prompt tokens it found cached."""
    hit = cache.add_request(req_id, prompt, namespace=tenant)
    cache.append(req_id, prompt[hit:])
    cache.complete_step()
    if retain:
        cache.retain(req_id, retain)
    cache.finish(req_id)
    cache.check_invariants()
    return hit


SYSTEM = [1, 2, 3, 4, 5, 6, 7]  # three full blocks of 2, and a token


def _flood(cache: KVCache, start: int, count: int) -> None:
    for i in range(count):
        _run(cache, f"flood{start + i}", [100 + 10 * (start + i) + t for t in range(7)])


@pytest.mark.parametrize("retained", [False, True])
def test_a_retained_prefix_survives_a_flood_that_evicts_it_under_lru(retained) -> None:
    cache, _ = _cache()
    _run(cache, "system", SYSTEM, retain=60 if retained else 0)
    _flood(cache, 0, 6)  # one-off prompts of four blocks each, in a cache of eight
    assert _run(cache, "again", SYSTEM + [9]) == (6 if retained else 0)


def test_an_expired_retention_is_the_policys_again() -> None:
    cache, clock = _cache()
    _run(cache, "system", SYSTEM, retain=30)
    clock.now = 31.0
    _flood(cache, 0, 6)
    assert len(cache.retention) == 0 and not cache.retention_holds
    assert _run(cache, "again", SYSTEM + [9]) == 0


def test_a_tenant_retaining_more_than_its_cap_loses_its_oldest_not_another_tenants() -> None:
    cache, _ = _cache(num_blocks=16, cap=3)
    a, b = Namespace(tenant="a"), Namespace(tenant="b")
    _run(cache, "b-system", [50, 51, 52, 53, 54, 55, 56], retain=60, tenant=b)
    _run(cache, "a-first", SYSTEM, retain=60, tenant=a)
    _run(cache, "a-second", [20, 21, 22, 23, 24, 25, 26], retain=60, tenant=a)
    assert cache.retention.by_tenant() == {"a": 3, "b": 3}
    assert [r.tenant for r in cache.retention.live.values()] == ["b", "a"]
    _flood(cache, 0, 8)
    assert _run(cache, "b-again", [50, 51, 52, 53, 54, 55, 56, 9], tenant=b) == 6
    assert _run(cache, "a-second-again", [20, 21, 22, 23, 24, 25, 26, 9], tenant=a) == 6


def test_retained_blocks_go_when_nothing_else_can_oldest_retention_first() -> None:
    cache, _ = _cache(num_blocks=8, cap=8)
    _run(cache, "one", SYSTEM, retain=60)  # blocks 0-2 (and a partial one, freed)
    _run(cache, "two", [20, 21, 22, 23, 24, 25, 26], retain=60)
    assert cache.num_reclaimable == 2 and cache.num_retained_only == 6
    assert cache.make_room(3)  # the oldest retention ends, no more
    assert [r.blocks for r in cache.retention.live.values()] == [tuple(cache.retention_holds)]
    assert not cache.make_room(9) and len(cache.retention) == 1  # none ended in vain
    _flood(cache, 0, 1)
    cache.check_invariants()
    assert _run(cache, "two-again", [20, 21, 22, 23, 24, 25, 26, 9]) == 6


def test_a_bad_retention_time_changes_nothing() -> None:
    cache, _ = _cache()
    cache.add_request("r", SYSTEM)
    cache.append("r", SYSTEM)
    cache.complete_step()
    with pytest.raises(ConfigError, match="retention time"):
        cache.retain("r", -5)
    assert len(cache.retention) == 0 and not cache.retention_holds
    cache.check_invariants()
