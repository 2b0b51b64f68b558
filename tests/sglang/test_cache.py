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
from array import array
from typing import Any

import pytest

pytest.importorskip("sglang", reason="SGLang is not installed (see requirements/sglang-replay.txt)")

from hypothesis import given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402
from sglang.srt.mem_cache.base_prefix_cache import EvictParams, InsertParams  # noqa: E402
from sglang.srt.mem_cache.radix_cache import RadixKey  # noqa: E402
from sglang_fixture import FULL, SHAPES, build, match_prefix  # noqa: E402


def path(node: Any) -> tuple[int, ...]:
    """A node's tokens from the root: the same node in two caches."""
    parts = []
    while node.parent is not None:
        parts.append(node.key.token_ids[: len(node.key)].tolist())
        node = node.parent
    return tuple(token for part in reversed(parts) for token in part)


class Driver:
    """SGLang's cache operations on one cache, as its scheduler issues them."""

    def __init__(self, shape: str, policy: str) -> None:
        self.cfg = SHAPES[shape]
        self.cache, self.allocator, self.pool = build(shape, policy)
        self.locks: list[Any] = []
        # Device states freed, in order: (the eviction walk's component, the freed
        # state's component, the node's path).
        self.freed: list[tuple[str, str, tuple[int, ...]]] = []
        self.tombstones = 0  # SWA / Mamba states freed from nodes that stay in the tree
        tree = self.cache.tree_core
        evict_state, start_walk = tree._evict_component_and_detach_lru, tree.evict_device_start
        walk = ["-"]

        def logged(node: Any, comp: Any, *args: Any, **kwargs: Any) -> Any:
            if node.component_data[comp.component_type].value is not None:
                self.freed.append((walk[0], comp.component_type.name, path(node)))
            return evict_state(node, comp, *args, **kwargs)

        def started(component: Any, request_cnt: int) -> None:
            walk[0] = component.name
            start_walk(component, request_cnt)

        # The tree's own calls find these first.
        tree._evict_component_and_detach_lru = logged
        tree.evict_device_start = started

    def walk_frees(self) -> list[tuple]:
        """Every eviction walk's frees, in order."""
        return list(self.freed)

    def holding(self, component: Any) -> dict[int, Any]:
        """The nodes that hold `component`'s device state, by id."""
        tree = self.cache.tree_core
        return {
            node.id: node
            for node in tree._collect_all_nodes()
            if node is not tree.root_node and node.component_data[component].value is not None
        }

    def insert(self, tokens: list[int]) -> int:
        tokens = tokens[: len(tokens) // self.cfg.page_size * self.cfg.page_size]
        if not tokens or self.allocator.available_size() < len(tokens):
            return -1
        params = InsertParams(
            key=RadixKey(array("q", tokens)), value=self.allocator.alloc(len(tokens))
        )
        if self.cfg.has_mamba:
            req = self._request()
            if req is None:
                return -1
            params.mamba_value = req.kv.mamba_pool_idx.unsqueeze(0)
        return self.cache.insert(params).prefix_len

    def match_and_lock(self, tokens: list[int]) -> int:
        match = match_prefix(self.cache, tokens)
        self.locks.append(self.cache.lock(match.last_device_node))
        return match.device_prefix_len

    def unlock(self, pick: int) -> None:
        if self.locks:
            self.cache.unlock(self.locks.pop(pick % len(self.locks)))

    def evict(self, amount: int, full: bool = True) -> tuple[int, int, int]:
        """SGLang's eviction for `amount` pages of full attention (if `full`), `amount`
        sliding-window tokens and one Mamba state (`amount` without `full`)."""
        params = EvictParams(num_tokens=amount * self.cfg.page_size if full else 0)
        if self.cfg.has_swa:
            params.swa_num_tokens = amount
        if self.cfg.has_mamba:
            params.mamba_num = 1 if full else amount
        aux = [ct for ct in self.cache.tree_core.component_types if ct is not FULL]
        before = {ct: set(self.holding(ct)) for ct in aux}
        result = self.cache.evict(params)
        present = {node.id: node for node in self.cache.tree_core._collect_all_nodes()}
        for ct in aux:
            self.tombstones += sum(
                1
                for node_id in before[ct]
                if node_id in present and present[node_id].component_data[ct].value is None
            )
        return (
            result.num_tokens_evicted,
            getattr(result, "swa_num_tokens_evicted", 0),
            getattr(result, "mamba_num_evicted", 0),
        )

    def sizes(self) -> tuple[int, ...]:
        tree = self.cache.tree_core
        return tuple(
            size
            for component in tree.component_types
            for size in (
                tree.component_evictable_size(component),
                tree.component_protected_size(component),
            )
        )

    def _request(self) -> Any:
        from sglang.srt.managers.schedule_batch import Req
        from sglang.srt.sampling.sampling_params import SamplingParams

        req = Req(
            rid="x", origin_input_text="", origin_input_ids=array("q"),
            sampling_params=SamplingParams(temperature=0, max_new_tokens=1),
        )  # fmt: skip
        if self.pool.alloc([req]) is None:
            return None
        return req


prefixes = st.lists(st.integers(1, 6), min_size=1, max_size=12)
op_list = st.lists(
    st.one_of(
        st.tuples(st.just("insert"), st.integers(0, 2), st.integers(1, 12), st.integers(0, 9)),
        st.tuples(st.just("match"), st.integers(0, 2), st.integers(1, 12)),
        st.tuples(st.just("unlock"), st.integers(0, 7)),
        st.tuples(st.just("evict"), st.integers(1, 8)),
        st.tuples(st.just("evict_state"), st.integers(1, 8)),
    ),
    max_size=24,
)


def apply(driver: Driver, bases: list[list[int]], op: tuple) -> Any:
    if op[0] == "insert":
        _, which, cut, tail = op
        suffix = [100 + tail] * 4 if tail < 7 else []  # none: a later insert may extend it
        return driver.insert(bases[which % len(bases)][:cut] + suffix)
    if op[0] == "match":
        _, which, cut = op
        return driver.match_and_lock(bases[which % len(bases)][:cut])
    if op[0] == "unlock":
        return driver.unlock(op[1])
    return driver.evict(op[1], full=op[0] == "evict")


def check(driver: Driver) -> None:
    driver.cache.tree_core.check_invariants()
    driver.cache.sanity_check()


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
