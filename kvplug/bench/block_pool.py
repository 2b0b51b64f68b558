"""``kvplug bench block-pool``: µs per `BlockPool` call, kvplug's pool against vLLM's.

The shape of vLLM's own ``benchmarks/benchmark_block_pool.py``: a pool of 100,000 blocks,
and for each n in 10, 50, 100, 500, 1000, `iterations` rounds of ``get_new_blocks(n)``
then ``free_blocks`` of those blocks, each call timed. Two workloads:

- ``fresh`` (vLLM's benchmark): no block holds a hash, so nothing is evicted;
- ``evicting``: the pool is first filled with cached chains of n blocks, and before each
  round the n blocks held are cached as one request's chain (each with its hash, below
  the one before it) and freed tail first, as vLLM's manager frees a request; so every
  free block holds a hash and every ``get_new_blocks(n)`` evicts n cached blocks, the
  policy choosing which.

The arms run interleaved (stock, then each policy, per n), each on a pool of its own, in
one process; the ratio is kvplug's median against stock's. Only the two calls are timed.
"""

from __future__ import annotations

import gc
import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from types import SimpleNamespace
from typing import Any

SIZES = (10, 50, 100, 500, 1000)
WORKLOADS = ("fresh", "evicting")
STOCK = "stock"


@dataclass
class CallTimes:
    """One arm's median and p99 µs per call for one n and workload."""

    arm: str
    workload: str
    blocks_per_call: int
    get_us: float
    get_p99_us: float
    free_us: float
    free_p99_us: float
    get_ratio: float = 1.0  # against stock, same n and workload
    free_ratio: float = 1.0

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


def _pool(arm: str, num_blocks: int) -> Any:
    from vllm.v1.core.block_pool import BlockPool

    from kvplug.policies import make_policy
    from kvplug.vllm.block_pool import pool_class

    args = {"num_gpu_blocks": num_blocks, "enable_caching": True, "hash_block_size": 16}
    if arm == STOCK:
        return BlockPool(**args)
    policy = make_policy(arm, context=_context())
    return pool_class(policy)(**args, policy=policy)


def _context() -> Any:
    from kvplug.policies import PolicyContext

    return PolicyContext(tokens_per_block=16, serving=True)


def _cache_as_a_chain(pool: Any, blocks: Sequence[Any], serial: int) -> None:
    """Give `blocks` the hashes of one request's chain (vLLM's `cache_full_blocks`)."""
    from vllm.v1.core.kv_cache_utils import BlockHash

    hashes = [BlockHash(f"{serial}:{i}".encode()) for i in range(len(blocks))]
    request = SimpleNamespace(block_hashes=hashes, request_id=str(serial), lora_request=None)
    pool.cache_full_blocks(request, list(blocks), 0, len(blocks), 16, 0)


def _time_arm(pool: Any, n: int, iterations: int, workload: str) -> tuple[list[float], list[float]]:
    get_times, free_times = [], []
    clock = time.perf_counter_ns
    if workload == "evicting":  # every free block cached, in chains of n, before timing
        chains = []
        while pool.get_num_free_blocks() >= n:
            chains.append(pool.get_new_blocks(n))
            _cache_as_a_chain(pool, chains[-1], -len(chains))
        for chain in chains:
            pool.free_blocks(reversed(chain))
    held = pool.get_new_blocks(n)
    for i in range(iterations):
        if workload == "evicting":
            _cache_as_a_chain(pool, held, i)
        pool.free_blocks(reversed(held))  # as vLLM's manager frees a request: tail first
        start = clock()
        held = pool.get_new_blocks(n)
        middle = clock()
        pool.free_blocks(reversed(held))
        end = clock()
        held = pool.get_new_blocks(n)
        get_times.append((middle - start) / 1e3)
        free_times.append((end - middle) / 1e3)
    pool.free_blocks(held)
    return get_times, free_times


def _p99(values: list[float]) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(0.99 * len(ordered)))]


def bench_block_pool(
    policies: Sequence[str],
    sizes: Sequence[int] = SIZES,
    num_blocks: int = 100_000,
    iterations: int = 1000,
    workloads: Sequence[str] = WORKLOADS,
    progress: Callable[[str], None] | None = None,
) -> list[CallTimes]:
    """Every arm (stock first, then `policies`) at every n and workload, interleaved."""
    rows: list[CallTimes] = []
    for workload in workloads:
        for n in sizes:
            if progress:
                progress(f"{workload}, {n} blocks per call")
            stock: CallTimes | None = None
            for arm in (STOCK, *policies):
                pool = _pool(arm, num_blocks)
                gc.collect()
                gets, frees = _time_arm(pool, n, iterations, workload)
                row = CallTimes(arm, workload, n, statistics.median(gets), _p99(gets),
                                statistics.median(frees), _p99(frees))  # fmt: skip
                if stock is None:
                    stock = row
                else:
                    row.get_ratio = row.get_us / stock.get_us
                    row.free_ratio = row.free_us / stock.free_us
                rows.append(row)
    return rows


def format_table(rows: Sequence[CallTimes]) -> str:
    header = (
        f"{'workload':<9} {'n':>5} {'arm':<8} {'get µs':>9} {'p99':>9} {'ratio':>6} "
        f"{'free µs':>9} {'p99':>9} {'ratio':>6}"
    )
    lines = [header, "-" * len(header)]
    for r in rows:
        lines.append(
            f"{r.workload:<9} {r.blocks_per_call:>5} {r.arm:<8} {r.get_us:>9.1f} "
            f"{r.get_p99_us:>9.1f} {r.get_ratio:>5.2f}x {r.free_us:>9.1f} "
            f"{r.free_p99_us:>9.1f} {r.free_ratio:>5.2f}x"
        )
    return "\n".join(lines)
