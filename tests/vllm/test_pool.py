"""kvplug's block pool inside vLLM's own KV cache manager (no model, no scheduler).

`VLLMStockArm(capacity, policy)` builds vLLM's `KVCacheManager` the way
``--scheduler-cls kvplug.vllm.Scheduler`` does, so these tests drive vLLM's real
coordinator and single-type manager over `KVPlugBlockPool`:

- under every online policy, random admit / grow / finish sequences keep the pool's
  invariants after every step (each block held, fresh or cached, never two; reference
  counts never negative; the policy's candidates are exactly the cached leaves);
- the cost policy is tree-aware: a shared root outlives the leaves below it, but is not
  immortal once they are gone;
- blocks evicted on request while free (a KV connector's `evict_blocks`) and a prefix
  cache reset leave the pool consistent.

That kvplug's pool with ``lru`` evicts exactly what vLLM's pool evicts is tested in
test_vllm_stock.py; here, that its untracked fast path counts what the eviction core's
path counts.
"""

from __future__ import annotations

from itertools import count

import pytest

pytest.importorskip("vllm", reason="vLLM is not installed (pip install 'kvplug[vllm]')")

from hypothesis import given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402
from ranked_policies import NewestFirst, TrackedLRU  # noqa: E402

from kvplug.policies import make_policy  # noqa: E402
from kvplug.replay.arms.base import FRESH_UNIT_BASE  # noqa: E402
from kvplug.replay.arms.vllm import VLLMStockArm  # noqa: E402
from kvplug.vllm.block_pool import KVPlugBlockPool  # noqa: E402

F = FRESH_UNIT_BASE
ONLINE_POLICIES = ["lru", "lfu", "gdsf", "cost", "learned"]

admit_ops = st.tuples(
    st.just("admit"), st.integers(0, 2), st.integers(1, 8), st.lists(st.integers(0, 5), max_size=3)
)
grow_ops = st.tuples(st.just("grow"), st.integers(0, 7), st.integers(1, 3))
finish_ops = st.tuples(st.just("finish"), st.integers(0, 7))
operations = st.lists(
    st.one_of(admit_ops, admit_ops, grow_ops, finish_ops), min_size=20, max_size=60
)
prefix_sets = st.lists(st.lists(st.integers(0, 5), min_size=1, max_size=8), min_size=1, max_size=3)


def pool_of(arm: VLLMStockArm) -> KVPlugBlockPool:
    pool = arm.manager.block_pool
    assert isinstance(pool, KVPlugBlockPool)
    return pool


@pytest.mark.parametrize("policy", ONLINE_POLICIES)
@settings(max_examples=60, deadline=None)
@given(capacity=st.integers(2, 24), prefixes=prefix_sets, ops=operations)
def test_invariants_hold_after_every_step(policy, capacity, prefixes, ops):
    arm = VLLMStockArm(capacity, make_policy(policy))
    pool = pool_of(arm)
    fresh = count(F)
    running: list[int] = []
    for req_id, op in enumerate(ops):
        if op[0] == "admit":
            _, which, cut, tail = op
            prompt = prefixes[which % len(prefixes)][:cut] + list(tail) + [next(fresh)]
            if arm.admit(req_id, prompt, len(prompt) - 1) is not None:
                running.append(req_id)
        elif running and op[0] == "grow":
            arm.grow(running[op[1] % len(running)], [next(fresh) for _ in range(op[2])])
        elif running:
            arm.finish(running.pop(op[1] % len(running)))
        pool.check_invariants()
    for req_id in running:
        arm.finish(req_id)
    pool.check_invariants()
    assert pool.get_num_free_blocks() == capacity  # everything came back


def test_a_cheap_root_still_waits_for_its_leaves():
    # Released together and never reused, the root is worth least (fewest tokens before it),
    # so a flat ranking would evict it first and orphan the two blocks below it.
    arm = VLLMStockArm(4, make_policy("cost"))
    assert arm.admit(0, [1, 2, 3, F], 3) == 0
    arm.finish(0)
    assert arm.admit(1, [9, F + 1], 1) == 0  # takes the free block
    assert arm.admit(2, [8, F + 2], 1) == 0  # evicts one cached block: the leaf (1, 2, 3)
    arm.finish(1)
    arm.finish(2)
    assert arm.admit(3, [1, 2, 3, F + 3], 3) == 2  # (1) and (1, 2) are still there
    pool_of(arm).check_invariants()


def test_shared_root_outlives_its_leaves_but_is_not_immortal():
    arm = VLLMStockArm(4, make_policy("cost"))
    pool = pool_of(arm)
    root = [1, 2]
    for req_id, leaf in enumerate([3, 4]):  # (1), (1,2), then leaves (1,2,3) and (1,2,4)
        assert arm.admit(req_id, [*root, leaf, F + req_id], 3) == (2 if req_id else 0)
        arm.finish(req_id)
    pool.check_invariants()
    # Two fresh blocks must come from the two leaves, never from the root they hang off.
    assert arm.admit(10, [7, 8, F + 10], 2) == 0
    assert arm.admit(11, [*root, F + 11], 2) == 2
    arm.finish(10)
    arm.finish(11)
    # Now the root's subtree is a leaf chain; a scan of new prompts pushes it out too.
    for req_id in range(20, 24):
        assert arm.admit(req_id, [100 + req_id, 200 + req_id, F + req_id], 2) is not None
        arm.finish(req_id)
        pool.check_invariants()
    assert arm.admit(30, [*root, F + 30], 2) == 0


def test_evict_on_request_and_reset_keep_the_pool_consistent():
    arm = VLLMStockArm(6, make_policy("cost"))
    pool = pool_of(arm)
    assert arm.admit(0, [1, 2, 3, F], 3) == 0
    arm.finish(0)
    cached = [b.block_id for b in pool.blocks if b.block_hash is not None]
    pool.evict_blocks({cached[-1]})  # a connector evicts a free, cached block
    pool.check_invariants()
    assert pool.get_num_free_blocks() == 6
    assert arm.admit(1, [1, 2, 3, F + 1], 3) in (0, 1, 2)
    arm.finish(1)
    assert pool.reset_prefix_cache()
    pool.check_invariants()
    assert pool.num_cached_blocks() == 0
    assert arm.admit(2, [1, 2, 3, F + 2], 3) == 0


@settings(max_examples=60, deadline=None)
@given(capacity=st.integers(2, 24), prefixes=prefix_sets, ops=operations)
def test_untracked_lru_counts_what_tracked_lru_counts(capacity, prefixes, ops):
    """With ``lru`` the pool keeps no records; its answers and kvplug's counters (hits,
    evictions, churn, cached blocks) are those of the same order ranked by the core."""
    fast, tracked = VLLMStockArm(capacity, make_policy("lru")), VLLMStockArm(capacity, TrackedLRU())
    assert not pool_of(fast).tracked and pool_of(tracked).tracked
    fresh = count(F)
    running: list[int] = []
    for req_id, op in enumerate(ops):
        if op[0] == "admit":
            _, which, cut, tail = op
            prompt = prefixes[which % len(prefixes)][:cut] + list(tail) + [next(fresh)]
            got = [arm.admit(req_id, prompt, len(prompt) - 1) for arm in (fast, tracked)]
            assert got[0] == got[1]
            if got[0] is not None:
                running.append(req_id)
        elif running and op[0] == "grow":
            units = [next(fresh) for _ in range(op[2])]
            target = running[op[1] % len(running)]
            assert fast.grow(target, units) == tracked.grow(target, units)
        elif running:
            target = running.pop(op[1] % len(running))
            fast.finish(target)
            tracked.finish(target)
        pool_of(fast).check_invariants()
        assert pool_of(fast).stats == pool_of(tracked).stats
        assert pool_of(fast).num_cached_blocks() == pool_of(tracked).num_cached_blocks()


@settings(max_examples=40, deadline=None)
@given(
    pages=st.integers(16, 60),
    ops=st.lists(
        st.tuples(
            st.sampled_from(["admit", "admit", "grow", "finish"]),
            st.integers(0, 3),
            st.integers(1, 8),
        ),
        min_size=5,
        max_size=30,
    ),
)
def test_untracked_lru_counts_what_tracked_lru_counts_on_a_mamba_model(pages, ops):
    """The same on the Mamba preset, where vLLM registers partial entries (a Mamba
    state's hash for part of a block) and the untracked pool counts a newly cached block
    by comparing its hash before and after."""
    from kvplug.hybrid.spec import HYBRID_PRESETS
    from kvplug.replay.arms.vllm_hybrid import VLLMHybridArm

    spec = HYBRID_PRESETS["nemotron-h-like"]
    capacity = pages * spec.page_bytes(512)
    fast = VLLMHybridArm(spec, capacity, 512, make_policy("lru"))
    tracked = VLLMHybridArm(spec, capacity, 512, TrackedLRU())
    assert not pool_of(fast).tracked and pool_of(tracked).tracked
    fresh = count(F)
    running: list[int] = []
    for req_id, (op, family, length) in enumerate(ops):
        if op == "admit" or not running:
            prompt = [family * 100 + i for i in range(length)] + [next(fresh)]
            got = [arm.admit(req_id, prompt, length) for arm in (fast, tracked)]
            assert got[0] == got[1]
            if got[0] is not None:
                running.append(req_id)
        elif op == "grow":
            unit = next(fresh)
            target = running[family % len(running)]
            assert fast.grow(target, [unit]) == tracked.grow(target, [unit])
        else:
            target = running.pop(family % len(running))
            fast.finish(target)
            tracked.finish(target)
        pool_of(fast).check_invariants()
        assert pool_of(fast).stats == pool_of(tracked).stats
        assert pool_of(fast).num_cached_blocks() == pool_of(tracked).num_cached_blocks()


def blocks_of(arm: VLLMStockArm, req_id: int) -> list[int]:
    return list(arm.manager.get_block_ids(str(req_id))[0])


@pytest.mark.parametrize(
    ("policy", "victim"),
    [("lru", "older"), ("lfu", "newer"), ("cost", "newer"), ("newest-first", "newer")],
)
def test_the_block_handed_out_is_the_policys_victim(policy, victim):
    """Two cached blocks, the older one reused: vLLM's order (and lru) evicts the older,
    lfu, cost and a newest-first ranking the newer. The block the next request gets must
    be the policy's victim, and the other block must still hit."""
    arm = VLLMStockArm(2, NewestFirst() if policy == "newest-first" else make_policy(policy))
    assert arm.admit(0, [1, F], 1) == 0
    arm.finish(0)
    assert arm.admit(1, [1, F + 1], 1) == 1  # (1) reused once
    older = blocks_of(arm, 1)
    arm.finish(1)
    assert arm.admit(2, [2, F + 2], 1) == 0  # (2), released after (1), never reused
    newer = blocks_of(arm, 2)
    arm.finish(2)
    assert arm.admit(3, [3, F + 3], 1) == 0  # one block: an eviction
    expected = older if victim == "older" else newer
    assert blocks_of(arm, 3) == expected
    arm.finish(3)
    pool_of(arm).check_invariants()
    kept = [2, F + 4] if victim == "older" else [1, F + 4]
    assert arm.admit(4, kept, 1) == 1
