"""``kvplug replay`` and ``kvplug ab``: trace replays through kvplug and the stock engines."""

from __future__ import annotations

import importlib.util
from importlib import resources
from pathlib import Path

import click

from kvplug.cost import DEFAULT_MODEL, load_model
from kvplug.replay.loop import Timing
from kvplug.replay.report import FORMATS, plot, render
from kvplug.replay.runner import check_arm_names, run_replay
from kvplug.replay.synthetic import synthetic_trace
from kvplug.replay.trace import FORMATS as TRACE_FORMATS
from kvplug.replay.trace import Trace, read_trace

DEFAULT_FRACTIONS = "0.02,0.05,0.1,0.25"
BUNDLED_TRACE = "synthetic-mixed.jsonl"


def bundled_trace_path() -> Path:
    return Path(str(resources.files("kvplug") / "data" / "traces" / BUNDLED_TRACE))


def load_trace(source: str, fmt: str | None = None) -> Trace:
    """A trace file, or ``synthetic:NAME`` for a seeded synthetic workload."""
    if source.startswith("synthetic:"):
        return synthetic_trace(source.partition(":")[2])
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
    prefill_tps: float,
    decode_tps: float,
    quiet: bool,
) -> None:
    """Replay `trace` through `arms`, print the report, write the plot."""
    spec = load_model(model)
    capacities = capacities_for(trace, capacity_blocks, capacity_fractions)
    progress = None if quiet else (lambda msg: click.echo(f"  {msg}", err=True))
    rows = run_replay(
        trace,
        arms,
        capacities,
        spec,
        sequential=sequential,
        timing=Timing(prefill_tps, decode_tps),
        progress=progress,
    )
    mode = "sequential" if sequential else "realistic"
    if fmt == "table":
        click.echo(
            f"{trace.name}: {len(trace.requests)} requests, {trace.prompt_blocks:,} prompt blocks "
            f"({trace.distinct_blocks:,} distinct) of {trace.block_tokens} tokens; {mode} replay; "
            f"cost model {spec.name}\n"
        )
    click.echo(render(rows, fmt))
    if plot_path:
        path = plot(rows, plot_path, f"{trace.name} ({mode})")
        click.echo(f"\nplot: {path}", err=fmt != "table")


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
        default=Timing.prefill_tps,
        show_default=True,
        help="Realistic mode: prefill tokens per second.",
    ),
    click.option(
        "--decode-tps",
        default=Timing.decode_tps,
        show_default=True,
        help="Realistic mode: decode tokens per second per request.",
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
    help="Arms, comma-separated: kvplug policies, vllm-stock, sglang-stock:<policy>.",
)
@click.option(
    "--trace-format",
    type=click.Choice(TRACE_FORMATS),
    default=None,
    help="Default: detected from the first line.",
)
@click.option("--plot", "plot_path", default=None, help="Write saved compute vs capacity here.")
@_with_common
def replay(trace: str, policies: str, trace_format: str | None, plot_path, **options) -> None:
    """Replay TRACE through several eviction policies and cache sizes.

    TRACE is a Mooncake or Bailian JSON-lines file, or synthetic:NAME with NAME one of
    system-prompts, multi-turn, agent-loop, mixed.
    """
    arms = [a.strip() for a in policies.split(",") if a.strip()]
    check_arm_names(arms)  # before reading a large trace
    _run(load_trace(trace, trace_format), arms, plot_path, **options)


@click.command()
@click.option(
    "--trace",
    "trace_source",
    default=None,
    help="Default: the bundled synthetic trace (agents, chats, shared prompts).",
)
@click.option("--plot", "plot_path", default="kvplug-ab.png", show_default=True)
@_with_common
def ab(trace_source: str | None, plot_path: str, **options) -> None:
    """A/B: kvplug's cost and lru policies, Belady's offline bound, and each engine's own
    stock cache (vLLM's KVCacheManager, SGLang's radix cache), on one trace, at several
    cache sizes. Stock arms whose engine is not installed are reported as unavailable."""
    trace = load_trace(trace_source) if trace_source else read_trace(bundled_trace_path())
    arms = ["cost", "lru", "belady", "vllm-stock", "sglang-stock:lru"]
    for engine in ("vllm", "sglang"):
        if importlib.util.find_spec(engine) is None and not options["quiet"]:
            click.echo(f"  note: {engine} is not installed; its stock arm is unavailable", err=True)
    _run(trace, arms, plot_path, **options)
