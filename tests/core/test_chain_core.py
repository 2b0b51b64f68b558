"""`ChainCore` decides exactly as `EvictionCore`: the same victims, in the same order, and
the same eviction order read without evicting, under every ranked policy, with hits,
tier copies, restores and removals that cut chains in the middle."""

from __future__ import annotations

import random

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvplug.core.chain_core import ChainCore
from kvplug.core.eviction import EvictionCore
from kvplug.policies import make_policy


class _Node:
    """A bare `ChainNode`."""

    def __init__(self, serial: int, depth: int) -> None:
        self.serial, self.key, self.depth = serial, f"k{serial}".encode(), depth
        self.hits = self.from_end = self.request_output = 0
        self.request_hit = self.held_elsewhere = False
        self.chain = None
        self.chain_at = 0


_OPS = st.lists(
    st.tuples(
        st.sampled_from(["grow", "release", "hit", "evict", "remove", "tier", "restore"]),
        st.integers(0, 10**6),
    ),
    max_size=150,
)


_KINDS = ["grow", "release", "hit", "evict", "remove", "tier", "restore"]


@pytest.mark.parametrize("name", ["cost", "learned", "lfu", "gdsf"])
@given(ops=_OPS)
@settings(deadline=None, max_examples=150)
def test_chain_core_decides_as_the_leaf_core(name: str, ops) -> None:
    _drive(name, ops)


@pytest.mark.parametrize("seed", range(4))
@pytest.mark.parametrize("name", ["cost", "lfu"])
def test_long_runs_decide_alike(name: str, seed: int) -> None:
    """Long seeded runs reach what short examples rarely do: many chains queued at once,
    walks handed from chain to chain, parked parents, splits."""
    rng = random.Random(seed)
    weights = [5, 4, 2, 3, 1, 1, 1]
    _drive(name, [(rng.choices(_KINDS, weights)[0], rng.randrange(10**6)) for _ in range(3000)])


def _drive(name: str, ops) -> None:
    params = {"tokens_per_block": 16} if name != "lfu" else {}
    chain = ChainCore(make_policy(name, params))
    leaf = EvictionCore(make_policy(name, params))
    cores = (chain, leaf)
    for core in cores:
        core.policy.bind(16, 64)
    made: tuple[list[_Node], list[_Node]] = ([], [])  # same serials in both
    held: list[int] = []  # held, cached nodes (requests' chains, appended head first)
    lent: list[int] = []  # evictable nodes a tier took (reclaimed without a use)
    serials = iter(range(10**9))

    def live(i: int) -> bool:
        return made[0][i].serial >= 0

    for op, pick in ops:
        if op == "grow":  # a request caches 1-4 blocks below a held block, or a root
            tops = [i for i in held if live(i)]
            below = tops[pick % len(tops)] if tops and pick % 3 else None
            for _ in range(1 + pick % 4):
                serial = next(serials)
                for core, nodes in zip(cores, made, strict=True):
                    parent = nodes[below] if below is not None else None
                    node = _Node(serial, 0 if parent is None else parent.depth + 1)
                    core.insert(node, parent)
                    nodes.append(node)
                below = len(made[0]) - 1
                held.append(below)
        elif op == "release" and held:
            count = 1 + pick % min(len(held), 5)
            released, held[:] = held[-count:][::-1], held[:-count]  # tail first
            released = [i for i in released if live(i)]
            for from_end, i in enumerate(released):
                for nodes in made:
                    nodes[i].from_end, nodes[i].request_output = from_end, pick % 40
            for core, nodes in zip(cores, made, strict=True):
                core.release_n([nodes[i] for i in released])
        elif op == "hit":
            evictable = [i for i, n in enumerate(made[0]) if live(i) and n.evictable]
            if evictable:
                i = evictable[pick % len(evictable)]
                for core, nodes in zip(cores, made, strict=True):
                    core.reclaim(nodes[i])
                    core.hit(nodes[i])
                held.append(i)
        elif op == "tier":  # a tier copies an evictable block out, or holds a copy now
            evictable = [i for i, n in enumerate(made[0]) if live(i) and n.evictable]
            if evictable:
                i = evictable[pick % len(evictable)]
                for core, nodes in zip(cores, made, strict=True):
                    if pick % 2:
                        core.reclaim(nodes[i])
                    core.held_elsewhere(nodes[i])
                if pick % 2:
                    lent.append(i)
        elif op == "restore" and lent:
            back = [i for i in lent if live(i) and not made[0][i].evictable]
            lent.clear()
            for core, nodes in zip(cores, made, strict=True):
                core.restore_n([nodes[i] for i in back])
        elif op == "remove":  # the engine drops a block's hash (children see a dead link)
            cached = [i for i in range(len(made[0])) if live(i)]
            if cached:
                i = cached[pick % len(cached)]
                for core, nodes in zip(cores, made, strict=True):
                    core.remove(nodes[i])
                    nodes[i].serial = -1
        elif op == "evict":
            want = 1 + pick % 6
            order = [node.serial for node in chain.iter_victims()]
            assert order == [node.serial for node in leaf.iter_victims()]
            victims = chain.pop_victims(want)
            expected = []
            for _ in range(want):
                victim = leaf.pop_victim()
                if victim is None:
                    break
                expected.append(victim)
            assert [v.serial for v in victims] == [v.serial for v in expected]
            assert [v.serial for v in victims] == order[: len(victims)]
            for a, b in zip(victims, expected, strict=True):
                a.serial = b.serial = -1
        assert chain.num_evictable == leaf.num_evictable
        assert chain.policy._rank == leaf.policy._rank
        evictable = [n for n in made[0] if n.serial >= 0 and n.evictable]
        chain.check(evictable)
        assert len(chain) == len(leaf)
        # (`EvictionCore.next_victim` would mark its answer as the policy's choice)
        first, expected_first = chain.next_victim(), next(leaf.iter_victims(), None)
        assert (first and first.serial) == (expected_first and expected_first.serial)
