"""``kvplug bench sglang-cache``: SGLang's cache operations, kvplug's policy against SGLang's.

Four arms, SGLang's `UnifiedRadixCache` with its own ``lru`` on its default Rust tree core
(``sglang-stock:lru``, the yardstick) and on its Python core, and the same cache as
``--radix-cache-backend kvplug`` builds it (``sglang-kvplug:<policy>``) on each core
(`kvplug.sglang.rust_core`, `kvplug.sglang.tree_core`), run the same request stream,
driven as SGLang's scheduler drives the cache (the replay arms' ``admit``: match the
prompt, lock the prefix, allocate the rest, evicting when short; ``finish``: insert the
request and unlock). Each pool holds `pages` one-token pages and is filled first, so every
request evicts. Rounds alternate the arms' order; the table gives the median time per
request (all cache operations of one request) and its ratio to stock on the Rust core.

The workload: prompts of `prompt_len` tokens, each a shared system prefix (one of
`prefixes`, `prefix_len` tokens, Zipf-like popularity) and a unique suffix, so matches,
splits and evictions all happen.
"""

from __future__ import annotations

import gc
import random
import statistics
import time
from dataclasses import dataclass, field
from itertools import count

from kvplug.replay.arms.base import FRESH_UNIT_BASE
from kvplug.replay.arms.sglang import SGLangStockArm


@dataclass
class Workload:
    prompt_len: int = 256
    prefix_len: int = 192
    prefixes: int = 64
    seed: int = 0

    def stream(self) -> Stream:
        return Stream(self)


class Stream:
    """A deterministic request stream: the same seed gives every arm the same prompts."""

    def __init__(self, workload: Workload) -> None:
        self.workload = workload
        self.rng = random.Random(workload.seed)
        self.fresh = count(FRESH_UNIT_BASE)
        self.weights = [1.0 / (i + 1) for i in range(workload.prefixes)]

    def prompt(self) -> list[int]:
        w = self.workload
        which = self.rng.choices(range(w.prefixes), self.weights)[0]
        prefix = [which * 10_000 + i for i in range(w.prefix_len)]
        return prefix + [next(self.fresh) for _ in range(w.prompt_len - w.prefix_len)]


@dataclass
class ArmResult:
    pages: int
    arm: str
    request_us: float = 0.0  # median over rounds of the mean time per request
    ratio: float = 1.0
    round_ratios: list[float] = field(default_factory=list)
    hit_ratio: float = 0.0


def _request(arm: SGLangStockArm, req_id: int, prompt: list[int]) -> int:
    hits = arm.admit(req_id, prompt, len(prompt))
    if hits is None:
        return 0
    arm.finish(req_id)
    return hits


def bench_size(
    pages: int, policy: str, workload: Workload, requests: int, rounds: int
) -> list[ArmResult]:
    """Time both arms at one pool size (see the module doc)."""
    from kvplug.replay.arms.sglang_kvplug import SGLangKVPlugArm

    arms = [
        SGLangStockArm(pages, "lru", tree_core="rust"),
        SGLangStockArm(pages, "lru", tree_core="python"),
        SGLangKVPlugArm(pages, policy, tree_core="rust"),
        SGLangKVPlugArm(pages, policy, tree_core="python"),
    ]
    streams = [workload.stream() for _ in arms]
    ids = [count() for _ in arms]
    fill = pages // workload.prompt_len * 2 + 1  # twice the pool: eviction is steady
    for arm, stream, req_ids in zip(arms, streams, ids, strict=True):
        for _ in range(fill):
            _request(arm, next(req_ids), stream.prompt())
    times: list[list[float]] = [[] for _ in arms]
    hits = [0 for _ in arms]
    for round_index in range(rounds):
        order = range(len(arms)) if round_index % 2 == 0 else reversed(range(len(arms)))
        for i in order:
            arm, stream, req_ids = arms[i], streams[i], ids[i]
            prompts = [stream.prompt() for _ in range(requests)]
            gc.collect()
            start = time.perf_counter()
            for prompt in prompts:
                hits[i] += _request(arm, next(req_ids), prompt)
            times[i].append((time.perf_counter() - start) / requests * 1e6)
    total = rounds * requests * workload.prompt_len
    results = []
    for i, arm in enumerate(arms):
        core = "rust" if arm.tree_core == "rust" else "python"
        result = ArmResult(pages, f"{arm.name} ({core})", statistics.median(times[i]))
        result.round_ratios = [t / s for t, s in zip(times[i], times[0], strict=True)]
        result.ratio = result.request_us / statistics.median(times[0])
        result.hit_ratio = hits[i] / total
        results.append(result)
    return results


def format_table(results: list[ArmResult]) -> str:
    lines = [f"{'pages':>8} {'arm':<29} {'us/request':>10} {'ratio':>6} {'rounds':>10} {'hits':>6}"]
    for r in results:
        span = f"{min(r.round_ratios):.2f}-{max(r.round_ratios):.2f}"
        lines.append(
            f"{r.pages:>8,} {r.arm:<29} {r.request_us:>10.1f} {r.ratio:>5.2f}x {span:>10} "
            f"{r.hit_ratio:>6.3f}"
        )
    return "\n".join(lines)
