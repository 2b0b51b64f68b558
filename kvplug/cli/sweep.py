"""``kvplug sweep``: the click command and its option parsers."""

from __future__ import annotations

import click

from kvplug.tools.sweep.config import (
    DEFAULT_BLOCK_SIZES,
    DEFAULT_BUCKETS,
    DEFAULT_WEIGHTS,
    LATENCY_BACKENDS,
    LatencySetup,
    ModelShape,
    SweepConfig,
    buckets_text,
)
from kvplug.tools.sweep.output import format_table, to_csv, to_json, write_plots
from kvplug.tools.sweep.run import run_sweep


def _parse_block_sizes(ctx: click.Context, param: click.Parameter, text: str) -> tuple[int, ...]:
    try:
        sizes = tuple(int(part) for part in text.split(","))
    except ValueError:
        sizes = ()
    if not sizes or min(sizes) < 1:
        raise click.BadParameter(
            f"expected comma-separated integers >= 1 (e.g. 8,16,32,64), got {text!r}"
        )
    return sizes


def _parse_buckets(
    ctx: click.Context, param: click.Parameter, text: str
) -> tuple[tuple[int, int], ...]:
    try:
        buckets = tuple(
            (int(lo), int(hi)) for lo, hi in (part.split("-") for part in text.split(","))
        )
    except ValueError:
        buckets = ()
    if not buckets or any(not 1 <= lo <= hi for lo, hi in buckets):
        raise click.BadParameter(
            f"expected comma-separated LOW-HIGH ranges with 1 <= LOW <= HIGH "
            f"(e.g. {buckets_text(DEFAULT_BUCKETS)}), got {text!r}"
        )
    return buckets


def _parse_weights(ctx: click.Context, param: click.Parameter, text: str) -> tuple[float, ...]:
    buckets = ctx.params.get("buckets", DEFAULT_BUCKETS)
    expected = (
        f"{len(buckets)} comma-separated numbers >= 0, not all 0, one per bucket "
        f"({buckets_text(buckets)})"
    )
    try:
        weights = tuple(float(part) for part in text.split(","))
    except ValueError:
        raise click.BadParameter(f"expected {expected}, got {text!r}") from None
    if len(weights) != len(buckets) or min(weights) < 0 or sum(weights) <= 0:
        raise click.BadParameter(f"expected {expected}, got {text!r}")
    return weights


@click.command(name="sweep")
@click.option(
    "--sequences",
    "num_sequences",
    default=2000,
    show_default=True,
    type=click.IntRange(min=1),
    help="Concurrent sequences in the trace.",
)
@click.option(
    "--buckets",
    default=buckets_text(DEFAULT_BUCKETS).replace(" ", ""),
    show_default=True,
    callback=_parse_buckets,
    is_eager=True,
    help="Length buckets, LOW-HIGH tokens.",
)
@click.option(
    "--weights",
    default=",".join(f"{w:g}" for w in DEFAULT_WEIGHTS),
    show_default=True,
    callback=_parse_weights,
    help="Bucket weights (need not sum to 1).",
)
@click.option(
    "--block-sizes",
    default=",".join(map(str, DEFAULT_BLOCK_SIZES)),
    show_default=True,
    callback=_parse_block_sizes,
    help="Block sizes to compare, any integers >= 1.",
)
@click.option(
    "--kv-bytes-per-token",
    type=click.IntRange(min=1),
    default=None,
    help="KV bytes per token over all layers (overrides the model shape).",
)
@click.option(
    "--layers",
    default=16,
    show_default=True,
    type=click.IntRange(min=1),
    help="Model layers; KV bytes per token = layers x kv-heads x head-dim x 2 x dtype-bytes "
    "(default: a Llama-3.2-1B-like model). Also scales the TPOT estimate.",
)
@click.option("--kv-heads", default=8, show_default=True, type=click.IntRange(min=1))
@click.option("--head-dim", default=64, show_default=True, type=click.IntRange(min=1))
@click.option("--dtype-bytes", default=2, show_default=True, type=click.IntRange(min=1))
@click.option(
    "--pool-gib",
    default=80.0,
    show_default=True,
    type=click.FloatRange(min=0),
    help="KV-cache memory of the engine.",
)
@click.option(
    "--reserve",
    default=0.10,
    show_default=True,
    type=click.FloatRange(min=0, max=1, max_open=True),
    help="Fraction of the pool that must stay free.",
)
@click.option(
    "--tpot-ms",
    type=click.FloatRange(min=0, min_open=True),
    default=None,
    help="Limit on the estimated attention time per output token.",
)
@click.option(
    "--backend",
    type=click.Choice(LATENCY_BACKENDS),
    default="auto",
    show_default=True,
    help="Kernel backend for decode latency; 'none' skips it.",
)
@click.option(
    "--latency-seqs",
    type=click.IntRange(min=1),
    default=None,
    help="Sequences in the latency run [default: all on a GPU, 32 on CPU].",
)
@click.option(
    "--repeats",
    default=5,
    show_default=True,
    type=click.IntRange(min=1),
    help="Timed decode calls per block size (the median is reported).",
)
@click.option("--seed", default=0, show_default=True)
@click.option(
    "--format",
    "fmt",
    type=click.Choice(["table", "json", "csv"]),
    default="table",
    show_default=True,
)
@click.option(
    "--plot",
    "plot_prefix",
    default=None,
    metavar="PREFIX",
    help="Write PREFIX-fragmentation.png and PREFIX-latency.png.",
)
def sweep(
    num_sequences: int,
    buckets: tuple[tuple[int, int], ...],
    weights: tuple[float, ...],
    block_sizes: tuple[int, ...],
    kv_bytes_per_token: int | None,
    layers: int,
    kv_heads: int,
    head_dim: int,
    dtype_bytes: int,
    pool_gib: float,
    reserve: float,
    tpot_ms: float | None,
    backend: str,
    latency_seqs: int | None,
    repeats: int,
    seed: int,
    fmt: str,
    plot_prefix: str | None,
) -> None:
    """Compare block sizes on a trace: tail waste, metadata, allocations and decode latency.

    Ends with the block size that fits the memory reserve and the TPOT limit.
    """
    config = SweepConfig(
        num_sequences=num_sequences,
        buckets=buckets,
        weights=weights,
        block_sizes=block_sizes,
        model=ModelShape(layers, kv_heads, head_dim, dtype_bytes),
        kv_bytes_per_token=kv_bytes_per_token,
        pool_gib=pool_gib,
        reserve=reserve,
        tpot_ms=tpot_ms,
        latency=LatencySetup(backend=backend, sequences=latency_seqs, repeats=repeats),
        seed=seed,
    )
    result = run_sweep(config)
    if fmt == "json":
        click.echo(to_json(result))
    elif fmt == "csv":
        click.echo(to_csv(result), nl=False)
        for note in [*result.notes, f"recommended block size: {result.recommended}"]:
            click.echo(f"# {note}", err=True)
    else:
        click.echo(format_table(result))
    if plot_prefix:
        for name in write_plots(result, plot_prefix):
            click.echo(f"wrote {name}", err=True)


if __name__ == "__main__":
    sweep()
