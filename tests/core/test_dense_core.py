"""The dense eviction cores decide as the generic one running `cost` and `learned`,
compiled and not.

`kvplug.core.dense.DenseCostCore` keeps `cost`'s state in typed arrays by block id;
`kvplug.core.eviction.EvictionCore` with `kvplug.policies.cost.CostPolicy` keeps it on
node records. Random operation sequences (caching chains, releases with what the
releasing request knew, hits, reclaims, invalidations, evictions, another tier taking a
copy and giving a block back, a waiting request protecting a block) run on the generic
core and on the dense core, both as built here (compiled where a compiler was found)
and from its source run as plain Python: every victim, rank, learned tally and ghost,
the inflation and its sort key, and the whole eviction order must agree, and every
invariant hold.
"""

from __future__ import annotations

import pytest
from dense_plain import plain_dense_module
from hypothesis import event, given, settings
from hypothesis import strategies as st
from tree_node import Node

import kvplug.core.dense
from kvplug.core.dense import iter_victims
from kvplug.core.eviction import EvictionCore, live_parent
from kvplug.policies import make_policy

PLAIN = plain_dense_module()
# per policy: its parameters (a small shadow and window, and a margin that asks the
# learned shadow to save twice what the LRU one does, so that `learned` switches)
# and the dense cores, as built and as plain Python
POLICIES = {
    "cost": ({}, [kvplug.core.dense.DenseCostCore, PLAIN.DenseCostCore]),
    "learned": (
        {"shadow_blocks": 4, "window": 3, "margin": -1.0},
        [kvplug.core.dense.DenseLearnedCore, PLAIN.DenseLearnedCore],
    ),
}
SIZE = 16

ops = st.lists(
    st.one_of(
        st.tuples(st.just("cache"), st.lists(st.integers(0, SIZE - 1), min_size=1, max_size=5)),
        st.tuples(
            st.just("release"),
            st.integers(0, 3),
            st.booleans(),
            st.integers(0, 5000),
            st.booleans(),  # it named a session
        ),
        st.tuples(st.just("hit"), st.integers(0, SIZE - 1)),
        st.tuples(st.just("drop"), st.integers(0, SIZE - 1)),
        st.tuples(st.just("evict"), st.integers(1, 4)),
        st.tuples(st.just("tier"), st.integers(0, SIZE - 1)),
        st.tuples(st.just("restore"), st.integers(0, 3)),
        st.tuples(st.just("protect"), st.integers(0, SIZE - 1), st.integers(0, 3)),
    ),
    min_size=10,
    max_size=80,
)


class Generic:
    """The generic core over `Node` records, the reference."""

    def __init__(self, name: str, params: dict) -> None:
        self.policy = make_policy(name, params)
        self.policy.bind(16, SIZE)
        self.core: EvictionCore[Node] = EvictionCore(self.policy)
        self.nodes: list[Node | None] = [None] * SIZE
        self.serials = 0

    def cache(self, ids: list[int], keys: list[bytes], parent: int) -> None:
        made = []
        for block_id, key in zip(ids, keys, strict=True):
            node = Node(self.serials, key, len(made))
            self.serials += 1
            self.nodes[block_id] = node
            made.append(node)
        self.core.insert_chain(made, None if parent < 0 else self.nodes[parent])

    def node(self, block_id: int) -> Node:
        found = self.nodes[block_id]
        assert found is not None
        return found


@pytest.mark.parametrize("name", list(POLICIES))
@settings(max_examples=150, deadline=None)
@given(ops=ops, tier_pricing=st.booleans())
def test_the_dense_core_decides_as_the_generic_core(name, ops, tier_pricing):
    params, cores = POLICIES[name]
    params = {**params, "tier_pricing": tier_pricing}
    generic = Generic(name, params)
    dense = []
    for core_class in cores:
        policy = make_policy(name, params)
        policy.bind(16, SIZE)
        keys: list = [None] * SIZE
        dense.append((core_class(policy, SIZE, keys), policy, keys))
    held: list[int] = []  # cached, not evictable, in caching order
    taken: list[int] = []  # evictable blocks another tier holds while it copies them
    stamp = 0
    for op in ops:
        if op[0] == "cache":
            ids = [i for i in dict.fromkeys(op[1]) if generic.nodes[i] is None]
            if not ids:
                continue
            parent = held[-1] if held and generic.node(held[-1]).cached_children == 0 else -1
            keys_made = []
            for _ in ids:
                stamp += 1
                keys_made.append(bytes([stamp % 23]) + b"k")  # keys come back: ghosts return
            if len(set(keys_made)) < len(keys_made):
                continue
            live = {n.key for n in generic.nodes if n is not None}
            if live & set(keys_made):
                continue
            generic.cache(ids, keys_made, parent)
            for core, _, keys in dense:
                for block_id, key in zip(ids, keys_made, strict=True):
                    keys[block_id] = key
                core.insert_chain(ids, list(range(len(ids))), parent)
            held += ids
        elif op[0] == "release" and held:
            ids = held[-1 - op[1] :]
            del held[-1 - op[1] :]
            ends = list(range(len(ids) - 1, -1, -1))
            records = [generic.node(i) for i in ids]
            for record, end in zip(records, ends, strict=True):
                record.from_end, record.request_hit, record.request_output = end, op[2], op[3]
                record.request_session = op[4]
            generic.core.release_n(records)
            for core, _, _ in dense:
                core.release_n(ids, ends, op[2], op[3], op[4])
        elif op[0] == "hit" and generic.nodes[op[1]] is not None:
            block_id = op[1]
            generic.core.hit_n([generic.node(block_id)])
            generic.core.reclaim(generic.node(block_id))
            for core, _, _ in dense:
                core.hit_n([block_id])
                core.reclaim(block_id)
            if block_id in taken:
                taken.remove(block_id)
            if block_id not in held:
                held.append(block_id)
        elif op[0] == "drop" and generic.nodes[op[1]] is not None:
            block_id = op[1]
            generic.core.remove(generic.node(block_id))
            generic.node(block_id).serial = -1  # its identity ends: children see it
            generic.nodes[block_id] = None
            for core, _, keys in dense:
                core.remove(block_id)
                keys[block_id] = None
            for queue in (held, taken):
                if block_id in queue:
                    queue.remove(block_id)
        elif op[0] == "evict":
            victims = [v.key for v in generic.core.pop_victims(op[1])]
            for v in victims:
                gone = next(i for i, n in enumerate(generic.nodes) if n is not None and n.key == v)
                generic.node(gone).serial = -1
                generic.nodes[gone] = None
                if gone in taken:
                    taken.remove(gone)
            for core, _, keys in dense:
                before = list(keys)
                picked = core.pop_victims(op[1])
                assert [before[i] for i in picked] == victims
                assert all(keys[i] is None for i in picked)
        elif op[0] == "tier" and generic.nodes[op[1]] is not None:
            block_id = op[1]
            record = generic.node(block_id)
            if record.evictable and block_id not in taken:  # a tier holds it to copy it
                generic.core.reclaim(record)
                for core, _, _ in dense:
                    core.reclaim(block_id)
                taken.append(block_id)
            else:
                generic.core.held_elsewhere(record)
                for core, _, _ in dense:
                    core.held_elsewhere(block_id, True)
        elif op[0] == "protect" and generic.nodes[op[1]] is not None:
            generic.core.protect_n([generic.node(op[1])], [op[2]])
            for core, _, _ in dense:
                core.protect_n([op[1]], [op[2]])
        elif op[0] == "restore" and taken:
            ids = taken[: op[1] + 1]
            del taken[: op[1] + 1]
            generic.core.restore_n([generic.node(i) for i in ids])
            for core, _, _ in dense:
                core.restore_n(ids)
        expected = (
            generic.policy.inflation,
            generic.policy._inflation_key,
            list(generic.policy._tried),
            list(generic.policy._reused),
            list(generic.policy._ghosts.items()),
            len(generic.core),
            generic.core.num_evictable,
            getattr(generic.policy, "explain", dict)(),
        )
        event(f"{name}: referee switched" if getattr(generic.policy, "switches", 0) else name)
        for core, policy, _ in dense:
            core.check_invariants()
            found = (
                policy.inflation,
                policy._inflation_key,
                list(policy._tried),
                list(policy._reused),
                core.history.ghost_items(),
                len(core),
                core.num_evictable,
                getattr(policy, "explain", dict)(),
            )
            assert found == expected, f"after {op}"
            order = [generic.nodes.index(node) for node in generic.core.iter_victims()]
            assert list(iter_victims(core, [])) == order, f"after {op}"
            assert core.num_protected == generic.core.num_protected
            for block_id, record in enumerate(generic.nodes):
                if record is None:
                    assert not core.is_live(block_id)
                    continue
                assert core.is_evictable(block_id) == record.evictable
                parent = live_parent(record)
                live = core.live_parent(block_id)
                assert (live if live >= 0 else None) == (
                    None if parent is None else generic.nodes.index(parent)
                )
                assert core.protection_of(block_id) == generic.core.protection_of(record)
                if generic.policy.has_rank(record):
                    assert core.entry(block_id)[1] == generic.policy.rank_of(record)


@pytest.mark.parametrize("core_class", [kvplug.core.dense.DenseCostCore, PLAIN.DenseCostCore])
def test_the_evicted_first_queue_keeps_order_and_drops_only_what_cannot_go_first(core_class):
    """An engine's rules' evicted-first queue (`queue_first`, `next_first`): entries come
    out first in first out, an entry is skipped once its identity ended, an anchored
    window's, and a copy's once no other block holds its key (`held_by_another`); a full
    queue drops only entries that could never come out (other identities', anchored
    windows'), so a block queued over and over does not grow it."""
    size = 10
    keys: list = [None] * size
    core = core_class(make_policy("cost"), size, keys)
    for node in range(size):
        keys[node] = b"%08d" % node + (0).to_bytes(4, "big")  # vLLM's layout: group 0 last
    keys[8], keys[9] = keys[4], keys[5]  # held blocks caching the same hashes as 4 and 5
    core.insert_chain(list(range(size)), [0] * size, -1, True)  # loose: no parents
    # vLLM's map (0.34's layout: the block ids under a key held more than once)
    both = ({keys[4]: {4: None, 8: None}, keys[5]: {5: None, 9: None}}, False)
    only_5 = ({keys[5]: {5: None, 9: None}}, False)
    core.release_unranked([0, 1, 2, 3])
    core.release_n([4, 5], [0, 0], False, 0)
    for node in (0, 1, 2, 3):
        core.queue_first(node, False)
    core.queue_first(4, True)
    core.queue_first(5, True)
    assert [entry[0] for entry in core.first_entries()] == [0, 1, 2, 3, 4, 5]
    assert core.next_first(both) == 0
    core.remove(1)  # its identity ends: its entry is skipped
    assert core.next_first(only_5) == 2
    assert core.next_first(only_5) == 3
    assert core.next_first(only_5) == 5  # 4 is no copy any more
    assert core.next_first(both) == -1
    core.check_invariants()
    # block 6, an anchored window, queued far more often than the ring holds
    core.release_unranked([6])

    class Block:
        block_id = 6
        key = keys[6]

    core.anchor_blocks([Block()], bytes([1]))  # group 0 is a window's: 6 is anchored
    assert core.is_anchored(6)
    for _ in range(1000):
        core.queue_first(6, False)
    assert core.lane_size <= 64  # compacted, never grown
    assert core.next_first(both) == -1
    core.queue_first(7, False)  # not evictable: skipped
    assert core.next_first(both) == -1


@pytest.mark.parametrize("module", [kvplug.core.dense, PLAIN])
def test_a_copy_is_held_by_another_block_only_where_that_block_holds_the_key(module):
    """`held_by_another` reads both vLLM map layouts: 0.32/0.33's (a key held once maps
    to its block, more than once to a dict of blocks by id) and 0.34's (a dict of ids),
    and counts a block only while the pool accounts for the key on it."""
    key, other_key = b"k" * 8, b"o" * 8
    keys: list = [key, key, other_key]
    old_layout = ({key: {0: "block 0", 1: "block 1"}, other_key: "block 2"}, True)
    new_layout = ({key: {0: None, 1: None}}, False)
    for copies in (old_layout, new_layout):
        assert module.held_by_another(copies, keys, key, 0)
        assert module.held_by_another(copies, keys, key, 1)
        assert not module.held_by_another(copies, keys, other_key, 2)
    keys[1] = None  # block 1 no longer holds it as the pool accounts for it
    for copies in (old_layout, new_layout):
        assert not module.held_by_another(copies, keys, key, 0)


class _Block:
    def __init__(self, block_id: int) -> None:
        self.block_id = block_id


def _layouts(holders: dict[bytes, list[int]]) -> list[tuple[dict, tuple]]:
    """vLLM's map holding `holders` (each key's block ids, the first named first) as
    ``(entries, copies)`` in both layouts: 0.32/0.33 (a key maps to its block, or to a
    dict of its blocks by id) and 0.34 (to its first block's id; copies apart)."""
    old = {
        key: _Block(ids[0]) if len(ids) == 1 else {i: _Block(i) for i in ids}
        for key, ids in holders.items()
    }
    new = {key: ids[0] for key, ids in holders.items()}
    duplicates = {key: dict.fromkeys(ids) for key, ids in holders.items() if len(ids) > 1}
    return [(old, (old, True)), (new, (duplicates, False))]


@pytest.mark.parametrize("module", [kvplug.core.dense, PLAIN])
@settings(max_examples=200, deadline=None)
@given(data=st.data())
def test_the_map_reads_of_the_hybrid_rules_agree_with_the_maps_own_answers(module, data):
    """`is_held`, `all_held` and `holders_at` answer as vLLM's map and the pool's keys
    do (the first block the map names for a key, then any copy), in both layouts."""
    positions = [b"p%d" % i for i in range(4)]
    suffixes = [i.to_bytes(4, "big") for i in range(3)]
    all_keys = [p + s for p in positions for s in suffixes]
    num_blocks = 10
    holders: dict[bytes, list[int]] = {}
    for key in data.draw(st.lists(st.sampled_from(all_keys), unique=True)):
        holders[key] = data.draw(
            st.lists(st.integers(0, num_blocks - 1), min_size=1, max_size=3, unique=True)
        )
    keys = data.draw(
        st.lists(
            st.one_of(st.none(), st.sampled_from(all_keys)),
            min_size=num_blocks,
            max_size=num_blocks,
        )
    )

    def held(key: bytes) -> bool:
        ids = holders.get(key, [])
        return bool(ids) and (keys[ids[0]] == key or any(keys[i] == key for i in ids[1:]))

    for entries, copies in _layouts(holders):
        for key in all_keys:
            assert module.is_held(entries, copies, keys, key) == held(key)
        for position in positions:
            skip = position + suffixes[0]
            expected = [
                holders[position + s][0]
                for s in suffixes
                if position + s != skip
                and position + s in holders
                and keys[holders[position + s][0]] == position + s
            ]
            assert module.holders_at(entries, keys, position, suffixes, skip) == expected
        for suffix in suffixes:
            for count in range(len(positions) + 2):
                expected_all = all(held(p + suffix) for p in positions[:count])
                got = module.all_held(entries, copies, keys, positions, suffix, count)
                assert got == expected_all
