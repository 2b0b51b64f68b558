"""``kvplug bench core``: the engine-neutral cache's operations per second.

- the request lifecycle (add with lookup, append, fence, finish) for many requests with
  no reuse;
- at each cached-index size (10k, 100k, 1M blocks by default): a hit lookup of a whole
  prompt, a miss lookup, one eviction, and a request lifecycle that must evict to fit.

Each figure is a rate measured in the run, not a target; the last column compares the
per-op cost at each size with the smallest size, so growth with the cache size shows.
"""

from __future__ import annotations

import math
import random
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from functools import partial
from typing import Any

from kvplug.core.cache import KVCache


@dataclass
class Row:
    operation: str
    cached_blocks: int
    ops_per_s: float
    us_per_op: float
    vs_smallest: float = 1.0


def _rate(fn: Callable[[Any], object], args: Sequence[Any]) -> tuple[float, float]:
    """Call `fn` on each of `args`; return (calls per second, microseconds per call)."""
    start = time.perf_counter()
    for arg in args:
        fn(arg)
    elapsed = time.perf_counter() - start
    return len(args) / elapsed, elapsed / len(args) * 1e6


class _Workload:
    """Random prompts of `blocks_per_prompt` full blocks plus one token."""

    def __init__(self, block_size: int, blocks_per_prompt: int, seed: int) -> None:
        self.rng = random.Random(seed)
        self.length = block_size * blocks_per_prompt + 1
        self.served: list[list[int]] = []
        self.next_id = 0

    def prompt(self) -> list[int]:
        return self.rng.choices(range(1, 100_000), k=self.length)

    def run_request(self, cache: KVCache, prompt: list[int] | None = None) -> None:
        prompt = prompt or self.prompt()
        self.next_id += 1
        cached = cache.add_request(self.next_id, prompt)
        cache.append(self.next_id, prompt[cached:])
        cache.complete_step()
        cache.finish(self.next_id)
        self.served.append(prompt)


def bench_core(
    sizes: list[int],
    requests: int,
    block_size: int,
    blocks_per_prompt: int,
    seed: int = 0,
    policy: str = "lru",
) -> list[Row]:
    rows: list[Row] = []
    work = _Workload(block_size, blocks_per_prompt, seed)

    cache = KVCache(requests * (blocks_per_prompt + 1) + 1, block_size, policy=policy)
    prompts = [work.prompt() for _ in range(requests)]
    ops, us = _rate(partial(work.run_request, cache), prompts)
    rows.append(Row(f"request lifecycle ({blocks_per_prompt} blocks)", 0, ops, us))

    # One cache grown through every size; the pool holds the largest size plus headroom.
    cache = KVCache(max(sizes) + 4 * (blocks_per_prompt + 1), block_size, policy=policy)
    work = _Workload(block_size, blocks_per_prompt, seed + 1)
    probes = 2_000
    for size in sorted(sizes):
        while len(cache.index) < size:
            work.run_request(cache)
        hits = [work.served[work.rng.randrange(len(work.served))] for _ in range(probes)]
        misses = [work.prompt() for _ in range(probes)]
        ops, us = _rate(cache.match, hits)
        rows.append(Row(f"lookup, hit of {blocks_per_prompt} blocks", size, ops, us))
        ops, us = _rate(cache.match, misses)
        rows.append(Row("lookup, miss", size, ops, us))
        ops, us = _rate(cache.evict, [1] * probes)
        rows.append(Row("evict one block", size, ops, us))
        # Refill to `size`, then each request must evict to fit: steady state under pressure.
        while cache.num_free_blocks > blocks_per_prompt + 1:
            work.run_request(cache)
        fresh = [work.prompt() for _ in range(probes // 10)]
        ops, us = _rate(partial(work.run_request, cache), fresh)
        rows.append(Row("request lifecycle, evicting", size, ops, us))

    smallest: dict[str, float] = {}
    for row in rows:
        base = smallest.setdefault(row.operation, row.us_per_op)
        row.vs_smallest = row.us_per_op / base
    return rows


def format_table(rows: list[Row], sizes: list[int]) -> str:
    header = (
        f"{'operation':<34} {'cached blocks':>13} {'ops/s':>12} {'us/op':>9} {'vs smallest':>11}"
    )
    lines = [header, "-" * len(header)]
    for r in rows:
        lines.append(
            f"{r.operation:<34} {r.cached_blocks:>13,} {r.ops_per_s:>12,.0f} "
            f"{r.us_per_op:>9.2f} {r.vs_smallest:>10.2f}x"
        )
    lo, hi = min(sizes), max(sizes)
    lines.append(
        f"\nlog2 growth from {lo:,} to {hi:,} blocks would be "
        f"{math.log2(hi) / math.log2(lo):.2f}x; timings are this machine's CPU, single thread."
    )
    return "\n".join(lines)
