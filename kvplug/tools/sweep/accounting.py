"""The trace and the accounting: sequence lengths, and what they hold at one block size.

No torch here: the accounting runs a real `kvplug.core.cache.KVCache`.
"""

from __future__ import annotations

import math
import random
from dataclasses import dataclass

from kvplug.core.cache import KVCache


def sample_lengths(
    num_sequences: int,
    buckets: tuple[tuple[int, int], ...],
    weights: tuple[float, ...],
    seed: int,
) -> list[int]:
    """Draw a bucket by weight, then a length uniformly in it, `num_sequences` times."""
    rng = random.Random(seed)
    picks = rng.choices(buckets, weights=weights, k=num_sequences)
    return [rng.randint(lo, hi) for lo, hi in picks]


def blocks_per_sequence(lengths: list[int], block_size: int) -> list[int]:
    """Blocks each sequence fills: its full blocks plus one for a partial last block."""
    return [math.ceil(n / block_size) for n in lengths]


@dataclass
class Accounting:
    """What the trace's sequences hold at one block size (from a real `KVCache`)."""

    block_size: int
    sequences: int
    logical_tokens: int
    physical_slots: int
    tail_waste_tokens: int
    table_entries: int
    allocations: int

    @property
    def waste_per_sequence(self) -> float:
        return self.tail_waste_tokens / self.sequences

    @property
    def expected_waste_per_sequence(self) -> float:
        """The analytical estimate: a remainder uniform on 0..B-1 wastes (B - 1) / 2."""
        return (self.block_size - 1) / 2


def account(lengths: list[int], block_size: int) -> Accounting:
    """Add every sequence, whole, to a fresh `KVCache` of `block_size`; read its gauges."""
    num_blocks = sum(blocks_per_sequence(lengths, block_size))
    cache = KVCache(num_blocks, block_size, enable_prefix_caching=False)
    for req_id, n in enumerate(lengths):
        tokens = [0] * n  # token values do not matter without prefix caching
        cache.add_request(req_id, tokens)
        cache.append(req_id, tokens)
    usage = cache.usage()
    return Accounting(
        block_size=block_size,
        sequences=len(lengths),
        logical_tokens=usage.logical_tokens,
        physical_slots=usage.physical_token_slots,
        tail_waste_tokens=usage.tail_waste,
        table_entries=usage.block_table_entries,
        allocations=cache.metrics.allocations,
    )
