"""A ranked policy's entries (`kvplug.policies.entry`) sort as (rank, order, serial)."""

from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st

from kvplug.policies.entry import (
    FRACTION_BITS,
    entry_order,
    entry_rank,
    entry_serial,
    key_rank,
    make_entry,
    rank_key,
    restored_entry,
)

ranks = st.floats(allow_nan=False) | st.sampled_from([0.0, -0.0, 1.0, -1.0, 5e-324, -5e-324])
orders = st.integers(0, 2**64 - 1)
serials = st.integers(0, 2**64 - 1)
triples = st.tuples(ranks, orders, serials)


@given(triples, triples)
def test_entries_sort_as_their_triples(a, b):
    ea, eb = make_entry(*a), make_entry(*b)
    ta, tb = (a[0] + 0.0, *a[1:]), (b[0] + 0.0, *b[1:])  # -0.0 is ranked as 0.0
    assert (ea < eb) == (ta < tb)
    assert (ea == eb) == (ta == tb)


@given(triples)
def test_an_entry_gives_back_its_rank_order_and_serial(triple):
    rank, order, serial = triple
    entry = make_entry(rank, order, serial)
    assert entry_rank(entry) == rank and entry_serial(entry) == serial
    assert entry_order(entry) == order
    assert key_rank(rank_key(rank)) == rank


@given(triples, triples, st.integers(1, FRACTION_BITS))
def test_a_restored_entry_keeps_its_place_against_every_other_release(a, b, restores):
    rank, order, serial = a
    if b[1] == order:
        return  # release orders are unique
    entry = make_entry(rank, order, serial)
    restored = entry
    for _ in range(restores):
        previous, restored = restored, restored_entry(restored)
        assert restored > previous  # a new entry: heap entries left from before are stale
    assert entry_rank(restored) == rank and entry_serial(restored) == serial
    assert order < entry_order(restored) < order + 1
    other = make_entry(*b)
    assert (restored < other) == (entry < other)
