"""`kvplug.core.ranked_set.RankedSet`: members ranked by a policy, held ones skipped."""

from __future__ import annotations

from dataclasses import dataclass

import pytest

from kvplug.core.ranked_set import RankedSet
from kvplug.errors import ConfigError
from kvplug.policies import make_policy
from kvplug.policies.base import EvictionPolicy


@dataclass
class Node:
    serial: int
    key: bytes = b""
    depth: int = 0
    hits: int = 0
    from_end: int = 0
    request_hit: bool = False
    request_output: int = 0
    request_session: bool = False


def lru_set() -> RankedSet[Node]:
    policy = make_policy("lru")
    policy.bind(1, 16)
    return RankedSet(policy)


def test_lru_order_follows_accesses_and_placements() -> None:
    ranked = lru_set()
    a, b, c, d, e = (Node(i) for i in range(5))
    ranked.add(a)
    ranked.add(b)
    ranked.add_before(c, newer=b, older=a)  # between a and b
    ranked.add_before(d, newer=b, older=c)  # between c and b
    ranked.add_before(e, newer=a, older=None)  # older than all
    assert ranked.ordered() == [e, a, c, d, b]
    ranked.touch(a)
    assert ranked.ordered() == [e, c, d, b, a]
    ranked.remove(c)
    assert ranked.ordered() == [e, d, b, a]
    ranked.check()


def test_first_skips_held_members_and_keeps_their_rank() -> None:
    ranked = lru_set()
    nodes = [Node(i) for i in range(4)]
    for node in nodes:
        ranked.add(node)
    held = {0, 1}
    assert ranked.first(lambda n: n.serial not in held) is nodes[2]
    held.clear()
    assert ranked.first(lambda n: True) is nodes[0]  # held ones kept their place
    assert ranked.first(lambda n: False) is None
    ranked.check()


def test_many_touches_keep_the_heap_small() -> None:
    ranked = lru_set()
    nodes = [Node(i) for i in range(3)]
    for node in nodes:
        ranked.add(node)
    for _ in range(500):
        for node in nodes:
            ranked.touch(node)
    assert len(ranked._heap) <= 64 + 2 * len(nodes) + 1
    assert ranked.first(lambda n: True) is nodes[0]
    ranked.check()


def test_the_policy_rank_decides_before_recency() -> None:
    policy = make_policy("lfu")
    policy.bind(1, 16)
    ranked: RankedSet[Node] = RankedSet(policy)
    reused, once = Node(0), Node(1)
    ranked.add(reused)
    ranked.add(once)
    for _ in range(3):
        ranked.hit(reused)
    ranked.touch(reused)  # ranked again with its hits
    ranked.touch(once)
    assert ranked.first(lambda n: True) is once


def test_a_policy_that_is_not_ranked_is_refused() -> None:
    class Unranked(EvictionPolicy):
        name = "unranked"

        def add_candidate(self, node: object) -> None: ...
        def discard_candidate(self, node: object) -> None: ...
        def choose_victims(self, n: int) -> list:
            return []

        def __len__(self) -> int:
            return 0

    with pytest.raises(ConfigError, match="RankedPolicy"):
        RankedSet(Unranked())
