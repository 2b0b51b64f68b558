"""Replay results as a table, JSON or CSV, and a plot of saved compute against capacity."""

from __future__ import annotations

import csv
import io
import json
from pathlib import Path

from kvplug.replay.runner import ReplayRow

FORMATS = ("table", "json", "csv")


def render(rows: list[ReplayRow], fmt: str) -> str:
    if fmt == "json":
        return json.dumps([r.as_dict() for r in rows], indent=2)
    if fmt == "csv":
        out = io.StringIO()
        fields = [f for f in rows[0].as_dict() if f != "explain"]
        writer = csv.DictWriter(out, fieldnames=fields, extrasaction="ignore")
        writer.writeheader()
        writer.writerows(r.as_dict() for r in rows)
        return out.getvalue()
    return table(rows)


def explanations(rows: list[ReplayRow]) -> str:
    """Each arm's learned state (policies with `explain()`), one JSON line per run."""
    return "\n".join(
        json.dumps({"arm": r.policy, "capacity_blocks": r.capacity_blocks, **r.explain})
        for r in rows
        if r.explain is not None
    )


def table(rows: list[ReplayRow]) -> str:
    """One line per arm and capacity; `vs lru` is the arm's saved compute over lru's."""
    lru = {r.capacity_blocks: r for r in rows if r.policy == "lru" and r.available}
    header = (
        f"{'capacity':>9} {'arm':<18} {'hit ratio':>9} {'saved compute':>13} {'vs lru':>7} "
        f"{'evictions':>9} {'churn':>9} {'preempt':>7} {'GiB held':>8} {'time s':>6}"
    )
    lines = [header, "-" * len(header)]
    last_capacity = None
    for r in rows:
        if last_capacity is not None and r.capacity_blocks != last_capacity:
            lines.append("")
        last_capacity = r.capacity_blocks
        if not r.available:
            lines.append(f"{r.capacity_blocks:>9} {r.policy:<18} unavailable: {r.note}")
            continue
        base = lru.get(r.capacity_blocks)
        ratio = (
            f"{r.saved_compute_ratio / base.saved_compute_ratio:>6.3f}x"
            if base and base.saved_compute_ratio
            else f"{'-':>7}"
        )
        lines.append(
            f"{r.capacity_blocks:>9} {r.policy:<18} {r.hit_ratio:>9.4f} "
            f"{r.saved_compute_ratio:>13.4f} {ratio} {r.evictions:>9} {r.churn:>9} "
            f"{r.preemptions:>7} {r.bytes_held / 2**30:>8.1f} {r.seconds:>6.1f}"
        )
    return "\n".join(lines)


def plot(rows: list[ReplayRow], path: str | Path, title: str) -> Path:
    """Saved prefill compute against capacity, one line per arm (matplotlib, no display)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.5))
    for arm in dict.fromkeys(r.policy for r in rows if r.available):
        points = sorted((r.capacity_blocks, r.saved_compute_ratio) for r in rows if r.policy == arm)
        xs, ys = zip(*points, strict=True)
        style = "--" if arm == "belady" else ("-o" if arm == "cost" else "-")
        ax.plot(xs, [100 * y for y in ys], style, label=arm, linewidth=2 if arm == "cost" else 1)
    ax.set_xscale("log")
    ax.set_xlabel("cache capacity (blocks)")
    ax.set_ylabel("prefill compute saved (%)")
    ax.set_title(title)
    ax.grid(True, alpha=0.3)
    ax.legend()
    fig.tight_layout()
    path = Path(path)
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path
