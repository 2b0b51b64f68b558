"""Replay results as a table, JSON or CSV, and a plot of saved compute against capacity:
absolute, and each arm relative to the stock arm (`vllm-stock`, else `lru`)."""

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
    lru = {
        r.capacity_blocks: r
        for r in rows
        if r.policy.partition("+queue")[0] == "lru" and r.available
    }
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


BASELINE_ARMS = ("vllm-stock", "lru")  # what the relative panel divides by: the first present
_MARKERS = "os^Dv<>PX*"


def baseline_arm(rows: list[ReplayRow]) -> str | None:
    """The arm the others are compared with: vLLM's own cache if it ran, else kvplug's lru."""
    present = {r.policy for r in rows if r.available}
    return next((arm for arm in BASELINE_ARMS if arm in present), None)


def relative_to(rows: list[ReplayRow], arm: str, baseline: str) -> list[tuple[int, float]]:
    """(capacity, `arm`'s saved compute / `baseline`'s) at each capacity both ran with some
    saving."""
    base = {
        r.capacity_blocks: r.saved_compute_ratio
        for r in rows
        if r.policy == baseline and r.available and r.saved_compute_ratio
    }
    return sorted(
        (r.capacity_blocks, r.saved_compute_ratio / base[r.capacity_blocks])
        for r in rows
        if r.policy == arm and r.available and r.capacity_blocks in base
    )


def plot(rows: list[ReplayRow], path: str | Path, title: str) -> Path:
    """Saved prefill compute against capacity, one line per arm (matplotlib, no display).

    Left: the saved share of prefill compute. Right, when a baseline arm ran: each arm's
    saving divided by the baseline's at the same capacity, where arms that the left panel
    draws on top of each other come apart. The baseline is drawn as a wide pale band, so
    an arm that matches it exactly stays visible on top of it.
    """
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    arms = list(dict.fromkeys(r.policy for r in rows if r.available))
    baseline = baseline_arm(rows)
    panels = 2 if baseline else 1
    fig, axes = plt.subplots(1, panels, figsize=(6.5 * panels, 4.8), squeeze=False)
    absolute = axes[0][0]
    colors = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    for number, arm in enumerate(arms):
        style = {
            "color": colors[number % len(colors)],
            "marker": _MARKERS[number % len(_MARKERS)],
            "linestyle": "--" if arm == "belady" else "-",
            "linewidth": 2 if arm == "cost" else 1.2,
            "markersize": 5,
            "label": arm,
        }
        if arm == baseline:
            style.update(
                color="0.45", linewidth=7, alpha=0.35, marker=None, label=f"{arm} (baseline)"
            )
        points = sorted(
            (r.capacity_blocks, r.saved_compute_ratio)
            for r in rows
            if r.policy == arm and r.available
        )
        xs, ys = zip(*points, strict=True)
        absolute.plot(xs, [100 * y for y in ys], **style)
        if baseline and (relative := relative_to(rows, arm, baseline)):
            xs, ys = zip(*relative, strict=True)
            axes[0][1].plot(xs, ys, **style)
    absolute.set_ylabel("prefill compute saved (%)")
    absolute.set_title("saved compute")
    absolute.legend()
    if baseline:
        relative_axis = axes[0][1]
        relative_axis.set_ylabel(f"saved compute / {baseline}'s (x)")
        relative_axis.set_title(f"relative to {baseline} (above 1: saves more)")
    for axis in axes[0]:
        axis.set_xscale("log")
        axis.set_xlabel("cache capacity (blocks)")
        axis.grid(True, alpha=0.3)
    fig.suptitle(title)
    fig.tight_layout()
    path = Path(path)
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path
