"""Waiting-queue protection (`kvplug.core.queue_protection`): the levels a queue gives,
the eviction order they impose on the generic eviction core, and the rule inside
kvplug's own cache and the realistic replay."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from tree_node import Node

from kvplug.core.eviction import EvictionCore
from kvplug.core.queue_protection import QueueProtection, protection_levels
from kvplug.policies import make_policy
from kvplug.replay.arms.base import FRESH_UNIT_BASE as F
from kvplug.replay.arms.base import KVPlugArm


class Recorder:
    def __init__(self) -> None:
        self.calls: list[dict[str, int]] = []

    def protect_n(self, nodes: list[str], levels: list[int]) -> None:
        self.calls.append(dict(zip(nodes, levels, strict=True)))


def test_the_first_requests_claim_their_blocks_once_each() -> None:
    claims = [["a", "b"], ["a", "c"], ["d"]]
    assert protection_levels(claims, 3) == {"a": 1, "b": 1, "c": 1, "d": 1}
    assert protection_levels(claims, 2) == {"a": 1, "b": 1, "c": 1}


def test_a_refresh_reads_no_further_than_its_depth_and_clears_lapsed_claims() -> None:
    target = Recorder()
    protection = QueueProtection(2, target)
    read: list[int] = []

    def queue(claims: list[list[str]]):
        for n, claim in enumerate(claims):
            read.append(n)
            yield claim

    protection.refresh(queue([["a"], ["b"], ["c"], ["d"]]))
    assert read == [0, 1] and target.calls[-1] == {"a": 1, "b": 1}
    protection.refresh(queue([["b"], ["e"]]))
    assert target.calls[-1] == {"b": 1, "e": 1, "a": 0}
    assert protection.live == {"b": 1, "e": 1}
    protection.clear()
    assert target.calls[-1] == {"b": 0, "e": 0} and protection.live == {}
    calls = len(target.calls)
    protection.refresh(iter(()))  # nothing claimed before or now: nothing written
    assert len(target.calls) == calls
    with pytest.raises(ValueError, match="depth must be in 1..2147483647"):
        QueueProtection(0, target)


def _core(policy: str = "cost") -> EvictionCore[Node]:
    made = make_policy(policy)
    made.bind(16, 64)
    return EvictionCore(made)


def test_a_claimed_chain_goes_after_every_unclaimed_block_whatever_its_rank() -> None:
    core = _core()
    nodes = [Node(i) for i in range(6)]
    core.insert_chain(nodes[0:2], None)  # a, its child: claimed below
    core.insert_chain(nodes[2:4], None)
    core.insert_chain(nodes[4:6], None)
    for node in nodes[0:2]:
        node.hits = 3  # a reused chain: ranked above the others anyway
    core.release_n(nodes[2:4])
    core.release_n(nodes[4:6])
    core.release_n(nodes[0:2])  # released last: the most recent
    # claim the chain that would otherwise go first, and one other at a lower level
    first = [n.serial for n in core.iter_victims()]
    claimed = [nodes[first[0]], *[n for n in nodes if n.parent is nodes[first[0]]]]
    chain = claimed if claimed[0].parent is None else [claimed[0].parent, claimed[0]]
    core.protect_n(chain, [2] * len(chain))
    other = next(n for n in nodes if n not in chain and n.cached_children == 0)
    core.protect_n([other], [1])
    order = [n.serial for n in core.iter_victims()]
    assert [n.serial for n in core.pop_victims(6)] == order
    claimed_at = [order.index(n.serial) for n in chain]
    assert min(claimed_at) == 4 and order.index(other.serial) < 4
    assert core.num_protected == 0 and len(core) == 0


levels = st.lists(st.integers(0, 3), min_size=12, max_size=12)


@settings(max_examples=200, deadline=None)
@given(
    chains=st.lists(st.integers(1, 3), min_size=1, max_size=4),
    first=levels,
    second=levels,
    policy=st.sampled_from(["cost", "lru", "gdsf"]),
)
def test_no_victim_has_a_higher_level_than_a_candidate_left(chains, first, second, policy) -> None:
    """Whatever the tree, ranks and levels (changed once while evicting), every victim
    has the lowest level among the candidates it was chosen from, a parent goes after
    its children, and `iter_victims` names the victims `pop_victims` takes."""
    core = _core(policy)
    nodes: list[Node] = []
    for length in chains:
        chain = [Node(len(nodes) + i) for i in range(length)]
        nodes += chain
        core.insert_chain(chain, None)
        core.release_n(chain)
    core.protect_n(nodes, first[: len(nodes)])
    level = {n.serial: first[i] for i, n in enumerate(nodes)}
    gone: set[int] = set()
    for step in range(len(nodes)):
        if step == len(nodes) // 2:
            live = [n for n in nodes if n.serial not in gone]
            core.protect_n(live, second[: len(live)])
            level.update((n.serial, second[i]) for i, n in enumerate(live))
        expected = next(iter(core.iter_victims()))
        candidates = [
            n for n in nodes if n.serial not in gone and n.evictable and n.cached_children == 0
        ]
        (victim,) = core.pop_victims(1)
        assert victim is expected and victim in candidates
        assert core.protection_of(victim) == 0  # its claim ended with it
        assert all(level[victim.serial] <= level[n.serial] for n in candidates)
        gone.add(victim.serial)
    assert core.num_protected == 0


def _prompt(base: int, blocks: int, tail: int) -> list[int]:
    return [base + k for k in range(blocks)] + [F + tail]


@pytest.mark.parametrize("protected", [False, True])
def test_a_waiting_requests_prefix_survives_a_flood_in_kvplugs_cache(protected) -> None:
    arm = KVPlugArm("cost", make_policy("cost"), 20, queue_depth=4 if protected else 0)
    waiting = _prompt(100, 6, 0)
    assert arm.admit(0, waiting, 6) == 0
    arm.finish(0, 1)
    for i in range(1, 4):  # later one-off prompts, each reused once: cost keeps them
        prompt = _prompt(1000 * i, 4, i)
        arm.admit(i, prompt, 4)
        arm.finish(i, 1)
        arm.admit(10 + i, prompt, 4)
        arm.finish(10 + i, 1)
    arm.protect_waiting([(50, waiting)])
    # 18 blocks cached, 2 free: a 14-block prompt evicts 12 of them
    assert arm.admit(20, _prompt(9000, 14, 20), 14) == 0
    arm.finish(20, 1)
    arm.cache.check_invariants()
    assert arm.admit(50, waiting, 6) == (6 if protected else 0)
