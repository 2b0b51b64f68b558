"""`learned`'s shadow caches and referee, compiled and as plain Python: the same decisions."""

from __future__ import annotations

import pytest
from dense_plain import plain_module
from hypothesis import given, settings
from hypothesis import strategies as st

import kvplug.policies.shadow

MODULES = [kvplug.policies.shadow, plain_module(kvplug.policies.shadow)]
IDS = ["build", "plain"]


@pytest.fixture(params=MODULES, ids=IDS)
def shadow_module(request):
    return request.param


def test_shadow_cache_evicts_released_entries_by_rank_and_keeps_held_ones(shadow_module) -> None:
    shadow = shadow_module.ShadowCache(2, True)
    shadow.access(b"a", 1.0)
    shadow.release(b"a", 5.0)
    shadow.access(b"b", 1.0)
    shadow.release(b"b", 1.0)
    shadow.access(b"c", 1.0)  # full: b has the lowest rank
    assert shadow.floor == 1.0 and shadow.saved == 0.0
    assert set(shadow.entries) == {b"a", b"c"}
    shadow.access(b"a", 2.0)  # a hit; a and c are now both held
    shadow.access(b"d", 1.0)  # nothing evictable: it holds three for now
    assert shadow.saved == 2.0 and len(shadow.entries) == 3
    shadow.decay(0.5)
    assert shadow.saved == 1.0


def test_an_lru_shadow_evicts_in_release_order(shadow_module) -> None:
    shadow = shadow_module.ShadowCache(2, False)
    for key, credit in ((b"a", 9.0), (b"b", 1.0)):
        shadow.access(key, 1.0)
        shadow.release(key, credit)  # the credit does not count
    shadow.access(b"c", 1.0)
    assert set(shadow.entries) == {b"b", b"c"} and shadow.floor == 0.0


def test_the_referee_switches_to_the_shadow_that_saved_more(shadow_module) -> None:
    duel = shadow_module.ShadowDuel(4, 2, 0.0)
    duel.lru.saved, duel.learned.saved = 10.0, 5.0
    duel.referee()
    assert not duel.use_learned and duel.switches == 1
    assert (duel.lru.saved, duel.learned.saved) == (5.0, 2.5)
    duel.lru.saved = 0.0
    duel.access(b"x", 1.0)
    duel.access(b"x", 4.0)  # the second sampled access: the referee runs again
    assert duel.use_learned and duel.switches == 2 and duel.accesses == 2


def test_sampling_takes_one_key_in_two_to_the_shift(shadow_module) -> None:
    keys = [bytes([i]) for i in range(256)]
    assert sum(shadow_module.sampled(k, 3) for k in keys) == 32
    assert all(shadow_module.sampled(k, 0) for k in keys)


KEYS = st.sampled_from([bytes([i]) for i in range(12)])
OPS = st.lists(
    st.tuples(st.sampled_from(["access", "release"]), KEYS, st.floats(0.0, 8.0, width=32)),
    max_size=120,
)


def _state(duel):
    return [
        (dict(shadow.entries), shadow.floor, shadow.saved) for shadow in (duel.learned, duel.lru)
    ] + [duel.use_learned, duel.switches, duel.accesses]


def _check(shadow, capacity: int, accessed: bool) -> None:
    """The invariants of `ShadowCache`'s doc (of `LazyShadowCache`'s, as plain Python)."""
    shadow.check_invariants()
    if accessed and len(shadow.entries) > capacity:
        assert all(ranked is None for ranked in shadow.entries.values())


@settings(max_examples=200, deadline=None)
@given(OPS, st.integers(1, 5), st.integers(1, 7), st.sampled_from([-1.0, 0.0, 0.5]))
def test_compiled_and_plain_duels_decide_alike_and_keep_their_invariants(
    ops, capacity, window, margin
) -> None:
    duels = [module.ShadowDuel(capacity, window, margin) for module in MODULES]
    for op, key, number in ops:
        for duel in duels:
            getattr(duel, op)(key, number)
            for shadow in (duel.learned, duel.lru):
                _check(shadow, capacity, op == "access")
        assert _state(duels[0]) == _state(duels[1])


def test_a_key_held_by_a_request_is_never_evicted(shadow_module) -> None:
    shadow = shadow_module.ShadowCache(1, True)
    shadow.access(b"a", 1.0)
    shadow.access(b"b", 1.0)  # a is held: both stay
    shadow.release(b"a", 1.0)
    shadow.access(b"c", 1.0)  # now a goes, and b and c (held) stay
    assert set(shadow.entries) == {b"b", b"c"}


@settings(max_examples=300, deadline=None)
@given(OPS, st.integers(1, 5), st.booleans())
def test_the_indexed_heap_evicts_what_a_lazy_heap_of_triples_would(
    ops, capacity, by_credit
) -> None:
    """`ShadowCache` (compiled and plain) against `LazyShadowCache`, the duel's plain form."""
    reference = MODULES[1].LazyShadowCache(capacity, by_credit)
    shadows = [module.ShadowCache(capacity, by_credit) for module in MODULES]
    for op, key, number in ops:
        for shadow in (reference, *shadows):
            getattr(shadow, op)(key, number)
        reference.check_invariants()
        for shadow in shadows:
            shadow.check_invariants()
            assert (shadow.entries, shadow.floor, shadow.saved) == (
                reference.entries,
                reference.floor,
                reference.saved,
            )
