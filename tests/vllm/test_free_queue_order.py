"""The free queue's order is kvplug's eviction order, for whatever walks it from its head.

vLLM's lazy CPU offload (and other tiers) walk ``free_block_queue.iter_blocks_after(None)``
expecting the blocks the allocator takes next; vLLM 0.34's ``free_blocks(...,
evict_first=True)`` returns blocks another tier holds to the eviction end. Here, after
random request sequences under every ranked policy, some cached blocks given back to
evict first, the walk is compared with what ``get_new_blocks`` then hands out, block for
block (and with vLLM's linked list, ``fake_free_list_head``); and a ranked policy whose
choice differs from the release order shows the walk is the policy's, not vLLM's. Blocks
given back to evict first go first unless the policy prices tiers (`cost`, `learned`):
then they are ranked as a reload, and a block another tier holds goes before an equally
valuable one held nowhere else.
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
RANKED = ["lfu", "gdsf", "cost", "learned", "cost-unpriced"]


def policy_named(name: str):
    if name == "cost-unpriced":  # vLLM's evict-first lane, as for any policy without tiers
        return make_policy("cost", {"tier_pricing": False})
    return make_policy(name)


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


def linked(queue) -> list:
    """The free blocks as vLLM's linked list holds them, head to tail (and checked tail to
    head), as vLLM's own tests walk it."""
    forward, block = [], queue.fake_free_list_head.next_free_block
    while block is not queue.fake_free_list_tail:
        forward.append(block)
        block = block.next_free_block
    backward, block = [], queue.fake_free_list_tail.prev_free_block
    while block is not queue.fake_free_list_head:
        backward.append(block)
        block = block.prev_free_block
    assert backward[::-1] == forward
    return forward


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
    arm = VLLMStockArm(capacity, policy_named(policy))
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
    if pool.policy.prices_tiers:  # ranked as a reload, wherever that puts them
        assert all(pool.standing(b).held_elsewhere for b in picked)
    else:
        first_cached = [b for b in walk if b.block_hash is not None][: len(picked)]
        assert {b.block_id for b in first_cached} == {b.block_id for b in picked}
    if walk:
        middle = walk[len(walk) // 2]
        assert list(queue.iter_blocks_after(middle)) == walk[len(walk) // 2 + 1 :]
    assert queue.get_all_free_blocks() == walk
    assert linked(queue) == walk
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


def cached_first_blocks(arm: VLLMStockArm, prompts) -> list:
    """Admit and finish each one-block prompt in turn; each request's block."""
    blocks = []
    for req_id, prompt in prompts:
        arm.admit(req_id, prompt, 1)
        blocks.append(arm.manager.block_pool.blocks[arm.manager.get_block_ids(str(req_id))[0][0]])
        arm.finish(req_id)
    return blocks


def handed_out(pool) -> list[int]:
    """Every free block's id, in the order the allocator hands them out (fresh first)."""
    return [x.block_id for x in pool.get_new_blocks(pool.get_num_free_blocks())]


def cached_order(pool) -> list[int]:
    walk = pool.free_block_queue.iter_blocks_after(None)
    return [x.block_id for x in walk if x.block_hash is not None]


@pytest.mark.parametrize("priced", [True, False])
def test_a_block_another_tier_holds_goes_before_an_equal_one_held_nowhere_else(priced):
    # two one-block prompts, released in turn; b (released last, so ranked above a) is
    # given back to evict first. With tier pricing it becomes the victim because its
    # reload is cheap, with no lane; without, by vLLM's lane (any policy would take it)
    arm = VLLMStockArm(4, make_policy("cost", {"tier_pricing": priced}))
    pool = arm.manager.block_pool
    a, b = cached_first_blocks(arm, [(0, [1, F]), (1, [2, F + 1])])
    pool.touch([b])
    free_to_evict_first(pool, [b])
    assert pool.standing(b).held_elsewhere
    assert cached_order(pool) == [b.block_id, a.block_id]
    lane = pool.free_block_queue._first_entry
    if priced:
        assert not lane
        assert pool.standing(b).rank < pool.standing(a).rank
    else:
        assert b.block_id in lane
    assert handed_out(pool)[-2:] == [b.block_id, a.block_id]


@pytest.mark.parametrize(("gbps", "first"), [(25.0, "hot"), (1e-3, "cold")])
def test_a_block_held_elsewhere_is_worth_its_reload_not_nothing(gbps, first):
    # hot: hit three times, then copied out by a tier; cold: never reused, held nowhere
    # else, same depth. On a fast link hot's reload is cheap and it goes first; on a link
    # so slow that a reload costs a recompute, hot's reuses keep it and cold goes first
    policy = make_policy("cost", {"host_link_gbps": gbps})
    arm = VLLMStockArm(6, policy)
    pool = arm.manager.block_pool
    prompts = [(k, [1, F + k]) for k in range(4)] + [(9, [2, F + 9])]
    blocks = cached_first_blocks(arm, prompts)
    hot, cold = blocks[0], blocks[-1]
    assert pool.standing(hot).hits == 3
    pool.touch([hot])
    free_to_evict_first(pool, [hot])
    expected = [hot.block_id, cold.block_id] if first == "hot" else [cold.block_id, hot.block_id]
    assert cached_order(pool) == expected
    assert handed_out(pool)[-2:] == expected
