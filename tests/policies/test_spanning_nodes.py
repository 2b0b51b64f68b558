"""`cost` over nodes of several blocks (``spans_blocks``, SGLang's radix nodes): what a node
teaches weighs its blocks, the ghost history holds blocks, and a victim that comes back
inside a longer node is recognised (`CostPolicy.ghosts_inside`)."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from kvplug.core.eviction import EvictionCore
from kvplug.policies.cost import CostPolicy, ghost_blocks, ghost_reuses


class _Span:
    """A bare `SpanningNode` for driving an `EvictionCore` directly."""

    def __init__(self, serial: int, key: bytes, blocks: int, depth: int = 0) -> None:
        self.serial, self.key, self.blocks, self.depth = serial, key, blocks, depth
        self.hits = self.from_end = self.request_output = 0
        self.request_hit = self.request_session = self.evictable = self.held_elsewhere = False


def _core(num_blocks: int, ghost_ratio: float = 1.0) -> EvictionCore:
    policy = CostPolicy(tokens_per_block=16, ghost_ratio=ghost_ratio)
    policy.bind(16, num_blocks)
    policy.spans_blocks = True
    return EvictionCore(policy)


def _cache(core: EvictionCore, node: _Span) -> None:
    """`node` written by a request that then finished: inserted, then released."""
    core.insert(node, None)
    core.release(node)


def test_a_hit_closes_a_trial_weighing_the_node_s_blocks() -> None:
    core = _core(64)
    policy: CostPolicy = core.policy  # type: ignore[assignment]
    node = _Span(0, b"a", blocks=5)
    _cache(core, node)
    code = next(iter(policy._trial.values()))
    core.hit(node)
    assert (policy._tried[code], policy._reused[code]) == (5, 5)


def test_the_ghost_history_holds_blocks_not_nodes() -> None:
    core = _core(10)  # ghost capacity: 10 blocks
    policy: CostPolicy = core.policy  # type: ignore[assignment]
    nodes = [_Span(i, f"n{i}".encode(), blocks=4) for i in range(3)]
    for node in nodes:
        _cache(core, node)
    code = policy._trial[0]
    for node in nodes:  # evicted in turn: the third pushes out the first's ghost
        core.remove(node)
    assert list(policy._ghosts) == [b"n1", b"n2"]
    assert policy._ghost_blocks == 8 <= policy.ghost_capacity
    assert (policy._tried[code], policy._reused[code]) == (4, 0)  # closed unused, weight 4


def test_a_victim_back_inside_a_longer_node_returns() -> None:
    core = _core(64)
    policy: CostPolicy = core.policy  # type: ignore[assignment]
    short = _Span(0, b"prefix", blocks=3)
    _cache(core, short)
    core.hit(short)  # reused once
    core.release(short)
    core.remove(short)
    ghost = policy._ghosts[b"prefix"]
    assert (ghost_blocks(ghost), ghost_reuses(ghost)) == (3, 1)
    longer = _Span(1, b"prefix+turn", blocks=7)
    core.insert(longer, None)
    code = ghost & 1023
    tried, reused = policy._tried[code], policy._reused[code]
    policy.ghosts_inside(longer, [b"other", b"prefix"])
    assert b"prefix" not in policy._ghosts and policy._ghost_blocks == 0
    assert (policy._tried[code], policy._reused[code]) == (tried + 3, reused + 3)
    assert policy.reuses(longer) == 2  # the ghost's reuse, and its return


@given(
    ops=st.lists(
        st.tuples(st.sampled_from(["cache", "hit", "evict", "inside"]), st.integers(0, 10**6)),
        max_size=80,
    )
)
@settings(deadline=None)
def test_the_ghosts_stand_for_at_most_the_capacity_s_blocks(ops) -> None:
    """Whatever happens, the ghosts' blocks are counted exactly and never exceed the
    history's capacity; every closed trial counts its blocks (reused never above tried)."""
    core = _core(12, ghost_ratio=1.5)
    policy: CostPolicy = core.policy  # type: ignore[assignment]
    live: list[_Span] = []
    serial = 0
    for op, pick in ops:
        if op == "cache":
            node = _Span(serial, f"k{pick % 9}".encode(), blocks=1 + pick % 6)
            serial += 1
            if any(n.key == node.key for n in live):
                continue
            _cache(core, node)
            live.append(node)
        elif op == "hit" and live:
            node = live[pick % len(live)]
            core.reclaim(node)
            core.hit(node)
            core.release(node)
        elif op == "evict" and live:
            victim = core.pop_victim()
            if victim is not None:
                live.remove(victim)  # type: ignore[arg-type]
        elif op == "inside":
            node = _Span(serial, f"long{serial}".encode(), blocks=8)
            serial += 1
            core.insert(node, None)
            policy.ghosts_inside(node, [f"k{(pick + i) % 9}".encode() for i in range(3)])
            core.release(node)
            live.append(node)
        ghosts = policy._ghosts
        assert policy._ghost_blocks == sum(ghost_blocks(g) for g in ghosts.values())
        assert policy._ghost_blocks <= policy.ghost_capacity
        assert all(r <= t for r, t in zip(policy._reused, policy._tried, strict=True))
