"""A ranked policy's entry for one release: one int that sorts as (rank, order, serial).

`kvplug.policies.base.RankedPolicy` keeps each released node's standing as an entry, and
its heap of candidates holds the entries themselves. An int is compared in one C call,
where a ``(rank, order, serial)`` tuple costs a rich comparison per field: a heap push
and pop cost about half as much (a third at 100k entries), and every eviction and release
makes them.

Layout, high bits first: the rank as a 64-bit key whose unsigned order is the float's
order (IEEE 754 bits, the sign bit flipped for a positive number and every bit for a
negative one; -0.0 is ranked as 0.0), the release order in fixed point (64 whole bits,
`FRACTION_BITS` fractional: a restored entry sits between two releases), and the
node's serial (64 bits). So for entries ``a`` and ``b`` of nonnegative orders and
serials below 2**64, ``a < b`` exactly when ``(rank, order, serial)`` of ``a`` sorts before
that of ``b``, and the serial is ``entry & SERIAL_MASK``.

A rank must not be NaN (no order holds for it).
"""

from __future__ import annotations

from fractions import Fraction
from struct import Struct

FRACTION_BITS = 32
WHOLE_ORDER_BITS = 64
SERIAL_BITS = 64
ORDER_SHIFT = SERIAL_BITS  # the order, fraction included, starts here
WHOLE_ORDER_SHIFT = ORDER_SHIFT + FRACTION_BITS
RANK_SHIFT = SERIAL_BITS + WHOLE_ORDER_BITS + FRACTION_BITS
SERIAL_MASK = (1 << SERIAL_BITS) - 1
ORDER_MASK = (1 << (WHOLE_ORDER_BITS + FRACTION_BITS)) - 1
SIGN_BIT = 1 << 63  # of a rank's IEEE 754 bits
KEY_MASK = (1 << 64) - 1
DOUBLE = Struct("<d")  # a rank's bits: DOUBLE.pack, then int.from_bytes(..., "little")
_pack, _unpack, _from_bytes = DOUBLE.pack, DOUBLE.unpack, int.from_bytes


def rank_key(rank: float) -> int:
    """The 64-bit key of `rank`: keys sort as the ranks do."""
    bits = _from_bytes(_pack(rank + 0.0), "little")
    return bits ^ KEY_MASK if bits & SIGN_BIT else bits | SIGN_BIT


def key_rank(key: int) -> float:
    """The rank whose key is `key` (`rank_key`'s inverse)."""
    bits = key ^ SIGN_BIT if key & SIGN_BIT else key ^ KEY_MASK
    return _unpack(bits.to_bytes(8, "little"))[0]


def make_entry(rank: float, order: int, serial: int) -> int:
    """The entry of a release: `rank`, given at the `order`-th release, to node `serial`."""
    return rank_key(rank) << RANK_SHIFT | order << WHOLE_ORDER_SHIFT | serial


def entry_rank(entry: int) -> float:
    return key_rank(entry >> RANK_SHIFT)


def entry_serial(entry: int) -> int:
    return entry & SERIAL_MASK


def entry_order(entry: int) -> Fraction:
    """The release order, its fraction included, exactly (for display and tests)."""
    return Fraction((entry >> ORDER_SHIFT) & ORDER_MASK, 1 << FRACTION_BITS)


def restored_entry(entry: int) -> int:
    """The same rank and serial at an order halfway between the entry's and the next whole
    one (orders given by releases are whole): it sorts the same against every other
    release's entry and, for the first `FRACTION_BITS` restores in a row, differs from the
    entry it replaces (after that it equals it: the same place in the order)."""
    fraction = (entry >> ORDER_SHIFT) & ((1 << FRACTION_BITS) - 1)
    halfway = (fraction + (1 << FRACTION_BITS)) >> 1
    return entry + ((halfway - fraction) << ORDER_SHIFT)
