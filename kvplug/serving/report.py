"""The server A/B side by side: a table (one row per metric, one column per arm), JSON,
CSV (one row per arm), and a bar chart per metric. With repeated runs each figure is the
median over the runs, followed by ``[min-max]`` in the table and an error bar in the plot."""

from __future__ import annotations

import csv
import io
import json
import math
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from kvplug.serving.ab import ABResult
from kvplug.serving.stats import ArmSummary, spread

FORMATS = ("table", "json", "csv")


@dataclass(frozen=True)
class Row:
    label: str
    value: Callable[[ArmSummary], float | None]
    fmt: str  # format spec for the value
    higher_is_better: bool | None = None  # None: no comparison column entry
    plotted: bool = False


ROWS = (
    Row("requests sent", lambda a: a.requests, "d"),
    Row("requests failed", lambda a: a.failed, "d"),
    Row("TTFT p50 (ms)", lambda a: a.ttft_p50_ms, ".1f", False, True),
    Row("TTFT p99 (ms)", lambda a: a.ttft_p99_ms, ".1f", False, True),
    Row("requests/s", lambda a: a.request_throughput, ".2f", True, True),
    Row("output tokens/s", lambda a: a.output_throughput, ".1f", True, True),
    Row("prompt tokens", lambda a: a.prompt_tokens, ",d"),
    Row("cached tokens", lambda a: a.cached_tokens, ",d"),
    Row("cached-token ratio", lambda a: a.cached_token_ratio, ".4f", True, True),
    Row("prefill compute saved", lambda a: a.prefill_compute_saved, ".4f", True, True),
    Row("  per request, mean", lambda a: a.mean_request_compute_saved, ".4f", True),
    Row("server prefix queries", lambda a: a.server_prefix_cache_queries, ",.0f"),
    Row("server prefix hits", lambda a: a.server_prefix_cache_hits, ",.0f"),
    Row("server prefix hit ratio", lambda a: a.server_prefix_hit_ratio, ".4f", True),
    Row("preemptions", lambda a: a.server_preemptions, ",.0f"),
    Row("run time (s)", lambda a: a.duration_s, ".1f"),
    Row("server start-up (s)", lambda a: a.startup_s, ".1f"),
)


def fleet_rows(servers: int) -> tuple[Row, ...]:
    """A fleet's per-server rows: each server's prefix hits (tokens) and hit ratio."""
    if servers < 2:
        return ()
    rows: list[Row] = []
    for i in range(servers):
        rows.append(Row(f"server {i + 1} prefix hits", _server_hits(i), ",.0f"))
        rows.append(Row(f"server {i + 1} hit ratio", _server_ratio(i), ".4f", True))
    return tuple(rows)


def _server_hits(i: int) -> Callable[[ArmSummary], float | None]:
    return lambda a: a.server_hits[i] if i < len(a.server_hits) else None


def _server_ratio(i: int) -> Callable[[ArmSummary], float | None]:
    def value(a: ArmSummary) -> float | None:
        if i >= len(a.server_hits) or not a.server_queries[i]:
            return None
        return a.server_hits[i] / a.server_queries[i]

    return value


def _format(row: Row, value: float | None) -> str:
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return "-"
    if row.fmt.endswith("d"):
        value = int(value)
    return format(value, row.fmt)


def _cell(row: Row, arm: ArmSummary) -> str:
    """The arm's figure; with repeated runs, the median then ``[min-max]`` when they differ."""
    if not arm.available:
        return "unavailable"
    text = _format(row, row.value(arm))
    if len(arm.runs) > 1:
        low, high = (_format(row, v) for v in spread(arm, row.value))
        if low != high:
            text += f" [{low}-{high}]"
    return text


def _change(row: Row, base: ArmSummary, other: ArmSummary) -> str:
    """`other` relative to `base`: a ratio for times and rates, points for fractions."""
    if row.higher_is_better is None or not (base.available and other.available):
        return ""
    a, b = row.value(base), row.value(other)
    if a is None or b is None or math.isnan(a) or math.isnan(b):
        return ""
    if row.fmt == ".4f":  # a fraction: the difference in percentage points
        return f"{100 * (b - a):+.2f} pt"
    return f"{b / a:.3f}x" if a else ""


def table(result: ABResult) -> str:
    """A header naming the run, then one row per metric with one column per arm (and the
    second arm against the first when both ran), then kvplug's own metrics if any."""
    config = result.config
    arms = result.arms
    lines = [
        f"{result.workload}; model {config.model}; {_budget(result)}; max-model-len "
        f"{result.max_model_len}; concurrency {config.concurrency}; cost model "
        f"{result.cost_model.name}",
        "",
    ]
    if config.repeat > 1:
        lines[-1:] = [
            f"each arm run {config.repeat} times, interleaved: median [min-max] over the runs",
            "",
        ]
    compare = len(arms) >= 2 and arms[0].available and arms[1].available
    rows = ROWS + fleet_rows(max((len(a.server_hits) for a in arms), default=0))
    cells = [_cell(row, a) for row in rows for a in arms]
    width = max(14, *(len(a.arm) for a in arms), *(len(c) for c in cells))
    header = f"{'metric':<24}" + "".join(f" {a.arm:>{width}}" for a in arms)
    if compare:
        header += f" {arms[1].arm + ' vs ' + arms[0].arm:>18}"
    lines += [header, "-" * len(header)]
    for row in rows:
        line = f"{row.label:<24}" + "".join(f" {_cell(row, a):>{width}}" for a in arms)
        if compare:
            line += f" {_change(row, arms[0], arms[1]):>18}"
        lines.append(line.rstrip())
    notes = [f"  {a.arm}: {a.note}" for a in arms if a.note]
    notes += [f"  {a.arm}: errors: {'; '.join(a.errors)}" for a in arms if a.errors]
    if notes:
        lines += ["", "notes:", *notes]
    view = sorted({name for a in arms for name in a.router_view})
    if view:
        lines += ["", f"the router's own counters ({config.router}, {config.router_policy}):"]
        for name in view:
            cells = "".join(f" {_number(a.router_view.get(name)):>{width}}" for a in arms)
            lines.append(f"  {name}\n  {'':<40}{cells}")
    kvplug = sorted({name for a in arms for name in a.kvplug_metrics})
    if kvplug:
        lines += ["", "kvplug metrics (counters over the run):"]
        for name in kvplug:
            cells = "".join(f" {_number(a.kvplug_metrics.get(name)):>{width}}" for a in arms)
            lines.append(f"  {name:<40}{cells}")
    return "\n".join(lines)


def _budget(result: ABResult) -> str:
    """The KV budget each server got, in its engine's terms."""
    config = result.config
    if config.engine == "sglang":
        return f"{config.num_blocks * config.block_size} KV tokens (--max-total-tokens)"
    return f"{config.num_blocks} KV blocks of {config.block_size} tokens"


def _number(value: float | None) -> str:
    if value is None:
        return "-"
    return f"{value:,.0f}" if float(value).is_integer() else f"{value:,.4g}"


def render(result: ABResult, fmt: str) -> str:
    if fmt == "json":
        return json.dumps(result.as_dict(), indent=2)
    if fmt == "csv":
        rows = [arm.as_dict() for arm in result.arms]
        for row in rows:
            row["kvplug_metrics"] = json.dumps(row["kvplug_metrics"])
            row["errors"] = "; ".join(row["errors"])
            row["server_args"] = " ".join(row["server_args"])
            for name in ("server_queries", "server_hits", "router_view"):
                row[name] = json.dumps(row[name])
        out = io.StringIO()
        writer = csv.DictWriter(out, fieldnames=list(rows[0]))
        writer.writeheader()
        writer.writerows(rows)
        return out.getvalue()
    return table(result)


def plot(result: ABResult, path: str | Path) -> Path:
    """One bar chart per plotted metric, a bar per arm (matplotlib, no display)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = [row for row in ROWS if row.plotted]
    arms = [a for a in result.arms if a.available]
    columns = 3
    fig, axes = plt.subplots(
        math.ceil(len(rows) / columns), columns, figsize=(4 * columns, 3.2 * 2)
    )
    colors = ["#7f7f7f", "#1f77b4", "#ff7f0e", "#2ca02c"]
    for ax, row in zip(axes.flat, rows, strict=False):
        values = [row.value(a) for a in arms]
        values = [0.0 if v is None or math.isnan(v) else float(v) for v in values]
        errors = None
        if any(len(a.runs) > 1 for a in arms):  # median with a min-max bar
            ranges = [spread(a, row.value) for a in arms]
            errors = [
                [
                    0.0 if math.isnan(low) else max(0.0, v - low)
                    for v, (low, _) in zip(values, ranges, strict=True)
                ],
                [
                    0.0 if math.isnan(high) else max(0.0, high - v)
                    for v, (_, high) in zip(values, ranges, strict=True)
                ],
            ]
        bars = ax.bar([a.arm for a in arms], values, color=colors[: len(arms)], yerr=errors,
                      capsize=4)  # fmt: skip
        ax.bar_label(bars, fmt="%.3g", fontsize=8)
        better = {True: "higher", False: "lower"}[row.higher_is_better]
        ax.set_title(f"{row.label} ({better} is better)", fontsize=9)
        ax.grid(True, axis="y", alpha=0.3)
        ax.margins(y=0.15)
    for ax in list(axes.flat)[len(rows) :]:
        ax.axis("off")
    runs = f" | median of {result.config.repeat} runs" if result.config.repeat > 1 else ""
    fig.suptitle(f"{result.workload} | {_budget(result)}{runs}", fontsize=10)
    fig.tight_layout()
    path = Path(path)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
