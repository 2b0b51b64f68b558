"""``kvplug replay-hybrid``: a trace through hybrid models' caches, stock and kvplug."""

from __future__ import annotations

import json

import click

from kvplug.cli.options import names, numbers, progress_printer
from kvplug.hybrid.spec import HYBRID_PRESETS, load_hybrid
from kvplug.replay.hybrid import check_hybrid_arms, render_hybrid, run_hybrid_replay
from kvplug.replay.loop import Timing
from kvplug.replay.sources import load_trace


@click.command("replay-hybrid")
@click.argument("trace")
@click.option(
    "--model",
    default="gemma3-like",
    show_default=True,
    help=f"A hybrid preset ({', '.join(HYBRID_PRESETS)}) or a Hugging Face config.json "
    "(or its directory) with layer_types, hybrid_override_pattern or layers_block_type.",
)
@click.option(
    "--policy",
    "policies",
    default="lru,cost,vllm-stock,sglang-stock",
    show_default=True,
    help="Arms, comma-separated: lru, cost, belady (kvplug's hybrid cache; belady: the "
    "offline bound), vllm-stock, vllm-kvplug:<policy>, sglang-stock[:<policy>], "
    "sglang-kvplug:<policy>.",
)
@click.option(
    "--full-attention-policy",
    "full_policies",
    default="cost",
    show_default=True,
    help="Arms run on the model's full-attention equivalent, the reference ('' for none).",
)
@click.option(
    "--capacity-fractions",
    default="0.05,0.1",
    show_default=True,
    help="Cache sizes: fractions of the trace's distinct blocks, in the full-attention "
    "equivalent's bytes.",
)
@click.option("--sequential", is_flag=True, help="One request at a time, no decode.")
@click.option("--format", "fmt", type=click.Choice(["table", "json"]), default="table")
@click.option("--prefill-tps", default=Timing.prefill_tps, show_default=True)
@click.option("--decode-tps", default=Timing.decode_tps, show_default=True)
@click.option("--quiet", is_flag=True, help="No progress lines on stderr.")
def replay_hybrid(
    trace: str,
    model: str,
    policies: str,
    full_policies: str,
    capacity_fractions: str,
    sequential: bool,
    fmt: str,
    prefill_tps: float,
    decode_tps: float,
    quiet: bool,
) -> None:
    """Replay TRACE through hybrid-model caches; the hit is always the junction.

    TRACE: any source `kvplug replay` takes (a file, packaged:NAME, synthetic:NAME[:SEED]).
    """
    spec = load_hybrid(model)
    arms, reference = names(policies), names(full_policies)
    check_hybrid_arms(arms + reference)  # before reading a large trace
    fractions = numbers(capacity_fractions, float, "--capacity-fractions")
    loaded = load_trace(trace)
    progress = progress_printer(quiet)
    rows = run_hybrid_replay(
        loaded, spec, arms, fractions, sequential=sequential,
        timing=Timing(prefill_tps, decode_tps), full_attention_arms=reference, progress=progress,
    )  # fmt: skip
    if fmt == "json":
        click.echo(json.dumps([row.as_dict() for row in rows], indent=2))
        return
    window = f", window {spec.window} tokens" if spec.window else ""
    groups = ", ".join(f"{g.kind.value} x{g.layers}" for g in spec.groups) + window
    mode = "sequential" if sequential else "realistic"
    click.echo(
        f"{loaded.name}: {len(loaded.requests)} requests, {loaded.distinct_blocks:,} distinct "
        f"blocks of {loaded.block_tokens} tokens; {mode}; {spec.name}: {groups}\n"
    )
    click.echo(render_hybrid(rows))
