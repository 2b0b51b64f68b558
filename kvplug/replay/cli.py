"""``kvplug replay`` and ``kvplug ab``: trace replays through kvplug and the stock engines."""

from __future__ import annotations

import importlib.util
import json
from dataclasses import dataclass
from importlib import resources
from pathlib import Path
from typing import Any

import click

from kvplug.core.model_spec import DEFAULT_MODEL, load_model
from kvplug.fleet.report import render as render_fleet
from kvplug.fleet.router import DEFAULT_LOAD_PENALTY, ROUTERS, check_router_names
from kvplug.fleet.runner import check_fleet_policies, run_fleet
from kvplug.replay.loop import Timing
from kvplug.replay.report import FORMATS, explanations, plot, render
from kvplug.replay.runner import check_arm_names, check_policy_config, run_replay
from kvplug.replay.synthetic import synthetic_trace
from kvplug.replay.trace import FORMATS as TRACE_FORMATS
from kvplug.replay.trace import Trace, read_trace
from kvplug.serving.workload import WORKLOADS

DEFAULT_FRACTIONS = "0.02,0.05,0.1,0.25"
BUNDLED_TRACE = "synthetic-mixed.jsonl"
FLEET_POLICIES = "lru,cost"


def bundled_trace_path() -> Path:
    return Path(str(resources.files("kvplug") / "data" / "traces" / BUNDLED_TRACE))


def load_trace(source: str, fmt: str | None = None) -> Trace:
    """A trace file, or ``synthetic:NAME[:SEED]`` for a seeded synthetic workload."""
    if source.startswith("synthetic:"):
        name, _, seed = source.partition(":")[2].partition(":")
        if seed and not seed.isdigit():
            raise click.BadParameter(f"synthetic seed must be an integer, got {seed!r}")
        return synthetic_trace(name, seed=int(seed or 0))
    return read_trace(source, fmt)


def _numbers(text: str, kind: type, what: str) -> list:
    try:
        values = [kind(part) for part in text.split(",") if part.strip()]
    except ValueError:
        raise click.BadParameter(
            f"{what}: expected comma-separated numbers, got {text!r}"
        ) from None
    if not values or min(values) <= 0:
        raise click.BadParameter(f"{what}: expected positive numbers, got {text!r}")
    return values


def timings_for(prefill_tps: str, decode_tps: str) -> list[Timing]:
    """Every pairing of the comma-separated prefill and decode speeds."""
    return [
        Timing(prefill, decode)
        for decode in _numbers(decode_tps, float, "--decode-tps")
        for prefill in _numbers(prefill_tps, float, "--prefill-tps")
    ]


def capacities_for(trace: Trace, blocks: str | None, fractions: str) -> list[int]:
    if blocks:
        return _numbers(blocks, int, "--capacity-blocks")
    distinct = trace.distinct_blocks
    return [max(1, round(f * distinct)) for f in _numbers(fractions, float, "--capacity-fractions")]


def _run(
    trace: Trace,
    arms: list[str],
    plot_path: str | None,
    *,
    model: str,
    sequential: bool,
    capacity_blocks: str | None,
    capacity_fractions: str,
    fmt: str,
    prefill_tps: str,
    decode_tps: str,
    quiet: bool,
    fleet: FleetSpec | None = None,
    explain: bool = False,
    policy_config: dict[str, Any] | None = None,
) -> None:
    """Replay `trace` through `arms` (or, with `fleet`, through fleets running those
    policies), print the report, write the plot."""
    spec = load_model(model)
    capacities = capacities_for(trace, capacity_blocks, capacity_fractions)
    progress = None if quiet else (lambda msg: click.echo(f"  {msg}", err=True))
    timings = timings_for(prefill_tps, decode_tps)
    mode = "sequential" if sequential else "realistic"
    if fleet is None:
        if len(timings) > 1:
            raise click.UsageError(
                "several --prefill-tps or --decode-tps values apply to the fleet replay only "
                "(--engines N); give one of each"
            )
        (timing,) = timings
        rows = run_replay(
            trace, arms, capacities, spec, sequential=sequential, timing=timing,
            progress=progress, policy_config=policy_config,
        )  # fmt: skip
        report = render(rows, fmt)
        what = f"{mode} replay"
    else:
        fleet_rows = run_fleet(
            trace, fleet.routers, arms, fleet.engine_counts, capacities, spec, timings=timings,
            event_lag_s=fleet.event_lag_s, load_penalty=fleet.load_penalty, progress=progress,
        )  # fmt: skip
        report = render_fleet(fleet_rows, fmt)
        what = (
            f"fleet replay ({mode}), capacity = the fleet's total; KV events reach the "
            f"router after {fleet.event_lag_s:g} s; load penalty {fleet.load_penalty:g}"
        )
        if len(timings) > 1:
            what += f"; {len(timings)} timings (prefill x decode tokens/s), one run each"
    if fmt == "table":
        click.echo(
            f"{trace.name}: {len(trace.requests)} requests, {trace.prompt_blocks:,} prompt blocks "
            f"({trace.distinct_blocks:,} distinct) of {trace.block_tokens} tokens; {what}; "
            f"cost model {spec.name}\n"
        )
    click.echo(report)
    if explain and fleet is None and fmt == "table":
        click.echo("\n" + explanations(rows))
    if plot_path:
        path = plot(rows, plot_path, f"{trace.name} ({mode})")
        click.echo(f"\nplot: {path}", err=fmt != "table")


@dataclass(frozen=True)
class FleetSpec:
    """What a fleet replay varies besides policies and capacities, and how it routes."""

    engine_counts: list[int]
    routers: list[str]
    event_lag_s: float
    load_penalty: float


_common = [
    click.option(
        "--model",
        default=DEFAULT_MODEL,
        show_default=True,
        help="Cost model: a preset or a Hugging Face config.json (or its directory).",
    ),
    click.option(
        "--sequential",
        is_flag=True,
        help="One request at a time, no decode; a fully cached prompt is a full hit.",
    ),
    click.option("--capacity-blocks", default=None, help="Cache sizes in blocks, comma-separated."),
    click.option(
        "--capacity-fractions",
        default=DEFAULT_FRACTIONS,
        show_default=True,
        help="Cache sizes as fractions of the trace's distinct blocks.",
    ),
    click.option("--format", "fmt", type=click.Choice(FORMATS), default="table", show_default=True),
    click.option(
        "--prefill-tps",
        default=f"{Timing.prefill_tps:g}",
        show_default=True,
        help="Realistic mode: prefill tokens per second. The fleet replay takes several "
        "(comma-separated) and runs every pairing with --decode-tps, reporting the spread.",
    ),
    click.option(
        "--decode-tps",
        default=f"{Timing.decode_tps:g}",
        show_default=True,
        help="Realistic mode: decode tokens per second per request (the fleet replay: "
        "several, as --prefill-tps).",
    ),
    click.option("--quiet", is_flag=True, help="No progress lines on stderr."),
]


def _with_common(fn):
    for option in reversed(_common):
        fn = option(fn)
    return fn


@click.command()
@click.argument("trace")
@click.option(
    "--policy",
    "policies",
    default="lru,cost,belady,vllm-stock",
    show_default=True,
    help="Arms, comma-separated: kvplug policies, vllm-stock, vllm-kvplug:<policy>, "
    "sglang-stock:<policy>, sglang-kvplug:<policy>.",
)
@click.option(
    "--trace-format",
    type=click.Choice(TRACE_FORMATS),
    default=None,
    help="Default: detected from the first line.",
)
@click.option("--plot", "plot_path", default=None, help="Write saved compute vs capacity here.")
@click.option(
    "--engines",
    default=None,
    help="Fleet replay: route the trace across N simulated engines (comma-separated counts), "
    "each with its own cache of capacity/N blocks. Default policies there: lru,cost.",
)
@click.option(
    "--router",
    "routers",
    default=None,
    help=f"Fleet replay: routers, comma-separated: {', '.join(ROUTERS)} (default: all).",
)
@click.option(
    "--event-lag",
    type=click.FloatRange(min=0),
    default=0.0,
    show_default=True,
    help="Fleet replay: seconds before an engine's KV event reaches the router.",
)
@click.option(
    "--load-penalty",
    type=click.FloatRange(min=0),
    default=DEFAULT_LOAD_PENALTY,
    show_default=True,
    help="Fleet replay: the cache-aware router's weight on load against prefix share.",
)
@click.option(
    "--policy-config",
    default=None,
    help="A JSON object of policy parameters, given to every arm whose policy takes them, "
    """e.g. '{"frequency_weight": 0.5}' (single-cache replay only).""",
)
@click.option(
    "--explain",
    is_flag=True,
    help="After the table, each learning policy's state (JSON lines; json output has it "
    "in each row).",
)
@_with_common
@click.pass_context
def replay(
    ctx: click.Context,
    trace: str,
    policies: str,
    trace_format: str | None,
    plot_path: str | None,
    engines: str | None,
    routers: str | None,
    event_lag: float,
    load_penalty: float,
    policy_config: str | None,
    **options,
) -> None:
    """Replay TRACE through several eviction policies and cache sizes.

    TRACE is a Mooncake or Bailian JSON-lines file, or synthetic:NAME[:SEED] with NAME one
    of system-prompts, multi-turn, agent-loop, multi-adapter, conversations, mixed.

    With --engines N: the fleet replay. Each request goes to one of N engines, chosen by
    the router from the engines' KV events and loads; capacities are the fleet's total.
    """
    if engines is None:
        for name in ("routers", "event_lag", "load_penalty"):
            if ctx.get_parameter_source(name) is not click.core.ParameterSource.DEFAULT:
                flag = next(p.opts[0] for p in ctx.command.params if p.name == name)
                raise click.UsageError(f"{flag} applies to the fleet replay only: add --engines N")
        arms = _names(policies)
        check_arm_names(arms)  # before reading a large trace
        config = _json_object(policy_config, "--policy-config") if policy_config else None
        check_policy_config(arms, config or {})
        _run(load_trace(trace, trace_format), arms, plot_path, policy_config=config, **options)
        return
    if policy_config is not None:
        raise click.UsageError("--policy-config applies to the single-cache replay, not --engines")
    if options["sequential"] or plot_path:
        raise click.UsageError(
            "--sequential and --plot do not apply to the fleet replay (--engines): it models "
            "concurrent requests, and prints a table, JSON or CSV"
        )
    if ctx.get_parameter_source("policies") is click.core.ParameterSource.DEFAULT:
        policies = FLEET_POLICIES
    fleet = FleetSpec(
        engine_counts=_numbers(engines, int, "--engines"),
        routers=_names(routers or ",".join(ROUTERS)),
        event_lag_s=event_lag,
        load_penalty=load_penalty,
    )
    check_router_names(fleet.routers)  # before reading a large trace
    check_fleet_policies(_names(policies))
    _run(load_trace(trace, trace_format), _names(policies), None, fleet=fleet, **options)


def _json_object(text: str, flag: str) -> dict[str, Any]:
    try:
        value = json.loads(text)
    except json.JSONDecodeError as exc:
        raise click.BadParameter(f"{flag}: not JSON ({exc}): {text!r}") from None
    if not isinstance(value, dict):
        raise click.BadParameter(f"{flag}: expected a JSON object of parameters, got {text!r}")
    return value


def _names(text: str) -> list[str]:
    return [part.strip() for part in text.split(",") if part.strip()]


# `ab` options for each engine; giving one to the other engine is an error.
_REPLAY_ONLY = ("trace_source", "sequential", "capacity_blocks", "capacity_fractions",
                "prefill_tps", "decode_tps")  # fmt: skip
_SERVER_ONLY = ("workload", "num_blocks", "requests", "concurrency", "kvplug_config", "json_path",
                "repeat", "client", "bench_args", "python_core_arm")  # fmt: skip


@click.command()
@click.option(
    "--engine",
    type=click.Choice(["replay", "vllm", "sglang"]),
    default="replay",
    show_default=True,
    help="replay: the trace replay. vllm, sglang: a stock server of that engine against a "
    "kvplug one, over HTTP (needs the engine installed and --model DIR).",
)
@click.option(
    "--trace",
    "trace_source",
    default=None,
    help="Default: the bundled synthetic trace (agents, chats, shared prompts).",
)
@click.option(
    "--plot",
    "plot_path",
    default=None,
    help="Default: kvplug-ab.png (replay), kvplug-ab-ENGINE.png (vllm, sglang).",
)
@click.option(
    "--workload",
    type=click.Choice(WORKLOADS),
    default="mixed",
    show_default=True,
    help="vllm, sglang: the requests sent.",
)
@click.option(
    "--num-blocks",
    type=click.IntRange(min=2),
    default=128,
    show_default=True,
    help="vllm, sglang: KV blocks of 32 tokens per server (sglang: --max-total-tokens of "
    "32 tokens a block).",
)
@click.option(
    "--requests",
    type=click.IntRange(min=1),
    default=400,
    show_default=True,
    help="vllm, sglang: requests per arm.",
)
@click.option(
    "--concurrency",
    type=click.IntRange(min=1),
    default=8,
    show_default=True,
    help="vllm, sglang: most requests in flight (a chat keeps its slot between turns).",
)
@click.option(
    "--repeat",
    type=click.IntRange(min=1),
    default=1,
    show_default=True,
    help="vllm, sglang: runs per arm, interleaved (stock, kvplug, stock, ...); the table "
    "shows the median and [min-max].",
)
@click.option(
    "--kvplug-config",
    default=None,
    help='vllm, sglang: the kvplug arm\'s settings, a JSON object such as \'{"policy": "cost"}\'.',
)
@click.option(
    "--client",
    type=click.Choice(["kvplug", "vllm-bench"]),
    default="kvplug",
    show_default=True,
    help="vllm, sglang: who sends the requests. vllm-bench (--engine vllm): vLLM's own "
    "benchmark client (vllm.benchmarks.serve, prefix_repetition dataset sized to the KV "
    "budget) instead of --workload; vLLM's TTFT and throughput, hit ratio from /metrics.",
)
@click.option(
    "--python-core-arm",
    is_flag=True,
    help="--engine sglang: a third arm, SGLang's own lru on its pure-Python tree core (the "
    "core kvplug runs on), to tell the core's cost from the policy's.",
)
@click.option(
    "--bench-args",
    default=None,
    help="--client vllm-bench: extra 'vllm bench serve' flags, one quoted string; they win "
    "over kvplug's defaults (e.g. '--prefix-repetition-num-prefixes 4').",
)
@click.option(
    "--json", "json_path", default=None, help="vllm, sglang: also write the results here."
)
@_with_common
@click.pass_context
def ab(
    ctx: click.Context, engine: str, trace_source: str | None, plot_path: str | None, **options
) -> None:
    """A/B: kvplug's cost and lru policies, Belady's offline bound, and each engine's own
    stock cache (vLLM's KVCacheManager, SGLang's radix cache), on one trace, at several
    cache sizes. Stock arms whose engine is not installed are reported as unavailable.

    With --engine vllm or sglang: a stock server, then a kvplug one (vLLM: --scheduler-cls
    kvplug.vllm.Scheduler; SGLang: --radix-cache-backend kvplug), on the same model, KV
    budget and workload; TTFT, throughput, cached tokens and saved prefill compute side by
    side."""
    server = engine != "replay"
    other = _REPLAY_ONLY if server else _SERVER_ONLY
    for name in other:
        if ctx.get_parameter_source(name) is not click.core.ParameterSource.DEFAULT:
            flag = next(p.opts[0] for p in ctx.command.params if p.name == name)
            raise click.UsageError(f"{flag} does not apply to --engine {engine}")
    server_options = {name: options.pop(name) for name in _SERVER_ONLY}
    if server:
        from kvplug.serving.cli import server_ab

        if ctx.get_parameter_source("model") is click.core.ParameterSource.DEFAULT:
            raise click.UsageError(
                f"--engine {engine} needs --model DIR, a Hugging Face model directory "
                "(config.json, weights, tokenizer)"
            )
        server_ab(engine=engine, model=options["model"], plot_path=plot_path,
                  fmt=options["fmt"], quiet=options["quiet"], **server_options)  # fmt: skip
        return
    trace = load_trace(trace_source) if trace_source else read_trace(bundled_trace_path())
    arms = [
        "cost", "lru", "belady", "vllm-stock", "vllm-kvplug:cost", "sglang-stock:lru",
        "sglang-kvplug:cost",
    ]  # fmt: skip
    for engine in ("vllm", "sglang"):
        if importlib.util.find_spec(engine) is None and not options["quiet"]:
            click.echo(f"  note: {engine} is not installed; its stock arm is unavailable", err=True)
    _run(trace, arms, plot_path or "kvplug-ab.png", **options)
