"""`VictimHistory` keeps two records of a cache's victims over one ring and one index, as
two ordered dicts would: checked against two `OrderedDict`s on random operations, compiled
and as plain Python, through ring growth and compaction.
"""

from __future__ import annotations

import random
from collections import OrderedDict

import pytest
from dense_plain import plain_dense_module
from hypothesis import given, settings
from hypothesis import strategies as st

import kvplug.core.dense

MODULES = [kvplug.core.dense, plain_dense_module()]


class Reference:
    """The history's contract: a ghost `OrderedDict` and a recent one, of the keys in
    the recent record's sample (hash a multiple of ``2**recent_shift``)."""

    def __init__(self, ghost_capacity: int, recent_capacity: int, recent_shift: int = 0) -> None:
        self.ghost_capacity, self.recent_capacity = ghost_capacity, recent_capacity
        self.mask = (1 << recent_shift) - 1
        self.ghosts: OrderedDict[bytes, int] = OrderedDict()
        self.recent: OrderedDict[bytes, None] = OrderedDict()

    def file(self, key: bytes, ghost: int, recent: bool) -> None:
        if ghost >= 0:
            self.ghosts[key] = ghost
        if recent and self.recent_capacity > 0 and not hash(key) & self.mask:
            self.recent[key] = None
            while len(self.recent) > self.recent_capacity:
                self.recent.popitem(last=False)

    def take_ghost(self, key: bytes) -> int:
        return self.ghosts.pop(key, -1)

    def take_recent(self, key: bytes) -> bool:
        return self.recent.pop(key, 0) is None

    def drop_oldest_ghost(self) -> int:
        return self.ghosts.popitem(last=False)[1]

    def drop_oldest_recent(self) -> bytes:
        return self.recent.popitem(last=False)[0]

    def ghost_items(self) -> list[tuple[bytes, int]]:
        return list(self.ghosts.items())

    def recent_keys(self) -> list[bytes]:
        return list(self.recent)


keys = st.integers(0, 40).map(lambda i: b"k%d" % i)
operations = st.lists(
    st.one_of(
        st.tuples(st.just("victim"), keys, st.integers(-1, 5000), st.booleans()),
        st.tuples(st.just("take_ghost"), keys),
        st.tuples(st.just("take_recent"), keys),
        st.tuples(st.just("popitem"), st.none()),
    ),
    max_size=300,
)


@pytest.mark.parametrize("module", MODULES, ids=["built", "plain"])
@settings(max_examples=200, deadline=None)
@given(
    ops=operations,
    ghost_capacity=st.integers(0, 30),
    recent_capacity=st.integers(0, 30),
    recent_shift=st.sampled_from([0, 0, 1, 2]),
)
def test_the_history_keeps_what_its_reference_keeps(
    module, ops, ghost_capacity, recent_capacity, recent_shift
):
    history = module.VictimHistory(ghost_capacity, recent_capacity, recent_shift)
    reference = Reference(ghost_capacity, recent_capacity, recent_shift)
    for op in ops:
        if op[0] == "victim":
            _, key, ghost, recent = op
            history.file(key, ghost, recent)
            reference.file(key, ghost, recent)
            while history.num_ghosts > ghost_capacity:  # the caller trims its ghosts
                assert history.drop_oldest_ghost() == reference.drop_oldest_ghost()
        elif op[0] == "take_ghost":
            assert history.take_ghost(op[1]) == reference.take_ghost(op[1])
        elif op[0] == "take_recent":
            assert history.take_recent(op[1]) == reference.take_recent(op[1])
        elif reference.recent:
            assert history.popitem(last=False) == (reference.drop_oldest_recent(), None)
        else:
            with pytest.raises(KeyError):
                history.popitem(last=False)
        history.check()
        assert history.ghost_items() == reference.ghost_items()
        assert history.recent_keys() == reference.recent_keys()
        assert len(history) == len(reference.recent)
        assert history.weight == 1 << recent_shift


@pytest.mark.parametrize("module", MODULES, ids=["built", "plain"])
def test_as_a_record_of_recent_victims_it_is_an_ordered_dict(module):
    """What a pool does with its ``_evicted`` record: file, pop (churn), trim."""
    history = module.VictimHistory(0, 100)
    model: OrderedDict[bytes, None] = OrderedDict()
    for i in range(5000):
        key = b"k%d" % (i * 7919 % 331)
        if i % 3:
            history[key] = None
            model[key] = None
            while len(model) > 100:
                model.popitem(last=False)
        else:
            assert history.pop(key, 0) is model.pop(key, 0)
        assert (key in history) == (key in model)
    assert history.recent_keys() == list(model) and len(history) == len(model)
    history.check()


@pytest.mark.parametrize("module", MODULES, ids=["built", "plain"])
def test_the_ring_grows_and_compacts_with_its_records(module):
    """Thousands of ghosts, most taken back: the ring stays within its live keys' span."""
    history = module.VictimHistory(1000, 0)
    for i in range(20_000):
        history.file(b"g%d" % i, i, False)
        while history.num_ghosts > 1000:
            history.drop_oldest_ghost()
        if i % 4:
            assert history.take_ghost(b"g%d" % (i - 1)) in (-1, i - 1)
    history.check()
    assert history.num_ghosts <= 1000


@pytest.mark.parametrize("module", MODULES, ids=["built", "plain"])
@settings(max_examples=25, deadline=None)
@given(
    ghost_capacity=st.integers(0, 300),
    recent_capacity=st.integers(0, 300),
    taken_every=st.integers(2, 9),
    ghost_every=st.integers(1, 4),
)
def test_its_memory_follows_its_capacities(
    module, ghost_capacity, recent_capacity, taken_every, ghost_every
):
    """Ring and index stay within four times the most entries it has held, however
    long the history runs: the ring is sized by its live entries, not by the filings,
    and the index by the entries, not by the ring."""
    history = module.VictimHistory(ghost_capacity, recent_capacity)
    most = 0
    for i in range(6_000):
        history.file(b"v%d" % i, i if i % ghost_every == 0 else -1, True)
        while history.num_ghosts > ghost_capacity:
            history.drop_oldest_ghost()
        if i % taken_every == 0:
            history.take_recent(b"v%d" % (i - 50))
        most = max(most, history.num_ghosts + history.num_recent)
        bound = max(64, 4 * (most + 1))
        ring, index = history.footprint
        assert ring <= bound and index <= bound, (i, history.footprint, bound)
    history.check()


@pytest.mark.parametrize("module", MODULES, ids=["built", "plain"])
def test_new_keys_are_counted_against_the_keys_before(module):
    """`count_new_keys` counts the blocks just given a key and, of those keys, the recent
    victims' (which leave the record); with the keys before (a block may hold a partial
    key already), only a changed key counts, and as a newly held one only where there
    was none."""

    class Block:
        def __init__(self, key: object) -> None:
            self.key = key

    history = module.VictimHistory(0, 8)
    history[b"a"] = None
    history[b"c"] = None
    blocks = [Block(b"x"), Block(b"a"), Block(None), Block(b"c"), Block(b"d")]
    before = module.keys_of(blocks, 1, 5, "key")
    assert before == [b"a", None, b"c", b"d"]
    before = [None, None, b"old", b"d"]  # as the blocks held them before
    assert module.count_new_keys(blocks, 1, 5, "key", history, before) == (1, 2)
    assert b"a" not in history and b"c" not in history
    history[b"a"] = None
    assert module.count_new_keys(blocks, 0, 2, "key", history) == (2, 1)


@pytest.mark.parametrize("module", MODULES, ids=["built", "plain"])
def test_a_large_pools_record_of_recent_victims_is_a_sample_weighted_back(module):
    """`recent_sampling` keeps every victim below twice its floor and, above, one key in
    the largest power of two that leaves at least the floor; a churn count over the
    sample, each key weighted back, estimates the exact one. (The keys are seeded integers,
    whose hashes do not change between processes: with bytes keys, which Python hashes with a
    per-process seed, the sample drawn and so the estimate would change from run to run.)"""
    floor = module.RECENT_SAMPLE_FLOOR
    assert module.recent_sampling(2 * floor - 1) == (2 * floor - 1, 0)
    assert module.recent_sampling(2 * floor) == (floor, 1)
    assert module.recent_sampling(65_886) == (65_886 >> 6, 6)
    victims, recached = 40_000, 12_000
    exact = module.VictimHistory(0, victims)
    sampled = module.VictimHistory(0, *module.recent_sampling(victims))
    draw = random.Random(27)
    keys = [draw.getrandbits(62) for _ in range(victims)]
    for key in keys:
        exact.file(key, -1, True)
        sampled.file(key, -1, True)
    assert len(sampled) < len(exact) // 8
    churn = [0, 0]
    for key in keys[:recached]:
        churn[0] += exact.take_recent(key) * exact.weight
        churn[1] += sampled.take_recent(key) * sampled.weight
    assert churn[0] == recached
    assert abs(churn[1] - recached) < 0.15 * recached
    sampled.check()
