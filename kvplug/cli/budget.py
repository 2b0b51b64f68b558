"""``kvplug budget``: the KV budget worksheet for a model on a GPU."""

from __future__ import annotations

import json
from dataclasses import asdict

import click

from kvplug.core.model_spec import DEFAULT_MODEL, kv_budget, load_model


@click.command()
@click.option(
    "--model",
    default=DEFAULT_MODEL,
    show_default=True,
    help="A preset or a Hugging Face config.json (or its directory).",
)
@click.option("--gpu-memory", "gpu_gib", type=float, required=True, help="GiB per GPU.")
@click.option("--tp", type=int, default=1, show_default=True, help="Tensor-parallel degree.")
@click.option("--weight-dtype", default=None, help="Default: the config's dtype.")
@click.option("--kv-dtype", default=None, help="Default: the config's dtype.")
@click.option(
    "--weights-gib",
    type=float,
    default=None,
    help="Whole-model weight memory; default: computed from the config.",
)
@click.option(
    "--overhead-gib",
    type=float,
    default=0.0,
    show_default=True,
    help="Non-KV memory per rank: activations, CUDA graphs, fragmentation.",
)
@click.option(
    "--context",
    "contexts",
    default="4096,32768",
    show_default=True,
    help="Context lengths, comma-separated.",
)
@click.option("--utilization", type=float, default=0.85, show_default=True)
@click.option("--json", "as_json", is_flag=True)
def budget(
    model,
    gpu_gib,
    tp,
    weight_dtype,
    kv_dtype,
    weights_gib,
    overhead_gib,
    contexts,
    utilization,
    as_json,
) -> None:
    """How many KV tokens and concurrent sequences fit, and a max-num-seqs to run with."""
    try:
        lengths = tuple(int(c) for c in contexts.split(",") if c.strip())
    except ValueError:
        raise click.BadParameter(f"--context: expected integers, got {contexts!r}") from None
    spec = load_model(model)
    b = kv_budget(
        spec,
        gpu_gib,
        tp=tp,
        weight_dtype=weight_dtype,
        kv_dtype=kv_dtype,
        overhead_gib=overhead_gib,
        context_lengths=lengths,
        weights_gib=weights_gib,
        utilization=utilization,
    )
    if as_json:
        click.echo(json.dumps(asdict(b), indent=2))
        return
    per_token = b.kv_bytes_per_token_per_rank
    click.echo(f"model {b.model}, TP {b.tp}, {gpu_gib:g} GiB per GPU\n")
    click.echo(f"weights per rank          {b.weights_per_rank_gib:10.2f} GiB")
    click.echo(f"KV memory per rank        {b.kv_memory_per_rank_gib:10.2f} GiB")
    click.echo(f"KV bytes per token / rank {per_token:10,.0f} B ({per_token / 1024:g} KiB)")
    click.echo(f"max KV tokens per rank    {b.max_kv_tokens:10,}")
    click.echo(f"\n{'context':>8} {'max sequences':>14} {f'max-num-seqs @{utilization:.0%}':>20}")
    for c in lengths:
        click.echo(f"{c:>8,} {b.max_sequences[c]:>14,} {b.recommended_max_num_seqs[c]:>20,}")
