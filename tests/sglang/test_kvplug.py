"""kvplug inside SGLang's real radix cache, driven as SGLang's scheduler drives it.

The `sglang-kvplug:<policy>` replay arm is SGLang 0.5.23's `UnifiedRadixCache` built as
``--radix-cache-backend kvplug`` builds it (for this full-attention cache: on SGLang's
Rust tree core, `kvplug.sglang.rust_core`). These tests check that

- ``kvplug-lru`` evicts exactly as SGLang's own ``lru``: over random admit / decode /
  finish sequences (hypothesis), the two caches return the same hits and hold the same
  slots after every operation;
- under every kvplug policy the eviction core's candidates stay exactly SGLang's
  evictable leaves (the tree core's `check_invariants`: on the Rust core, the mirror
  audited against Rust) and the slot accounting holds.
"""

from __future__ import annotations

from itertools import count

import pytest

pytest.importorskip("sglang", reason="SGLang is not installed (see requirements/sglang-replay.txt)")

from arm_ops import admit_request, operations, prefix_sets  # noqa: E402
from hypothesis import given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

from kvplug.errors import UnknownPolicyError  # noqa: E402
from kvplug.replay.arms.base import FRESH_UNIT_BASE, ArmStats  # noqa: E402
from kvplug.replay.arms.sglang import SGLangStockArm  # noqa: E402
from kvplug.replay.arms.sglang_kvplug import SGLangKVPlugArm  # noqa: E402

POLICIES = ["lru", "lfu", "gdsf", "cost"]
fresh = count(FRESH_UNIT_BASE)


def sequential(arm: SGLangStockArm, req_id: int, prompt: list[int]) -> int | None:
    hits = arm.admit(req_id, [*prompt, next(fresh)], len(prompt))
    if hits is not None:
        arm.finish(req_id)
    return hits


def state(arm: SGLangStockArm) -> tuple[int, int, list[int]]:
    """What must agree between equivalent arms: tree sizes and the free slots."""
    cache = arm.cache
    free = sorted(arm.allocator.get_all_free_pages().tolist())
    return cache.evictable_size(), cache.protected_size(), free


def test_arm_name_and_unknown_policy() -> None:
    assert SGLangKVPlugArm(8, "cost").name == "sglang-kvplug:cost"
    with pytest.raises(UnknownPolicyError, match="known policies: .*cost"):
        SGLangKVPlugArm(8, "nope")


def test_lru_order_matches_sglang_on_a_small_case() -> None:
    stock, kvplug = SGLangStockArm(6, "lru"), SGLangKVPlugArm(6, "lru")
    prompts = [[1, 2], [1, 2], [3, 4], [5, 6, 7, 8], [3, 4], [1, 2]]
    for arm in (stock, kvplug):
        hits = [sequential(arm, i, prompt) for i, prompt in enumerate(prompts)]
        assert hits == [0, 2, 0, 0, 2, 0]
        assert arm.stats() == ArmStats(evictions=6, churn=4, cached_blocks=4)


@pytest.mark.parametrize(("uses", "config"), [(3, None), (2, {"frequency_weight": 1})])
def test_cost_keeps_the_reused_prefix(uses: int, config: dict | None) -> None:
    """cost ranks a prefix three requests used above a one-off leaf of the same size; with
    the frequency term at full weight, a prefix two requests used."""
    arm = SGLangKVPlugArm(6, "cost", policy_config=config)
    for req_id in range(uses):
        assert sequential(arm, req_id, [1, 2]) == (2 if req_id else 0)
    assert sequential(arm, 10, [3, 4]) == 0
    assert sequential(arm, 11, [5, 6, 7, 8]) == 0
    arm.cache.tree_core.check_invariants()
    assert sequential(arm, 12, [1, 2]) == 2


def test_locked_prefix_is_never_a_candidate() -> None:
    arm = SGLangKVPlugArm(6, "lru")
    assert sequential(arm, 1, [1, 2]) == 0
    assert arm.admit(2, [1, 2, 3, next(fresh)], 3) == 2  # runs on, locking [1, 2]
    tree = arm.cache.tree_core
    tree.check_invariants()
    assert all(not tree.eviction.is_candidate(r) for r in tree.records.values())
    assert sequential(arm, 3, [4, 5, 6]) == 0
    assert sequential(arm, 4, [7]) == 0  # evicts [4, 5, 6], not the locked [1, 2]
    tree.check_invariants()
    arm.finish(2)
    assert sequential(arm, 5, [1, 2, 3]) == 3


# Operations: see tests/arm_ops.py.


def run_ops(arms: list[SGLangStockArm], prefixes: list[list[int]], ops: list[tuple]) -> None:
    """Apply `ops` to every arm alike; after each one, all arms agree and kvplug's
    tree core passes its audit."""
    running: list[int] = []
    for req_id, op in enumerate(ops):
        if op[0] == "admit":
            prompt, compute = admit_request(op, prefixes, fresh)
            results = [arm.admit(req_id, prompt, compute) for arm in arms]
            if results[0] is not None:
                running.append(req_id)
        elif not running:
            continue
        elif op[0] == "grow":
            target = running[op[1] % len(running)]
            units = [next(fresh) for _ in range(op[2])]
            results = [arm.grow(target, units) for arm in arms]
        else:
            target = running.pop(op[1] % len(running))
            results = [arm.finish(target) for arm in arms]
        assert len(set(results)) == 1, f"{op}: {results}"
        states = [state(arm) for arm in arms]
        assert all(s == states[0] for s in states), f"after {op}: {states}"
        stats = [arm.stats() for arm in arms]
        assert all(s == stats[0] for s in stats), f"after {op}: {stats}"
        for arm in arms:
            if isinstance(arm, SGLangKVPlugArm):
                arm.cache.tree_core.check_invariants()


@settings(max_examples=120, deadline=None)
@given(capacity=st.integers(2, 24), prefixes=prefix_sets, ops=operations)
def test_kvplug_lru_evicts_as_sglang_lru(
    capacity: int, prefixes: list[list[int]], ops: list[tuple]
) -> None:
    run_ops([SGLangStockArm(capacity, "lru"), SGLangKVPlugArm(capacity, "lru")], prefixes, ops)


@settings(max_examples=60, deadline=None)
@given(
    capacity=st.integers(2, 24),
    policy=st.sampled_from(POLICIES),
    prefixes=prefix_sets,
    ops=operations,
)
def test_candidates_stay_sglang_leaves_under_every_policy(
    capacity: int, policy: str, prefixes: list[list[int]], ops: list[tuple]
) -> None:
    run_ops([SGLangKVPlugArm(capacity, policy)], prefixes, ops)


def learned(arm: SGLangKVPlugArm) -> dict[int, tuple[int, bool, int, int]]:
    """Per node, by the token count its path ends at: what its record learned at its
    last release (from_end, request_hit, request_output) and its depth."""
    return {
        r.end: (r.from_end, r.request_hit, r.request_output, r.depth)
        for r in arm.cache.tree_core.records.values()
    }


def test_released_nodes_learn_what_their_request_knew() -> None:
    """A finished request's path learns, at its release, what kvplug's own cache tells
    its policy: pages of the request after each node (0 for its leaf), whether it reused
    the cache, how many tokens it generated; each node's depth is its span's middle."""
    arm = SGLangKVPlugArm(64, "cost")
    prefix = list(range(1, 9))
    assert sequential(arm, 1, prefix) == 0
    assert learned(arm) == {8: (0, False, 0, 3)}
    prompt = [*prefix, 9, 10, 11, 12, next(fresh)]
    assert arm.admit(2, prompt, len(prompt) - 1) == 8
    assert arm.grow(2, [next(fresh) for _ in range(3)])
    arm.finish(2)
    arm.cache.tree_core.check_invariants()
    # the request holds 15 pages (its last is 14); SGLang splits the leaf where its
    # prompt ends: the prefix [0, 8), the prompt's tail [8, 13), the output [13, 15)
    assert learned(arm) == {8: (7, True, 3, 3), 13: (2, True, 3, 10), 15: (0, True, 3, 13)}
    # a caller whose units stand for many tokens (the replay) names the output itself
    assert arm.admit(3, [*prefix, next(fresh)], len(prefix)) == len(prefix)
    arm.finish(3, output_tokens=700)
    assert learned(arm)[8] == (0, True, 700, 3)  # its whole request, this time


def test_cost_prices_a_node_by_the_middle_of_its_span() -> None:
    """Two never-reused leaves of the same class that end at the same page: X holds
    pages 8-9 below a shared prefix, Y pages 1-9 below another. Kept per page, Y's pages
    save less (most sit shallower), so ``cost`` takes its victim from Y (its last two
    pages, all the allocation needs); valued at its last page, Y would tie with X, and
    X, released first, would go."""
    arm = SGLangKVPlugArm(20, "cost", policy_config={"tokens_per_block": 512})
    p, q = list(range(1, 9)), [40]
    x, y = [*p, 9, 10], [*q, *range(41, 50)]
    for req_id, prompt in enumerate([p, q]):
        assert sequential(arm, req_id, prompt) == 0
    # both run before either finishes: each hit is counted (and learned from) before
    # either leaf is ranked, so the two are ranked with the same odds
    assert arm.admit(2, [*x, next(fresh)], len(x)) == len(p)
    assert arm.admit(3, [*y, next(fresh)], len(y)) == len(q)
    arm.finish(2)
    arm.finish(3)
    assert sequential(arm, 4, [60, 61]) == 0  # needs two pages: one leaf goes
    arm.cache.tree_core.check_invariants()
    assert arm.admit(5, [*x, next(fresh)], 1) == len(x)
    arm.finish(5)
    assert arm.admit(6, [*y, next(fresh)], 1) == len(y) - 2


@pytest.mark.parametrize(("policy", "kept"), [("lru", 0), ("cost", 7), ("gdsf", 7)])
def test_a_victim_node_loses_only_the_pages_needed(policy: str, kept: int) -> None:
    """A 10-page leaf is the victim of a 3-page allocation: a policy that values
    position frees its last 3 pages and keeps the 7 before them cached (kvplug's own
    cache evicts a chain from its tail, a block at a time); ``lru`` frees the node whole,
    as SGLang does."""
    arm = SGLangKVPlugArm(10, policy)
    long = list(range(1, 11))
    assert sequential(arm, 1, long) == 0
    assert sequential(arm, 2, [50, 51, 52]) == 0
    arm.cache.tree_core.check_invariants()
    assert arm.cache.evictable_size() == kept + 3
    assert arm.admit(3, [*long, next(fresh)], 1) == kept
