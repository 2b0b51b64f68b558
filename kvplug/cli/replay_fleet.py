"""``kvplug replay-fleet``: one trace routed across N simulated engines behind a router."""

from __future__ import annotations

import click

from kvplug.cli.options import (
    capacities,
    json_object,
    names,
    numbers,
    progress_printer,
    timings_for,
    with_replay_options,
)
from kvplug.core.model_spec import load_model
from kvplug.fleet.report import render
from kvplug.fleet.router import DEFAULT_LOAD_PENALTY, ROUTERS, check_router_names
from kvplug.fleet.runner import check_fleet_policies, run_fleet
from kvplug.replay.runner import check_policy_config
from kvplug.replay.sources import load_trace
from kvplug.replay.trace import FORMATS as TRACE_FORMATS

FLEET_POLICIES = "lru,cost"


@click.command("replay-fleet")
@click.argument("trace")
@click.option("--policy", "policies", default=FLEET_POLICIES, show_default=True,
              help="Online kvplug policies, comma-separated; each engine runs one.")  # fmt: skip
@click.option(
    "--trace-format",
    type=click.Choice(TRACE_FORMATS),
    default=None,
    help="Default: detected from the first line.",
)
@click.option(
    "--engines",
    default="2",
    show_default=True,
    help="Engine counts, comma-separated; each engine has its own cache of capacity/N blocks.",
)
@click.option(
    "--router",
    "routers",
    default=",".join(ROUTERS),
    show_default=True,
    help=f"Routers, comma-separated: {', '.join(ROUTERS)}.",
)
@click.option(
    "--event-lag",
    type=click.FloatRange(min=0),
    default=0.0,
    show_default=True,
    help="Seconds before an engine's KV event reaches the router.",
)
@click.option(
    "--load-penalty",
    type=click.FloatRange(min=0),
    default=DEFAULT_LOAD_PENALTY,
    show_default=True,
    help="The cache-aware router's weight on load against prefix share.",
)
@click.option(
    "--policy-config",
    default=None,
    help="A JSON object of policy parameters, given to every policy that takes them, "
    """e.g. '{"frequency_weight": 1}'.""",
)
@with_replay_options
def replay_fleet(
    trace: str,
    policies: str,
    trace_format: str | None,
    engines: str,
    routers: str,
    event_lag: float,
    load_penalty: float,
    policy_config: str | None,
    *,
    model: str,
    sequential: bool,
    capacity_blocks: str | None,
    capacity_fractions: str,
    fmt: str,
    prefill_tps: str,
    decode_tps: str,
    quiet: bool,
) -> None:
    """Route TRACE across N simulated engines, each with its own kvplug cache and policy,
    behind a router that knows the engines only through their KV events and loads.
    Capacities are the fleet's total. TRACE: any source `kvplug replay` takes."""
    if sequential:
        raise click.UsageError(
            "--sequential does not apply to the fleet replay: it models concurrent requests"
        )
    router_names, policy_names = names(routers), names(policies)
    check_router_names(router_names)  # before reading a large trace
    check_fleet_policies(policy_names)
    config = json_object(policy_config, "--policy-config") if policy_config else None
    check_policy_config(policy_names, config or {})
    loaded = load_trace(trace, trace_format)
    timings = timings_for(prefill_tps, decode_tps)
    rows = run_fleet(
        loaded, router_names, policy_names, numbers(engines, int, "--engines"),
        capacities(loaded, capacity_blocks, capacity_fractions), load_model(model),
        timings=timings, event_lag_s=event_lag, load_penalty=load_penalty,
        policy_config=config, progress=progress_printer(quiet),
    )  # fmt: skip
    if fmt == "table":
        what = (
            f"fleet replay, capacity = the fleet's total; KV events reach the router after "
            f"{event_lag:g} s; load penalty {load_penalty:g}"
        )
        if len(timings) > 1:
            what += f"; {len(timings)} timings (prefill x decode tokens/s), one run each"
        click.echo(
            f"{loaded.name}: {len(loaded.requests)} requests, {loaded.prompt_blocks:,} prompt "
            f"blocks ({loaded.distinct_blocks:,} distinct) of {loaded.block_tokens} tokens; "
            f"{what}; cost model {model}\n"
        )
    click.echo(render(rows, fmt))


__all__ = ["replay_fleet"]
