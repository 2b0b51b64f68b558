"""``kvplug replay`` and ``kvplug ab``: trace replays through kvplug and the stock engines."""

from __future__ import annotations

import importlib.util
from importlib import resources
from pathlib import Path

import click

from kvplug.core.model_spec import DEFAULT_MODEL, load_model
from kvplug.replay.loop import Timing
from kvplug.replay.report import FORMATS, explanations, plot, render
from kvplug.replay.runner import check_arm_names, run_replay
from kvplug.replay.synthetic import synthetic_trace
from kvplug.replay.trace import FORMATS as TRACE_FORMATS
from kvplug.replay.trace import Trace, read_trace
from kvplug.serving.workload import WORKLOADS

DEFAULT_FRACTIONS = "0.02,0.05,0.1,0.25"
BUNDLED_TRACE = "synthetic-mixed.jsonl"


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
    explain: bool = False,
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
    if explain and fmt == "table":
        click.echo("\n" + explanations(rows))
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
    help="Arms, comma-separated: kvplug policies, vllm-stock, vllm-kvplug:<policy>, "
    "sglang-stock:<policy>.",
)
@click.option(
    "--trace-format",
    type=click.Choice(TRACE_FORMATS),
    default=None,
    help="Default: detected from the first line.",
)
@click.option("--plot", "plot_path", default=None, help="Write saved compute vs capacity here.")
@click.option(
    "--explain",
    is_flag=True,
    help="After the table, each learning policy's state (JSON lines; json output has it "
    "in each row).",
)
@_with_common
def replay(trace: str, policies: str, trace_format: str | None, plot_path, **options) -> None:
    """Replay TRACE through several eviction policies and cache sizes.

    TRACE is a Mooncake or Bailian JSON-lines file, or synthetic:NAME[:SEED] with NAME one
    of system-prompts, multi-turn, agent-loop, multi-adapter, conversations, mixed.
    """
    arms = [a.strip() for a in policies.split(",") if a.strip()]
    check_arm_names(arms)  # before reading a large trace
    _run(load_trace(trace, trace_format), arms, plot_path, **options)


# `ab` options for each engine; giving one to the other engine is an error.
_REPLAY_ONLY = ("trace_source", "sequential", "capacity_blocks", "capacity_fractions",
                "prefill_tps", "decode_tps")  # fmt: skip
_VLLM_ONLY = ("workload", "num_blocks", "requests", "concurrency", "kvplug_config", "json_path")


@click.command()
@click.option(
    "--engine",
    type=click.Choice(["replay", "vllm"]),
    default="replay",
    show_default=True,
    help="replay: the trace replay. vllm: a stock vLLM server against a kvplug one, over "
    "HTTP (needs vllm installed and --model DIR).",
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
    help="Default: kvplug-ab.png (replay), kvplug-ab-vllm.png (vllm).",
)
@click.option(
    "--workload",
    type=click.Choice(WORKLOADS),
    default="mixed",
    show_default=True,
    help="vllm: the requests sent.",
)
@click.option(
    "--num-blocks",
    type=click.IntRange(min=2),
    default=128,
    show_default=True,
    help="vllm: KV blocks per server.",
)
@click.option(
    "--requests",
    type=click.IntRange(min=1),
    default=400,
    show_default=True,
    help="vllm: requests per arm.",
)
@click.option(
    "--concurrency",
    type=click.IntRange(min=1),
    default=8,
    show_default=True,
    help="vllm: most requests in flight (a chat keeps its slot between turns).",
)
@click.option(
    "--kvplug-config",
    default=None,
    help='vllm: the kvplug arm\'s settings, a JSON object such as \'{"policy": "cost"}\'.',
)
@click.option("--json", "json_path", default=None, help="vllm: also write the results here.")
@_with_common
@click.pass_context
def ab(
    ctx: click.Context, engine: str, trace_source: str | None, plot_path: str | None, **options
) -> None:
    """A/B: kvplug's cost and lru policies, Belady's offline bound, and each engine's own
    stock cache (vLLM's KVCacheManager, SGLang's radix cache), on one trace, at several
    cache sizes. Stock arms whose engine is not installed are reported as unavailable.

    With --engine vllm: a stock vLLM server, then a kvplug one (--scheduler-cls
    kvplug.vllm.Scheduler), on the same model, KV budget and workload; TTFT, throughput,
    cached tokens and saved prefill compute side by side."""
    other = _REPLAY_ONLY if engine == "vllm" else _VLLM_ONLY
    for name in other:
        if ctx.get_parameter_source(name) is not click.core.ParameterSource.DEFAULT:
            flag = next(p.opts[0] for p in ctx.command.params if p.name == name)
            raise click.UsageError(f"{flag} does not apply to --engine {engine}")
    vllm_options = {name: options.pop(name) for name in _VLLM_ONLY}
    if engine == "vllm":
        from kvplug.serving.cli import vllm_ab

        if ctx.get_parameter_source("model") is click.core.ParameterSource.DEFAULT:
            raise click.UsageError(
                "--engine vllm needs --model DIR, a Hugging Face model directory "
                "(config.json, weights, tokenizer)"
            )
        vllm_ab(model=options["model"], plot_path=plot_path, fmt=options["fmt"],
                quiet=options["quiet"], **vllm_options)  # fmt: skip
        return
    trace = load_trace(trace_source) if trace_source else read_trace(bundled_trace_path())
    arms = ["cost", "lru", "belady", "vllm-stock", "vllm-kvplug:cost", "sglang-stock:lru"]
    for engine in ("vllm", "sglang"):
        if importlib.util.find_spec(engine) is None and not options["quiet"]:
            click.echo(f"  note: {engine} is not installed; its stock arm is unavailable", err=True)
    _run(trace, arms, plot_path or "kvplug-ab.png", **options)
