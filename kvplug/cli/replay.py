"""``kvplug replay`` (one cache, several policies) and ``kvplug ab`` (the main job: the A/B
replay of kvplug's policies against each engine's own cache)."""

from __future__ import annotations

from typing import Any

import click

from kvplug.cli.options import (
    capacities,
    json_object,
    names,
    progress_printer,
    timings_for,
    with_replay_options,
)
from kvplug.core.model_spec import load_model
from kvplug.core.queue_protection import MAX_DEPTH
from kvplug.replay.report import explanations, plot, render
from kvplug.replay.runner import (
    check_arm_names,
    check_policy_config,
    check_queue_depth,
    engine_of,
    missing_engines,
    run_replay,
)
from kvplug.replay.sources import DEFAULT_AB_TRACE, load_trace
from kvplug.replay.trace import FORMATS as TRACE_FORMATS
from kvplug.replay.trace import Trace

AB_ARMS = ("cost", "lru", "belady", "vllm-stock", "vllm-kvplug:cost", "sglang-stock:lru",
           "sglang-kvplug:cost")  # fmt: skip
ARM_HELP = (
    "Arms, comma-separated: kvplug policies, vllm-stock, vllm-kvplug:<policy>, "
    "sglang-stock:<policy>, sglang-kvplug:<policy>."
)


def run_single(
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
    explain: bool = False,
    policy_config: dict[str, Any] | None = None,
    host_blocks: int = 0,
    queue_protection: int = 0,
    sessions: bool = False,
) -> None:
    """Replay `trace` through `arms` at each capacity; print the report, write the plot."""
    spec = load_model(model)
    timings = timings_for(prefill_tps, decode_tps)
    if len(timings) > 1:
        raise click.UsageError(
            "several --prefill-tps or --decode-tps values apply to kvplug replay-fleet only; "
            "give one of each"
        )
    mode = "sequential" if sequential else "realistic"
    rows = run_replay(
        trace, arms, capacities(trace, capacity_blocks, capacity_fractions), spec,
        sequential=sequential, timing=timings[0], progress=progress_printer(quiet),
        policy_config=policy_config, host_blocks=host_blocks, queue_depth=queue_protection,
        sessions=sessions,
    )  # fmt: skip
    if fmt == "table":
        click.echo(
            f"{trace.name}: {len(trace.requests)} requests, {trace.prompt_blocks:,} prompt blocks "
            f"({trace.distinct_blocks:,} distinct) of {trace.block_tokens} tokens; {mode} "
            f"replay; cost model {spec.name}\n"
        )
    click.echo(render(rows, fmt))
    if explain and fmt == "table":
        click.echo("\n" + explanations(rows))
    if plot_path:
        path = plot(rows, plot_path, f"{trace.name} ({mode})")
        click.echo(f"\nplot: {path}", err=fmt != "table")


@click.command()
@click.argument("trace")
@click.option("--policy", "policies", default="lru,cost,belady,vllm-stock", show_default=True,
              help=ARM_HELP)  # fmt: skip
@click.option(
    "--trace-format",
    type=click.Choice(TRACE_FORMATS),
    default=None,
    help="Default: detected from the first line.",
)
@click.option("--plot", "plot_path", default=None, help="Write saved compute vs capacity here.")
@click.option(
    "--policy-config",
    default=None,
    help="A JSON object of policy parameters, given to every arm whose policy takes them, "
    """e.g. '{"frequency_weight": 1}'.""",
)
@click.option(
    "--explain",
    is_flag=True,
    help="After the table, each learning policy's state (JSON lines; json output has it "
    "in each row).",
)
@click.option(
    "--host-blocks",
    type=click.IntRange(min=0),
    default=0,
    help="A CPU tier of this many blocks beside each vLLM arm, filled as vLLM's lazy CPU "
    "offload fills it; a reload costs its bytes over the host link (host_link_gbps, "
    "prefill_tflops in --policy-config). 0: none.",
)
@click.option(
    "--queue-protection",
    type=click.IntRange(min=0, max=MAX_DEPTH),
    default=0,
    help="Realistic mode: the cached blocks the first N waiting requests would hit are "
    "evicted last, in the arms that run a kvplug policy kvplug ranks (its own cache, "
    "vllm-kvplug:<policy>); their rows are named <arm>+queueN. 0: none.",
)
@click.option(
    "--sessions",
    is_flag=True,
    help="Requests with a session id (a Bailian trace's conversation, a synthetic chat) "
    "name it, as a client's kvplug_session or OpenAI user field would; the rows of the "
    "arms whose policy reads it (cost, learned) end in +sessions. Default: none names one.",
)
@with_replay_options
def replay(
    trace: str,
    policies: str,
    trace_format: str | None,
    plot_path: str | None,
    policy_config: str | None,
    host_blocks: int,
    queue_protection: int,
    sessions: bool,
    **options: Any,
) -> None:
    """Replay TRACE through several eviction policies and cache sizes, one cache each.

    TRACE is a Mooncake or Bailian JSON-lines file, packaged:mooncake (the public Mooncake
    trace, shipped with kvplug), packaged:synthetic-mixed, or synthetic:NAME[:SEED] with
    NAME one of system-prompts, multi-turn, agent-loop, multi-adapter, conversations,
    bursts, hot-prompts, mixed, served-chats.
    """
    arms = names(policies)
    check_arm_names(arms)  # before reading a large trace
    config = json_object(policy_config, "--policy-config") if policy_config else None
    check_policy_config(arms, config or {})
    check_queue_depth(queue_protection, options["sequential"])
    run_single(
        load_trace(trace, trace_format), arms, plot_path, policy_config=config,
        host_blocks=host_blocks, queue_protection=queue_protection, sessions=sessions,
        **options,
    )  # fmt: skip


@click.command()
@click.option(
    "--trace",
    "trace_source",
    default=DEFAULT_AB_TRACE,
    show_default=True,
    help="Any source `kvplug replay` takes, e.g. packaged:synthetic-mixed or synthetic:mixed.",
)
@click.option("--plot", "plot_path", default="kvplug-ab.png", show_default=True)
@click.option("--engine", hidden=True, type=click.Choice(["replay"]), default="replay")
@click.option("--skip-engines", is_flag=True,
              help="Only kvplug's own cache (cost, lru, belady): no engine arms.")  # fmt: skip
@with_replay_options
@click.pass_context
def ab(
    ctx: click.Context,
    trace_source: str,
    plot_path: str,
    engine: str,
    skip_engines: bool,
    **options: Any,
) -> None:
    """A/B replay: kvplug's cost and lru policies, Belady's offline bound, and each engine's
    own stock cache (vLLM's KVCacheManager, SGLang's radix cache) and the same cache with
    kvplug's policy inside, on one trace at several cache sizes.

    The default trace is the public Mooncake trace. Arms whose engine is not installed in
    this environment are skipped, named on one line. Live servers: kvplug bench serve.
    """
    arms = [arm for arm in AB_ARMS if not skip_engines or engine_of(arm) is None]
    missing = missing_engines(arms)
    if missing:
        skipped = [arm for arm in arms if arm in missing]
        reasons = "; ".join(sorted(set(missing.values())))
        click.echo(f"skipping {', '.join(skipped)}: {reasons}", err=True)
        arms = [arm for arm in arms if arm not in missing]
    trace = load_trace(trace_source)
    run_single(trace, arms, plot_path, **options)
