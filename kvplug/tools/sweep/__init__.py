"""The block-size sweep: ``kvplug sweep``.

A block size trades tail waste (the unused slots of each sequence's last block, about
``(B - 1) / 2`` tokens per sequence) against metadata and kernel cost (block-table
entries, allocations, and a kernel that walks more, smaller pages). The sweep measures
both sides on one trace:

1. the trace: `num_sequences` concurrent sequence lengths, each drawn by picking a bucket
   (1-64, 65-512, 513-4096, 4097-16384 tokens by default) with the given weights, then a
   length uniformly inside it;
2. accounting, per block size (no torch needed): every sequence is added to a real
   `kvplug.core.cache.KVCache` with that block size; its `usage()` and `metrics` give logical
   tokens, physical slots, tail waste, block-table entries and block allocations;
3. latency, per block size: one paged decode step over the same sequences with a kernel
   backend (`kvplug.kernels`), keys and values laid out in shuffled blocks. On CPU the
   reference backend runs a small head shape over a subsample, so it finishes in seconds;
   those timings are labelled CPU timings and say little about a GPU;
4. a recommendation: of the block sizes whose memory fits the pool minus the declared
   reserve and whose estimated attention time per output token meets the limit, the one
   with the fastest decode (ties: the least memory).
"""

from __future__ import annotations

import csv
import io
import json
import math
import random
import statistics
import time
from dataclasses import asdict, dataclass, field
from typing import Any

import click

from kvplug.core.cache import KVCache
from kvplug.errors import ConfigError, KVPlugError

DEFAULT_BUCKETS: tuple[tuple[int, int], ...] = ((1, 64), (65, 512), (513, 4096), (4097, 16384))
DEFAULT_WEIGHTS: tuple[float, ...] = (0.4, 0.35, 0.2, 0.05)
DEFAULT_BLOCK_SIZES: tuple[int, ...] = (8, 16, 32, 64)
LATENCY_BACKENDS = ("auto", "reference", "triton", "flashinfer", "none")
TABLE_ENTRY_BYTES = 4  # one int32 block id
GIB = 1024**3


@dataclass(frozen=True)
class ModelShape:
    """The KV footprint of a model, all layers together. Default: a Llama-3.2-1B-like model."""

    layers: int = 16
    kv_heads: int = 8
    head_dim: int = 64
    dtype_bytes: int = 2

    @property
    def bytes_per_token(self) -> int:
        return self.layers * self.kv_heads * self.head_dim * 2 * self.dtype_bytes  # K and V


@dataclass(frozen=True)
class LatencySetup:
    """How decode latency is measured. None fields are filled in for the device."""

    backend: str = "auto"  # one of LATENCY_BACKENDS; "none" skips the measurement
    sequences: int | None = None  # measured subsample; None: all on a GPU, 32 on CPU
    q_per_kv: int = 4  # query heads per KV head (GQA group size)
    kv_heads: int | None = None  # None: the model's on a GPU, 1 on CPU
    head_dim: int | None = None  # None: the model's on a GPU, 64 on CPU
    repeats: int = 5


@dataclass(frozen=True)
class SweepConfig:
    num_sequences: int = 2000
    buckets: tuple[tuple[int, int], ...] = DEFAULT_BUCKETS
    weights: tuple[float, ...] = DEFAULT_WEIGHTS
    block_sizes: tuple[int, ...] = DEFAULT_BLOCK_SIZES
    model: ModelShape = field(default_factory=ModelShape)
    kv_bytes_per_token: int | None = None  # overrides model.bytes_per_token
    pool_gib: float = 80.0  # KV memory the engine has
    reserve: float = 0.10  # fraction of the pool to keep free
    tpot_ms: float | None = None  # limit on estimated attention time per output token
    latency: LatencySetup = field(default_factory=LatencySetup)
    seed: int = 0

    def __post_init__(self) -> None:
        if self.num_sequences < 1:
            raise ConfigError(f"sequences must be >= 1, got {self.num_sequences}")
        if not self.block_sizes or any(b < 1 for b in self.block_sizes):
            raise ConfigError(f"block sizes must be integers >= 1, got {list(self.block_sizes)}")
        for lo, hi in self.buckets:
            if not 1 <= lo <= hi:
                raise ConfigError(f"bucket {lo}-{hi} must satisfy 1 <= low <= high")
        if len(self.weights) != len(self.buckets):
            raise ConfigError(
                f"{len(self.weights)} weights for {len(self.buckets)} buckets "
                f"({_buckets_text(self.buckets)}); give one weight per bucket"
            )
        if any(w < 0 for w in self.weights) or sum(self.weights) <= 0:
            raise ConfigError(f"weights must be >= 0 and not all 0, got {list(self.weights)}")
        if not 0 <= self.reserve < 1:
            raise ConfigError(f"reserve must be a fraction in [0, 1), got {self.reserve}")
        if self.latency.backend not in LATENCY_BACKENDS:
            raise ConfigError(
                f"unknown backend {self.latency.backend!r}; accepted: {', '.join(LATENCY_BACKENDS)}"
            )
        if self.tpot_ms is not None and self.latency.backend == "none":
            raise ConfigError("a TPOT limit needs a latency measurement; pick a backend")

    @property
    def bytes_per_token(self) -> int:
        return self.kv_bytes_per_token or self.model.bytes_per_token


# -- the trace and the accounting (no torch) -------------------------------------------


def sample_lengths(
    num_sequences: int,
    buckets: tuple[tuple[int, int], ...],
    weights: tuple[float, ...],
    seed: int,
) -> list[int]:
    """Draw a bucket by weight, then a length uniformly in it, `num_sequences` times."""
    rng = random.Random(seed)
    picks = rng.choices(buckets, weights=weights, k=num_sequences)
    return [rng.randint(lo, hi) for lo, hi in picks]


@dataclass
class Accounting:
    """What the trace's sequences hold at one block size (from a real `KVCache`)."""

    block_size: int
    sequences: int
    logical_tokens: int
    physical_slots: int
    tail_waste_tokens: int
    table_entries: int
    allocations: int

    @property
    def waste_per_sequence(self) -> float:
        return self.tail_waste_tokens / self.sequences

    @property
    def expected_waste_per_sequence(self) -> float:
        """The analytical estimate: a remainder uniform on 0..B-1 wastes (B - 1) / 2."""
        return (self.block_size - 1) / 2


def account(lengths: list[int], block_size: int) -> Accounting:
    """Add every sequence, whole, to a fresh `KVCache` of `block_size`; read its gauges."""
    num_blocks = sum(math.ceil(n / block_size) for n in lengths)
    cache = KVCache(num_blocks, block_size, enable_prefix_caching=False)
    for req_id, n in enumerate(lengths):
        tokens = [0] * n  # token values do not matter without prefix caching
        cache.add_request(req_id, tokens)
        cache.append(req_id, tokens)
    usage = cache.usage()
    return Accounting(
        block_size=block_size,
        sequences=len(lengths),
        logical_tokens=usage.logical_tokens,
        physical_slots=usage.physical_token_slots,
        tail_waste_tokens=usage.tail_waste,
        table_entries=usage.block_table_entries,
        allocations=cache.metrics.allocations,
    )


# -- latency (torch, imported only here) -----------------------------------------------


@dataclass(frozen=True)
class LatencyPlan:
    """The measurement actually run, after device defaults are filled in."""

    backend: str
    device: str
    sequences: int
    q_heads: int
    kv_heads: int
    head_dim: int
    dtype: str
    repeats: int

    def describe(self, total_sequences: int) -> str:
        where = f"on {self.device}"
        if self.device == "cpu":
            where = "CPU timings (one thread), not GPU figures"
        return (
            f"decode latency: {self.backend} backend, {where}; {self.sequences} of "
            f"{total_sequences} sequences, {self.q_heads} query / {self.kv_heads} KV heads x "
            f"{self.head_dim} dims, {self.dtype}, median of {self.repeats} calls, one layer"
        )


def plan_latency(config: SweepConfig, lengths: list[int]) -> LatencyPlan | str:
    """The latency measurement to run, or why none runs (a note for the output)."""
    setup = config.latency
    if setup.backend == "none":
        return "decode latency not measured (--backend none)"
    from kvplug.kernels import AVAILABLE, available_backends

    status = available_backends()
    if status["reference"] != AVAILABLE:
        if setup.backend == "auto":
            missing = status["reference"]
            return f"decode latency not measured: {missing} (pip install 'kvplug[kernels]')"
        raise KVPlugError(f"backend {setup.backend!r} is unavailable: {status['reference']}")
    import torch

    device = "cuda" if torch.cuda.is_available() else "cpu"
    on_gpu = device == "cuda"
    backend = setup.backend
    kv_heads = setup.kv_heads or (config.model.kv_heads if on_gpu else 1)
    head_dim = setup.head_dim or (config.model.head_dim if on_gpu else 64)
    dtype = "bfloat16" if on_gpu else "float32"
    if backend == "auto":
        from kvplug.kernels import select_backend

        probe = torch.empty(1, kv_heads * setup.q_per_kv, head_dim, device=device)
        cache = torch.empty(1, 16, kv_heads, head_dim, device=device)
        table = torch.empty(1, 1, device=device)
        backend = select_backend("auto", probe.to(getattr(torch, dtype)), cache, table).NAME
    if status[backend] != AVAILABLE:
        raise KVPlugError(f"backend {backend!r} is unavailable: {status[backend]}")
    return LatencyPlan(
        backend=backend,
        device=device,
        sequences=min(len(lengths), setup.sequences or (len(lengths) if on_gpu else 32)),
        q_heads=kv_heads * setup.q_per_kv,
        kv_heads=kv_heads,
        head_dim=head_dim,
        dtype=dtype if backend != "reference" else "float32",
        repeats=setup.repeats,
    )


def measure_decode_ms(lengths: list[int], block_size: int, plan: LatencyPlan, seed: int) -> float:
    """Median milliseconds of one paged decode step over `lengths` at `block_size`.

    Blocks are shuffled across sequences. The inputs are checked once, outside the timing;
    FlashInfer is planned once and only its run is timed, as an engine plans once per
    step for all layers.
    """
    import torch

    from kvplug.kernels import paged_decode, select_backend

    gen = torch.Generator().manual_seed(seed)
    dtype = getattr(torch, plan.dtype)
    pages = [math.ceil(n / block_size) for n in lengths]
    num_blocks = sum(pages)
    order = torch.randperm(num_blocks, generator=gen)
    table = torch.zeros(len(lengths), max(pages), dtype=torch.int32)
    start = 0
    for b, count in enumerate(pages):
        table[b, :count] = order[start : start + count]
        start += count
    shape = (num_blocks, block_size, plan.kv_heads, plan.head_dim)
    values = torch.Generator(plan.device).manual_seed(seed)  # on the device: GBs on a GPU
    k_cache = torch.randn(shape, generator=values, device=plan.device).to(dtype)
    v_cache = torch.randn(shape, generator=values, device=plan.device).to(dtype)
    q_shape = (len(lengths), plan.q_heads, plan.head_dim)
    q = torch.randn(q_shape, generator=values, device=plan.device).to(dtype)
    table = table.to(plan.device)
    seq_lens = torch.tensor(lengths, dtype=torch.int32, device=plan.device)

    paged_decode(q, k_cache, v_cache, table, seq_lens, backend=plan.backend)  # checks; warm-up
    module = select_backend(plan.backend, q, k_cache, table)
    scale = plan.head_dim**-0.5
    if module.NAME == "flashinfer":
        decoder = module.PagedDecoder(
            table, seq_lens, q_heads=plan.q_heads, kv_heads=plan.kv_heads,
            head_dim=plan.head_dim, page_size=block_size, dtype=dtype, scale=scale,
        )  # fmt: skip

        def step() -> object:
            return decoder.run(q, k_cache, v_cache)
    else:

        def step() -> object:
            return module.decode(q, k_cache, v_cache, table, seq_lens, scale)

    # One CPU thread: torch's thread pool slows down erratically, by up to 10x, when other
    # processes share the cores, which would swamp the differences between block sizes.
    threads = torch.get_num_threads()
    if plan.device == "cpu":
        torch.set_num_threads(1)
    try:
        step()
        times = []
        for _ in range(plan.repeats):
            if plan.device == "cuda":
                torch.cuda.synchronize()
            begin = time.perf_counter()
            step()
            if plan.device == "cuda":
                torch.cuda.synchronize()
            times.append((time.perf_counter() - begin) * 1e3)
    finally:
        torch.set_num_threads(threads)
    return statistics.median(times)


# -- the sweep -------------------------------------------------------------------------


@dataclass
class SweepRow:
    """One block size's figures. Bytes count every layer's K and V."""

    block_size: int
    logical_tokens: int
    physical_slots: int
    tail_waste_tokens: int
    waste_per_sequence: float
    expected_waste_per_sequence: float  # (B - 1) / 2
    tail_waste_bytes: int
    waste_fraction: float  # of physical slots
    table_entries: int
    allocations: int
    memory_bytes: int  # physical slots plus block tables
    fits_memory: bool
    decode_ms: float | None = None  # measured, one layer, the measured subsample
    est_attention_tpot_ms: float | None = None  # decode_ms x layers x (all / measured tokens)
    meets_tpot: bool | None = None


@dataclass
class SweepResult:
    config: SweepConfig
    lengths: list[int]
    rows: list[SweepRow]
    latency: LatencyPlan | None
    notes: list[str]
    recommended: int | None
    reason: str


def run_sweep(config: SweepConfig) -> SweepResult:
    lengths = sample_lengths(config.num_sequences, config.buckets, config.weights, config.seed)
    plan = plan_latency(config, lengths)
    notes: list[str] = []
    if isinstance(plan, str):
        notes.append(plan)
        plan = None
    else:
        notes.append(plan.describe(len(lengths)))
    measured = lengths[: plan.sequences] if plan else []
    scale_up = sum(lengths) / sum(measured) if measured else 0.0
    budget = (1 - config.reserve) * config.pool_gib * GIB
    rows = []
    for block_size in config.block_sizes:
        acc = account(lengths, block_size)
        memory = acc.physical_slots * config.bytes_per_token + acc.table_entries * TABLE_ENTRY_BYTES
        row = SweepRow(
            block_size=block_size,
            logical_tokens=acc.logical_tokens,
            physical_slots=acc.physical_slots,
            tail_waste_tokens=acc.tail_waste_tokens,
            waste_per_sequence=acc.waste_per_sequence,
            expected_waste_per_sequence=acc.expected_waste_per_sequence,
            tail_waste_bytes=acc.tail_waste_tokens * config.bytes_per_token,
            waste_fraction=acc.tail_waste_tokens / acc.physical_slots,
            table_entries=acc.table_entries,
            allocations=acc.allocations,
            memory_bytes=memory,
            fits_memory=memory <= budget,
        )
        if plan:
            row.decode_ms = measure_decode_ms(measured, block_size, plan, config.seed)
            row.est_attention_tpot_ms = row.decode_ms * config.model.layers * scale_up
            if config.tpot_ms is not None:
                row.meets_tpot = row.est_attention_tpot_ms <= config.tpot_ms
        rows.append(row)
    if plan:
        scaled = f" x {scale_up:.1f} (all tokens / measured tokens)" if scale_up > 1 else ""
        notes.append(
            f"est. TPOT counts attention only: the measured step x {config.model.layers} "
            f"layers{scaled}"
        )
    recommended, reason = recommend(rows, config)
    return SweepResult(config, lengths, rows, plan, notes, recommended, reason)


def recommend(rows: list[SweepRow], config: SweepConfig) -> tuple[int | None, str]:
    """The block size that fits the memory reserve and meets the TPOT limit, and why."""
    budget_gib = (1 - config.reserve) * config.pool_gib
    limits = (
        f"memory <= {budget_gib:.1f} GiB ({config.pool_gib:g} GiB pool less {config.reserve:.0%})"
    )
    if config.tpot_ms is not None:
        limits += f" and est. attention TPOT <= {config.tpot_ms:g} ms"
    feasible = [r for r in rows if r.fits_memory and r.meets_tpot is not False]
    if not feasible:
        misses = []
        for r in rows:
            why = []
            if not r.fits_memory:
                why.append(f"needs {r.memory_bytes / GIB:.1f} GiB")
            if r.meets_tpot is False:
                why.append(f"TPOT {r.est_attention_tpot_ms:.1f} ms")
            misses.append(f"{r.block_size}: {', '.join(why)}")
        return None, f"no block size meets {limits} ({'; '.join(misses)})"
    if all(r.decode_ms is not None for r in feasible):
        best = min(feasible, key=lambda r: (r.decode_ms, r.memory_bytes))
        why = f"the fastest decode ({best.decode_ms:.3f} ms) of those that meet {limits}"
    else:
        best = min(feasible, key=lambda r: r.memory_bytes)
        why = f"the least memory of those that meet {limits} (latency not measured)"
    return best.block_size, why


# -- output ----------------------------------------------------------------------------

COLUMNS = [
    # (header, row attribute, format)
    ("block", "block_size", "{}"),
    ("logical tok", "logical_tokens", "{:,}"),
    ("slots", "physical_slots", "{:,}"),
    ("waste tok", "tail_waste_tokens", "{:,}"),
    ("waste/seq", "waste_per_sequence", "{:.2f}"),
    ("(B-1)/2", "expected_waste_per_sequence", "{:.1f}"),
    ("waste GiB", "tail_waste_bytes", "gib"),
    ("waste %", "waste_fraction", "pct"),
    ("table entries", "table_entries", "{:,}"),
    ("allocs", "allocations", "{:,}"),
    ("memory GiB", "memory_bytes", "gib"),
    ("decode ms", "decode_ms", "{:.3f}"),
    ("est TPOT ms", "est_attention_tpot_ms", "{:.2f}"),
    ("fits", "fits_memory", "yn"),
    ("TPOT ok", "meets_tpot", "yn"),
]


def _cell(value: Any, fmt: str) -> str:
    if value is None:
        return "-"
    if fmt == "gib":
        return f"{value / GIB:.2f}"
    if fmt == "pct":
        return f"{value:.2%}"
    if fmt == "yn":
        return "yes" if value else "no"
    return fmt.format(value)


def format_table(result: SweepResult) -> str:
    cfg = result.config
    header = [name for name, _, _ in COLUMNS]
    if result.latency and result.latency.device == "cpu":
        header[header.index("decode ms")] = "decode ms (CPU)"
    body = [[_cell(getattr(r, attr), fmt) for _, attr, fmt in COLUMNS] for r in result.rows]
    widths = [max(len(line[i]) for line in [header, *body]) for i in range(len(header))]
    lines = [
        f"block-size sweep: {len(result.lengths):,} sequences from buckets "
        f"{_buckets_text(cfg.buckets)} weighted {', '.join(f'{w:g}' for w in cfg.weights)} "
        f"(seed {cfg.seed}); {cfg.bytes_per_token:,} KV bytes per token",
        "",
        "  ".join(h.rjust(w) for h, w in zip(header, widths, strict=True)),
        "  ".join("-" * w for w in widths),
        *("  ".join(c.rjust(w) for c, w in zip(line, widths, strict=True)) for line in body),
        "",
        *(f"note: {note}" for note in result.notes),
        "",
        f"recommendation: block size {result.recommended}: {result.reason}"
        if result.recommended is not None
        else f"recommendation: none: {result.reason}",
    ]
    return "\n".join(lines)


def to_json(result: SweepResult) -> str:
    report = {
        "config": asdict(result.config),
        "bytes_per_token": result.config.bytes_per_token,
        "sequences": len(result.lengths),
        "latency": asdict(result.latency) if result.latency else None,
        "rows": [asdict(r) for r in result.rows],
        "notes": result.notes,
        "recommended_block_size": result.recommended,
        "reason": result.reason,
    }
    return json.dumps(report, indent=2)


def to_csv(result: SweepResult) -> str:
    out = io.StringIO()
    names = list(asdict(result.rows[0]))
    writer = csv.DictWriter(out, fieldnames=names, lineterminator="\n")
    writer.writeheader()
    for row in result.rows:
        writer.writerow(asdict(row))
    return out.getvalue()


def write_plots(result: SweepResult, prefix: str) -> list[str]:
    """Save fragmentation and latency against block size; return the file names."""
    try:
        import matplotlib
    except ImportError as exc:
        raise KVPlugError("plots need matplotlib: pip install 'kvplug[kernels]'") from exc
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    sizes = [r.block_size for r in result.rows]
    files = []
    fig, waste_axis = plt.subplots(figsize=(6, 4))
    waste_axis.plot(sizes, [r.waste_per_sequence for r in result.rows], "o-", label="measured")
    waste_axis.plot(sizes, [r.expected_waste_per_sequence for r in result.rows], "--",
                    label="(B - 1) / 2")  # fmt: skip
    waste_axis.set_xscale("log", base=2)
    waste_axis.set_xticks(sizes, [str(size) for size in sizes])
    waste_axis.set_xlabel("block size (tokens)")
    waste_axis.set_ylabel("tail waste per sequence (tokens)")
    table_axis = waste_axis.twinx()
    table_axis.plot(sizes, [r.table_entries for r in result.rows], "s:", color="gray")
    table_axis.set_ylabel("block-table entries (gray)")
    waste_axis.legend(loc="upper center")
    waste_axis.set_title("Fragmentation against block size")
    fig.tight_layout()
    files.append(f"{prefix}-fragmentation.png")
    fig.savefig(files[-1], dpi=120)
    plt.close(fig)

    if result.latency:
        fig, axis = plt.subplots(figsize=(6, 4))
        axis.plot(sizes, [r.decode_ms for r in result.rows], "o-")
        axis.set_xscale("log", base=2)
        axis.set_xticks(sizes, [str(size) for size in sizes])
        axis.set_xlabel("block size (tokens)")
        where = "CPU" if result.latency.device == "cpu" else result.latency.device
        axis.set_ylabel(f"decode step, one layer (ms, {where})")
        axis.set_title(f"Decode latency against block size ({result.latency.backend})")
        fig.tight_layout()
        files.append(f"{prefix}-latency.png")
        fig.savefig(files[-1], dpi=120)
        plt.close(fig)
    return files


# -- command line ----------------------------------------------------------------------


def _buckets_text(buckets: tuple[tuple[int, int], ...]) -> str:
    return ", ".join(f"{lo}-{hi}" for lo, hi in buckets)


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
            f"(e.g. {_buckets_text(DEFAULT_BUCKETS)}), got {text!r}"
        )
    return buckets


def _parse_weights(ctx: click.Context, param: click.Parameter, text: str) -> tuple[float, ...]:
    buckets = ctx.params.get("buckets", DEFAULT_BUCKETS)
    expected = (
        f"{len(buckets)} comma-separated numbers >= 0, not all 0, one per bucket "
        f"({_buckets_text(buckets)})"
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
    default=_buckets_text(DEFAULT_BUCKETS).replace(" ", ""),
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
