"""kvplug's policies inside SGLang's real `UnifiedRadixCache`, with its real KV pools.

The caches here are built by SGLang's own unit-test fixture
(`sglang.test.kits.unified_radix_cache.fixtures.build_fixture`: real token, sliding-window
and Mamba pools on the CPU) with kvplug's tree core and components, the same classes
``--radix-cache-backend kvplug`` installs, for four shapes: full attention at page size 1
and 4, full + sliding window, and full + Mamba.

Random sequences of SGLang's cache operations (insert, match and lock, unlock, evict) run
on a stock cache (SGLang's ``lru``) and a kvplug cache side by side:

- with ``kvplug-lru`` both caches return the same matches and evictions and hold the
  same sizes in every component after every operation, and the sliding-window and Mamba
  walks free the same states of the same nodes in the same order (internal nodes'
  state included: a seeded run checks that such tombstones happen);
- under every kvplug policy, kvplug's candidates stay SGLang's evictable leaves, each
  ranked set's members the nodes holding its state (`KVPlugTreeCore.check_invariants`),
  and SGLang's own `sanity_check` passes;
- a non-lru policy (``cost``) changes the victims of every kind of state.

The kvplug caches are built with kvplug's components for every kind of state
(`kvplug_components`), which `build` asserts.
"""

from __future__ import annotations

import random

import pytest

pytest.importorskip("sglang", reason="SGLang is not installed (see requirements/sglang-replay.txt)")

from hypothesis import given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402
from sglang_driver import Driver, apply, check, op_list, prefixes  # noqa: E402
from sglang_fixture import SHAPES, match_prefix  # noqa: E402


def compare_lru(shape: str, bases: list[list[int]], ops: list[tuple]) -> tuple[Driver, Driver]:
    """Run `ops` on a stock ``lru`` cache and a ``kvplug-lru`` one: after every operation
    they return the same result, their eviction walks (full attention, SWA, Mamba) have
    freed the same states of the same nodes in the same order, and they hold the same
    sizes; kvplug's audit passes (with ``lru`` it checks
    that each ranked set's order is SGLang's LRU list order)."""
    stock, kvplug = Driver(shape, "lru"), Driver(shape, "kvplug-lru")
    for op in ops:
        assert apply(stock, bases, op) == apply(kvplug, bases, op), op
        assert stock.walk_frees() == kvplug.walk_frees(), op
        assert stock.sizes() == kvplug.sizes(), op
        check(kvplug)
    assert stock.tombstones == kvplug.tombstones
    return stock, kvplug


@pytest.mark.parametrize("shape", list(SHAPES))
@settings(max_examples=15, deadline=None)
@given(bases=st.lists(prefixes, min_size=1, max_size=3), ops=op_list)
def test_kvplug_lru_matches_sglang_lru(shape: str, bases: list[list[int]], ops: list[tuple]):
    compare_lru(shape, bases, ops)


def state_pressure_ops(rng: random.Random, n: int) -> list[tuple]:
    """`n` operations like `op_list`'s whose evictions free only SWA / Mamba state (the
    full-attention walk does not run: its order is not under test here)."""
    draw = [
        lambda: ("insert", rng.randrange(3), rng.randint(1, 12), rng.randrange(10)),
        lambda: ("insert", rng.randrange(3), rng.randint(1, 12), rng.randrange(10)),
        lambda: ("match", rng.randrange(3), rng.randint(1, 12)),
        lambda: ("unlock", rng.randrange(8)),
        lambda: ("evict_state", rng.randint(1, 8)),
    ]
    return [rng.choice(draw)() for _ in range(n)]


@pytest.mark.parametrize("shape", ["full+swa", "full+mamba"])
def test_kvplug_lru_tombstones_internal_state_as_sglang(shape: str) -> None:
    """Under pressure, SWA / Mamba state is freed from internal nodes (tombstoned), and
    kvplug-lru picks those victims exactly as SGLang's lru does."""
    rng = random.Random(7)
    tombstones = 0
    for _ in range(8):
        bases = [[rng.randint(1, 6) for _ in range(rng.randint(4, 12))] for _ in range(3)]
        stock, _ = compare_lru(shape, bases, state_pressure_ops(rng, 40))
        tombstones += stock.tombstones
    assert tombstones > 0, "no internal state was tombstoned: raise the pressure"


@pytest.mark.parametrize("shape", list(SHAPES))
@pytest.mark.parametrize("policy", ["kvplug-cost", "kvplug-lfu", "kvplug-gdsf"])
@settings(max_examples=4, deadline=None)
@given(bases=st.lists(prefixes, min_size=1, max_size=3), ops=op_list)
def test_every_policy_keeps_sglang_invariants(
    shape: str, policy: str, bases: list[list[int]], ops: list[tuple]
) -> None:
    driver = Driver(shape, policy)
    for op in ops:
        apply(driver, bases, op)
        check(driver)


@pytest.mark.parametrize("shape", list(SHAPES))
def test_eviction_follows_the_policy(shape: str) -> None:
    """Two leaves: one inserted and matched twice, one once. lru evicts the older, cost
    the one nobody came back to; both are SGLang leaves."""
    page = SHAPES[shape].page_size
    first, second = [1] * page * 3, [2] * page * 3
    for policy, keeps in (("kvplug-lru", first), ("kvplug-cost", first)):
        driver = Driver(shape, policy)
        driver.insert(first)
        for _ in range(2):
            driver.match_and_lock(first)
            driver.unlock(0)
        driver.insert(second)
        driver.match_and_lock(first)  # first is the most recent for lru as well
        driver.unlock(0)
        driver.evict(1)
        check(driver)
        assert match_prefix(driver.cache, keeps).device_prefix_len == len(keeps), policy


@pytest.mark.parametrize("shape, component", [("full+swa", "SWA"), ("full+mamba", "MAMBA")])
def test_state_eviction_follows_the_policy(shape: str, component: str) -> None:
    """A sequence inserted three times (SGLang counts a hit on each re-insert), then
    another once: SGLang's lru and kvplug-lru take the older sequence's state first,
    kvplug-cost the one reused less (the SWA or Mamba walk alone runs: no full-attention
    eviction is asked)."""
    older, newer = list(range(1, 13)), list(range(21, 25))
    first_victims = {}
    for policy in ("lru", "kvplug-lru", "kvplug-cost"):
        driver = Driver(shape, policy)
        for _ in range(3):
            driver.insert(older)
        driver.insert(newer)
        driver.evict(1, full=False)
        if policy != "lru":
            check(driver)
        walk, _, victim = driver.freed[0]  # a leaf victim is evicted whole, full first
        assert walk == component, driver.freed
        first_victims[policy] = victim[0]
    assert first_victims == {"lru": older[0], "kvplug-lru": older[0], "kvplug-cost": newer[0]}


def test_full_lru_ranks_an_unlocked_node_by_its_last_access() -> None:
    victims = {}
    for policy in ("lru", "kvplug-lru"):
        driver = Driver("full-p1", policy)
        driver.insert([1, 2, 3])
        driver.match_and_lock([1, 2, 3])
        driver.insert([7, 8, 9])
        driver.unlock(0)
        driver.evict(3)
        victims[policy] = driver.freed[0][2]
    assert victims["kvplug-lru"] == victims["lru"] == (1, 2, 3)
