"""kvplug on SGLang's Rust tree core (`kvplug.sglang.rust_core`).

- Decisions: over random sequences of SGLang's cache operations (the fixture's insert,
  match and lock, unlock, evict, at page size 1 and 4) and of the replay arm's requests
  (admit, decode, finish, with partial eviction under ``cost``), a kvplug cache on the
  Rust core and one on the Python core (`kvplug.sglang.tree_core`) return the same
  matches and evictions, hold the same sizes and free the same slots after every
  operation, for every policy; the Rust core's mirror passes its audit against Rust
  (`KVPlugRustTreeCore.check_invariants`) and SGLang's own `sanity_check` after each.
- kvplug decides: ``cost`` keeps a node SGLang's own ``lru`` evicts.
- Selection: the Python core with HiCache; a Rust core asked for where it cannot serve,
  or a bad ``$KVPLUG_SGLANG_TREE_CORE``, is refused by name (the backend's default, the
  Rust core for a full-attention model, is tested in `test_plugin`).
"""

from __future__ import annotations

from itertools import count
from typing import Any

import pytest

pytest.importorskip("sglang", reason="SGLang is not installed (see requirements/sglang-replay.txt)")

from arm_ops import admit_request, operations, prefix_sets  # noqa: E402
from hypothesis import given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402
from sglang_driver import Driver, apply, check, op_list, prefixes  # noqa: E402
from sglang_fixture import build, match_prefix  # noqa: E402

from kvplug.errors import ConfigError  # noqa: E402
from kvplug.replay.arms.base import FRESH_UNIT_BASE  # noqa: E402
from kvplug.replay.arms.sglang_kvplug import SGLangKVPlugArm  # noqa: E402

POLICIES = ["kvplug-lru", "kvplug-lfu", "kvplug-gdsf", "kvplug-cost", "kvplug-learned"]


def free_slots(driver: Driver) -> list[int]:
    return sorted(driver.allocator.get_all_free_pages().tolist())


@pytest.mark.parametrize("shape", ["full-p1", "full-p4"])
@pytest.mark.parametrize("policy", POLICIES)
@settings(max_examples=8, deadline=None)
@given(bases=st.lists(prefixes, min_size=1, max_size=3), ops=op_list)
def test_rust_core_decides_as_the_python_core(
    shape: str, policy: str, bases: list[list[int]], ops: list[tuple]
) -> None:
    python, rust = Driver(shape, policy), Driver(shape, policy, core="rust")
    assert type(rust.cache.tree_core).__name__ == "KVPlugRustTreeCore"
    for op in ops:
        assert apply(python, bases, op) == apply(rust, bases, op), op
        assert python.sizes() == rust.sizes(), op
        assert free_slots(python) == free_slots(rust), op
        check(rust)


def run_arm(arm: SGLangKVPlugArm, prefixes: list[list[int]], ops: list[tuple]) -> list[Any]:
    """The arm's answers and state after each operation (`arm_ops`' meaning)."""
    fresh = count(FRESH_UNIT_BASE)
    running: list[int] = []
    seen: list[Any] = []
    for number, op in enumerate(ops):
        if op[0] == "admit":
            prompt, compute = admit_request(op, prefixes, fresh)
            if not prompt:
                continue
            hits = arm.admit(number, prompt, compute)
            if hits is not None:
                running.append(number)
            seen.append(hits)
        elif running and op[0] == "grow":
            req = running[op[1] % len(running)]
            seen.append(arm.grow(req, [next(fresh) for _ in range(op[2])]))
        elif running:
            arm.finish(running.pop(op[1] % len(running)), output_tokens=op[1])
        seen.append((arm.stats(), arm.cache.evictable_size(), arm.cache.protected_size()))
        if arm.tree_core == "rust":
            arm.cache.tree_core.check_invariants()
    return seen


@pytest.mark.parametrize("policy", ["lru", "cost", "learned"])
@settings(max_examples=10, deadline=None)
@given(prefixes=prefix_sets, ops=operations, capacity=st.integers(6, 24))
def test_the_replay_arm_on_the_rust_core_decides_as_on_the_python_core(
    policy: str, prefixes: list[list[int]], ops: list[tuple], capacity: int
) -> None:
    python = SGLangKVPlugArm(capacity, policy, tree_core="python")
    rust = SGLangKVPlugArm(capacity, policy, tree_core="rust")
    assert type(rust.cache.tree_core).__name__ == "KVPlugRustTreeCore"
    assert run_arm(python, prefixes, ops) == run_arm(rust, prefixes, ops)


def test_partial_eviction_splits_a_victim_on_the_rust_core() -> None:
    """A 30-token leaf under ``cost``, and a request that needs 10 slots more than are
    free: the leaf is split and its last 10 tokens evicted; its head stays cached, on
    both cores alike."""
    for core in ("python", "rust"):
        arm = SGLangKVPlugArm(40, "cost", tree_core=core)
        assert arm.admit(0, [*range(1, 31), 999], 30) == 0
        arm.finish(0)
        assert arm.admit(1, [500 + i for i in range(20)], 20) == 0
        assert arm.stats().evictions == 10, core
        records = arm.cache.tree_core.records.values()
        assert [(r.end - 20, r.end) for r in records] == [(0, 20)], core
        if core == "rust":
            arm.cache.tree_core.check_invariants()


def test_a_victim_back_inside_a_longer_node_returns_on_both_cores() -> None:
    """A 20-token prompt whose last 10 tokens are evicted (split off, partial eviction),
    then a next turn holding it and 5 more tokens: the tree inserts one new node over the
    victim's tokens and beyond, and `cost` finds the victim's prefix inside it (its ghost
    returns, weighing its 10 pages), on both cores alike."""
    for core in ("python", "rust"):
        arm = SGLangKVPlugArm(40, "cost", tree_core=core)
        tree = arm.cache.tree_core
        policy = tree.eviction.policy
        assert policy.spans_blocks
        prompt = [*range(1, 21), 999]
        assert arm.admit(0, prompt, 20) == 0
        arm.finish(0)
        assert arm.admit(1, [500 + i for i in range(30)], 30) == 0
        arm.finish(1)
        assert arm.stats().evictions == 10 and policy._ghost_blocks == 10, core
        (tail,) = policy._ghosts  # the prefix of all 20 tokens
        assert arm.admit(2, [*prompt[:20], 21, 22, 23, 24, 25, 999], 25) == 10
        arm.finish(2)
        (new,) = [r for r in tree.records.values() if r.end == 25]
        assert tail not in policy._ghosts, core
        assert (new.blocks, policy.reuses(new)) == (15, 1), core


def test_cost_keeps_what_sglang_lru_evicts_on_the_rust_core() -> None:
    """One sequence inserted four times (SGLang counts a reuse at each re-insert), then
    another once and matched last (the most recent): SGLang's lru evicts the first,
    kvplug's cost, on the Rust core, the one nobody came back to. (Inserted three times,
    `cost` at its default weight keeps the second: the first's own re-inserts taught the
    class of never-reused blocks that such blocks come back.)"""
    first, second = [1, 1, 1], [2, 2, 2]
    kept = {}
    for policy in ("lru", "kvplug-cost"):
        driver = Driver("full-p1", policy, core="rust")
        for _ in range(4):
            driver.insert(first)
        driver.insert(second)
        driver.match_and_lock(second)
        driver.unlock(0)
        driver.evict(1)
        kept[policy] = [
            tokens
            for tokens in (first, second)
            if match_prefix(driver.cache, tokens).device_prefix_len == len(tokens)
        ]
    assert kept == {"lru": [second], "kvplug-cost": [first]}


# -- selection (the backend's default is in test_plugin) ----------------------------------
def test_a_rust_core_that_cannot_serve_is_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    from kvplug.sglang.backend import choose_tree_core

    stock, _, _ = build("full-p1", "lru")
    params = stock.cache_init_params
    assert choose_tree_core(params, hybrid=False, hicache=True, wanted="auto")[0] == "python"
    with pytest.raises(
        ConfigError, match="KVPLUG_SGLANG_TREE_CORE=rust cannot be served: .*HiCache"
    ):
        choose_tree_core(params, hybrid=False, hicache=True, wanted="rust")
    with pytest.raises(ConfigError, match="not a tree core; choose one of auto, rust, python"):
        choose_tree_core(params, hybrid=False, hicache=False, wanted="c++")
    from kvplug.sglang.rust_core import KVPlugRustTreeCore

    hybrid, _, _ = build("full+swa", "lru")  # a core built directly, past the backend
    with pytest.raises(ConfigError, match="sliding-window.*KVPLUG_SGLANG_TREE_CORE=python"):
        KVPlugRustTreeCore(hybrid.cache_init_params)
    monkeypatch.setenv("KVPLUG_SGLANG_TREE_CORE", "fast")
    with pytest.raises(ConfigError, match="KVPLUG_SGLANG_TREE_CORE='fast' is not a tree core"):
        choose_tree_core(params, hybrid=False, hicache=False)
