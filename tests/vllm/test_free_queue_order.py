"""The free queue's order is kvplug's eviction order, for whatever walks it from its head.

vLLM's lazy CPU offload (and other tiers) walk ``free_block_queue.iter_blocks_after(None)``
expecting the blocks the allocator takes next; vLLM 0.34's ``free_blocks(...,
evict_first=True)`` returns blocks another tier holds to the eviction end. Here, after
random request sequences under every ranked policy, some cached blocks given back to
evict first, the walk is compared with what ``get_new_blocks`` then hands out, block for
block; and a ranked policy whose choice differs from the release order shows the walk is
the policy's, not vLLM's.
"""

from __future__ import annotations

import inspect
from itertools import count

import pytest

pytest.importorskip("vllm", reason="vLLM is not installed (pip install 'kvplug[vllm]')")

from hypothesis import given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402
from vllm.v1.core.block_pool import BlockPool  # noqa: E402

from kvplug.policies import make_policy  # noqa: E402
from kvplug.policies.base import RankedPolicy  # noqa: E402
from kvplug.replay.arms.base import FRESH_UNIT_BASE  # noqa: E402
from kvplug.replay.arms.vllm import VLLMStockArm  # noqa: E402

F = FRESH_UNIT_BASE
RANKED = ["lfu", "gdsf", "cost", "learned"]
VLLM_EVICT_FIRST = "evict_first" in inspect.signature(BlockPool.free_blocks).parameters

admit_ops = st.tuples(
    st.just("admit"), st.integers(0, 2), st.integers(1, 8), st.lists(st.integers(0, 5), max_size=3)
)
finish_ops = st.tuples(st.just("finish"), st.integers(0, 7))
operations = st.lists(st.one_of(admit_ops, admit_ops, finish_ops), min_size=5, max_size=40)
prefix_sets = st.lists(st.lists(st.integers(0, 5), min_size=1, max_size=8), min_size=1, max_size=3)


def free_to_evict_first(pool, blocks) -> None:
    """What a lazy offloader does with blocks it copied out: vLLM 0.34's
    ``free_blocks(blocks, evict_first=True)``, or the same calls on a release without it."""
    if VLLM_EVICT_FIRST:
        pool.free_blocks(blocks, evict_first=True)
        return
    for block in blocks:
        block.ref_cnt -= 1
    pool.free_block_queue.prepend_n([b for b in blocks if b.ref_cnt == 0])


def run(arm: VLLMStockArm, prefixes, ops) -> list[int]:
    fresh = count(F)
    running: list[int] = []
    for req_id, op in enumerate(ops):
        if op[0] == "admit":
            _, which, cut, tail = op
            prompt = prefixes[which % len(prefixes)][:cut] + list(tail) + [next(fresh)]
            if arm.admit(req_id, prompt, len(prompt) - 1) is not None:
                running.append(req_id)
        elif running:
            arm.finish(running.pop(op[1] % len(running)))
    return running


@pytest.mark.parametrize("policy", RANKED)
@settings(max_examples=80, deadline=None)
@given(
    capacity=st.integers(2, 24),
    prefixes=prefix_sets,
    ops=operations,
    offloaded=st.lists(st.integers(0, 30), max_size=4, unique=True),
)
def test_the_walk_from_the_head_is_the_order_blocks_are_handed_out(
    policy, capacity, prefixes, ops, offloaded
):
    arm = VLLMStockArm(capacity, make_policy(policy))
    pool = arm.manager.block_pool
    run(arm, prefixes, ops)
    queue = pool.free_block_queue
    cached = [b for b in queue.iter_blocks_after(None) if b.block_hash is not None]
    picked = [cached[i] for i in offloaded if i < len(cached)]
    if picked:  # a tier copied them out: touched for the copy, then given back to go first
        pool.touch(picked)
        free_to_evict_first(pool, picked)
        pool.check_invariants()
    walk = list(queue.iter_blocks_after(None))
    assert len(walk) == pool.get_num_free_blocks() == len({b.block_id for b in walk})
    first_cached = [b for b in walk if b.block_hash is not None][: len(picked)]
    assert {b.block_id for b in first_cached} == {b.block_id for b in picked}
    if walk:
        middle = walk[len(walk) // 2]
        assert list(queue.iter_blocks_after(middle)) == walk[len(walk) // 2 + 1 :]
    assert queue.get_all_free_blocks() == walk
    taken = pool.get_new_blocks(len(walk))
    assert [b.block_id for b in taken] == [b.block_id for b in walk]
    pool.check_invariants()


class Reversed(RankedPolicy):
    """Evicts the block released last first: never vLLM's order."""

    name = "reversed"

    def rank(self, node) -> float:
        return -float(self._serials_released())

    def _serials_released(self) -> int:
        self.count = getattr(self, "count", 0) + 1
        return self.count


def test_the_walk_follows_the_policy_not_the_release_order():
    arm = VLLMStockArm(6, Reversed())
    pool = arm.manager.block_pool
    for req_id, prompt in enumerate(([1, F], [2, F + 1], [3, F + 2])):
        assert arm.admit(req_id, prompt, 1) == 0
        arm.finish(req_id)
    walk = [b for b in pool.free_block_queue.iter_blocks_after(None) if b.block_hash is not None]
    released = [b.block_id for b in pool.blocks if b.block_hash is not None]
    assert [b.block_id for b in walk] != sorted(released)  # not the order of release
    assert arm.admit(9, [7, 8, 9, 10, F + 9], 4) == 0  # takes the fresh blocks, then evicts
    assert arm.admit(10, [3, F + 10], 1) == 0  # the last released went first
    assert arm.admit(11, [1, F + 11], 1) == 1  # the first released is still there
