"""The sweep's output: the table, JSON, CSV and the two plots (matplotlib, no display)."""

from __future__ import annotations

import csv
import io
import json
from dataclasses import asdict
from typing import Any

from kvplug.errors import KVPlugError
from kvplug.tools.sweep.config import GIB, buckets_text
from kvplug.tools.sweep.run import SweepResult

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
        f"{buckets_text(cfg.buckets)} weighted {', '.join(f'{w:g}' for w in cfg.weights)} "
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
