"""The sglang-stock arm: SGLang 0.5.23's own radix cache behind the replay's arm interface.

The example tests pin down SGLang's semantics as the arm exposes them (prefix matching,
the never-matched last token, its eviction order per policy, all-or-nothing admission);
the property test runs random admit / grow / finish sequences and checks the slot
accounting between SGLang's allocator, its tree and the running requests.
"""

from __future__ import annotations

from array import array
from itertools import count

import pytest

pytest.importorskip("sglang", reason="SGLang is not installed (see requirements/sglang-replay.txt)")

from arm_ops import admit_request, operations, prefix_sets  # noqa: E402
from hypothesis import given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402
from sglang.srt.mem_cache.radix_cache import RadixKey  # noqa: E402

from kvplug.errors import UnknownPolicyError  # noqa: E402
from kvplug.replay.arms.base import FRESH_UNIT_BASE, ArmStats, ArmUnavailable  # noqa: E402
from kvplug.replay.arms.sglang import SGLangStockArm, sglang_policies  # noqa: E402

fresh = count(FRESH_UNIT_BASE)  # sentinels and decode units: never shared


def sequential(arm: SGLangStockArm, req_id: int, prompt: list[int]) -> int | None:
    """One request as the sequential replay runs it: prompt plus a fresh sentinel, computed
    up to the sentinel, finished at once."""
    hits = arm.admit(req_id, [*prompt, next(fresh)], len(prompt))
    if hits is not None:
        arm.finish(req_id)
    return hits


def pool_state(arm: SGLangStockArm) -> tuple[int, int, int]:
    """(evictable, protected) units in SGLang's tree and free slots in its allocator."""
    cache = arm.cache
    return cache.evictable_size(), cache.protected_size(), arm.allocator.available_size()


def test_second_request_matches_the_shared_prefix() -> None:
    arm = SGLangStockArm(16)
    assert sequential(arm, 1, [1, 2, 3, 4]) == 0
    assert sequential(arm, 2, [1, 2, 3, 9]) == 3
    assert sequential(arm, 3, [1, 2, 7]) == 2
    # The tree holds 1 2 3 {4, 9, 7}: shared units are stored once.
    assert arm.stats() == ArmStats(evictions=0, churn=0, cached_blocks=6)


def test_full_hit_needs_the_sentinel() -> None:
    arm = SGLangStockArm(8)
    assert sequential(arm, 1, [1, 2, 3]) == 0
    assert sequential(arm, 2, [1, 2, 3]) == 3  # the sentinel is the unmatched last token
    # Without it SGLang leaves the last token to compute, so it allocates one slot for it.
    free = arm.allocator.available_size()
    assert arm.admit(3, [1, 2, 3], 3) == 2
    assert arm.allocator.available_size() == free - 1
    arm.finish(3)
    assert arm.stats() == ArmStats(evictions=0, churn=0, cached_blocks=3)


def test_a_request_computes_at_least_one_unit() -> None:
    arm = SGLangStockArm(8)
    for prompt, compute in (([], 0), ([1, 2], 0), ([1, 2], 3)):
        with pytest.raises(ValueError, match="compute must be in"):
            arm.admit(1, prompt, compute)
    assert not arm.requests and pool_state(arm) == (0, 0, 8)


@pytest.mark.parametrize(
    ("policy", "evicted", "kept", "churn"),
    [
        ("lru", [1, 2], [3, 4], 0),  # [1, 2] was used least recently (it had a hit)
        ("lfu", [3, 4], [1, 2], 2),  # [3, 4] was inserted by one request only
    ],
)
def test_eviction_order(policy: str, evicted: list[int], kept: list[int], churn: int) -> None:
    arm = SGLangStockArm(6, policy)
    assert sequential(arm, 1, [1, 2]) == 0
    assert sequential(arm, 2, [1, 2]) == 2
    assert sequential(arm, 3, [3, 4]) == 0
    assert sequential(arm, 4, [5, 6, 7, 8]) == 0  # 2 free slots: one 2-unit leaf goes
    assert arm.stats() == ArmStats(evictions=2, churn=churn, cached_blocks=6)
    assert sequential(arm, 5, kept) == 2
    assert sequential(arm, 6, evicted) == 0


def test_lru_skips_locked_prefixes_and_evicts_whole_nodes() -> None:
    arm = SGLangStockArm(6, "lru")
    assert sequential(arm, 1, [1, 2]) == 0
    assert arm.admit(2, [1, 2, 3, next(fresh)], 3) == 2  # runs on, locking [1, 2]
    assert sequential(arm, 3, [4, 5, 6]) == 0  # the most recent leaf: 0 slots left free
    # [1, 2] is the least recently used leaf but locked, so [4, 5, 6] goes, all three
    # units of the node although only one slot was short.
    assert sequential(arm, 4, [7]) == 0
    assert arm.stats() == ArmStats(evictions=3, churn=3, cached_blocks=3)
    arm.finish(2)
    assert sequential(arm, 5, [1, 2, 3]) == 3


def test_request_that_does_not_fit_changes_nothing() -> None:
    arm = SGLangStockArm(4)
    assert sequential(arm, 1, [1, 2]) == 0
    assert arm.admit(2, [5, 6, next(fresh)], 2) == 0  # running: 2 slots, 0 left free
    before = pool_state(arm)
    assert before == (2, 0, 0)
    # It matches [1, 2] (locked while SGLang checks the budget), then cannot get 2 slots.
    assert arm.admit(3, [1, 2, 3, 4, next(fresh)], 4) is None
    assert pool_state(arm) == before
    assert 3 not in arm.requests
    assert not arm.grow(2, [next(fresh) for _ in range(3)])
    assert pool_state(arm) == before
    # Two units fit by evicting [1, 2]: the failed admission's match was not a hit.
    assert arm.grow(2, [next(fresh), next(fresh)])
    assert arm.stats() == ArmStats(evictions=2, churn=2, cached_blocks=0)
    arm.finish(2)
    assert pool_state(arm) == (4, 0, 0)


@pytest.mark.parametrize("policy", sglang_policies())
def test_every_sglang_policy_runs(policy: str) -> None:
    arm = SGLangStockArm(4, policy)
    prompts = [[1, 2], [1, 2], [3, 4], [5, 6, 7]]  # the last one needs both leaves evicted
    assert [sequential(arm, i, prompt) for i, prompt in enumerate(prompts)] == [0, 2, 0, 0]
    assert arm.stats() == ArmStats(evictions=4, churn=2, cached_blocks=3)
    assert arm.name == f"sglang-stock:{policy}"


def test_unknown_policy_lists_sglang_policies() -> None:
    with pytest.raises(UnknownPolicyError) as error:
        SGLangStockArm(8, "belady")
    for name in ("lru", "lfu", "fifo", "mru", "filo", "priority", "slru"):
        assert name in str(error.value)


def test_other_sglang_version_is_unavailable(monkeypatch: pytest.MonkeyPatch) -> None:
    import sglang

    monkeypatch.setattr(sglang, "__version__", "0.5.22")
    with pytest.raises(ArmUnavailable, match=r"0\.5\.23 only, but SGLang 0\.5\.22"):
        SGLangStockArm(8)


# Operations: see tests/arm_ops.py.


def check_slots(arm: SGLangStockArm) -> None:
    """Every slot is in exactly one place: the allocator's free list, the tree, or the own
    part of a running request's row (past its tree-owned prefix)."""
    free = arm.allocator.get_all_free_pages().tolist()
    tree = arm.cache.all_values_flatten().tolist()
    own = []
    for req in arm.requests.values():
        row = arm.req_to_token_pool.req_to_token[req.kv.req_pool_idx]
        own += row[req.kv.cache_protected_len : req.kv.kv_allocated_len].tolist()
        # The tree still holds the prefix the request matched, in the slots its row names.
        assert row[: req.prefix_len].tolist() == arm.cache.prefix_device_indices(req).tolist()
    assert len(free) + len(tree) + len(own) == arm.capacity_blocks
    assert sorted(free + tree + own) == list(range(1, arm.capacity_blocks + 1))
    assert arm.stats().cached_blocks == len(tree)


def cached_length(arm: SGLangStockArm, units: list[int]) -> int:
    """How much of `units` SGLang's tree holds, read without touching its recency."""
    key = RadixKey(array("q", units))
    return arm.cache.tree_core.match_full_device_prefix(key)[0]


def check_invariants_through(
    capacity: int, policy: str, prefixes: list[list[int]], ops: list[tuple]
) -> None:
    arm = SGLangStockArm(capacity, policy)
    stored: set[tuple[int, ...]] = {()}  # every prefix any finished request inserted
    sequences: dict[int, list[int]] = {}  # running request -> units its slots hold
    evictions = 0
    for req_id, op in enumerate(ops):
        if op[0] == "admit":
            prompt, compute = admit_request(op, prefixes, fresh)
            hits = arm.admit(req_id, prompt, compute)
            if hits is not None:
                assert 0 <= hits <= len(prompt) - 1  # SGLang never matches the last token
                assert tuple(prompt[:hits]) in stored
                sequences[req_id] = prompt[: max(hits, compute)]
        elif not sequences:
            continue
        elif op[0] == "grow":
            target = list(sequences)[op[1] % len(sequences)]
            units = [next(fresh) for _ in range(op[2])]
            if arm.grow(target, units):
                # Slots follow positions: the first grown slot holds the next prompt unit
                # (the sentinel, if any), as in SGLang's request row.
                req = arm.requests[target]
                whole = [*req.origin_input_ids, *req.output_ids]
                sequences[target] = whole[: len(sequences[target]) + len(units)]
        else:
            target = list(sequences)[op[1] % len(sequences)]
            arm.finish(target)
            sequence = sequences.pop(target)
            stored.update(tuple(sequence[:n]) for n in range(len(sequence) + 1))
            assert cached_length(arm, sequence) == len(sequence)  # all of it went in
        assert set(arm.requests) == set(sequences)
        check_slots(arm)
        stats = arm.stats()
        assert evictions <= stats.evictions and 0 <= stats.churn <= stats.evictions
        evictions = stats.evictions


@settings(max_examples=150, deadline=None)
@given(
    capacity=st.integers(2, 24),
    policy=st.sampled_from(sglang_policies()),
    prefixes=prefix_sets,
    ops=operations,
)
def test_slot_accounting_holds_through_random_requests(
    capacity: int, policy: str, prefixes: list[list[int]], ops: list[tuple]
) -> None:
    check_invariants_through(capacity, policy, prefixes, ops)
