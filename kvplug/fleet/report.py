"""Fleet results as a table, JSON or CSV.

The table has one line per fleet capacity x engine count x router x policy. ``vs rr/lru``
is the row's saved compute minus round-robin with ``lru`` at the same capacity and engine
count, in points; per-engine columns list each engine's saved compute in percent.

Run under several timings, the table is the spread instead: per capacity x engine count x
router x policy, saved compute's median and range over the timings, and, against `lru`
under the same router, capacity, engine count and timing, the median difference, in how
many timings the policy was ahead, and a one-sided sign test's p (ties left out).
"""

from __future__ import annotations

import csv
import io
import json
from collections import defaultdict
from math import comb
from statistics import median

from kvplug.fleet.runner import FleetRow

BASELINE = ("round-robin", "lru")  # what the table's ``vs rr/lru`` column compares with


def render(rows: list[FleetRow], fmt: str) -> str:
    if fmt == "json":
        return json.dumps([r.as_dict() for r in rows], indent=2)
    if fmt == "csv":
        out = io.StringIO()
        flat = [_flat(r) for r in rows]
        writer = csv.DictWriter(out, fieldnames=list(flat[0]))
        writer.writeheader()
        writer.writerows(flat)
        return out.getvalue()
    timings = {(r.prefill_tps, r.decode_tps) for r in rows}
    return table(rows) if len(timings) == 1 else spread_table(rows)


def _flat(row: FleetRow) -> dict:
    """A CSV record: the per-engine figures as slash-separated lists."""
    record = row.as_dict()
    engines = record.pop("per_engine")
    for name in ("routed", "hit_ratio", "saved_compute_ratio"):
        record[f"engine_{name}"] = "/".join(f"{engine[name]:.6g}" for engine in engines)
    return record


def table(rows: list[FleetRow]) -> str:
    baseline = {(r.capacity_blocks, r.engines): r for r in rows if (r.router, r.policy) == BASELINE}
    header = (
        f"{'capacity':>8} {'N':>2} {'router':<12} {'policy':<6} {'hit ratio':>9} "
        f"{'saved':>7} {'vs rr/lru':>9} {'imbalance':>9} {'stale':>6} {'mispred':>7} "
        f"{'preempt':>7}  per-engine saved %"
    )
    lines = []
    for r in rows:
        group = (r.capacity_blocks, r.engines)
        base = baseline.get(group)
        versus = (
            f"{100 * (r.saved_compute_ratio - base.saved_compute_ratio):>+8.2f}p"
            if base
            else f"{'-':>9}"
        )
        per_engine = "/".join(f"{100 * e.saved_compute_ratio:.1f}" for e in r.per_engine)
        line = (
            f"{r.capacity_blocks:>8} {r.engines:>2} {r.router:<12} {r.policy:<6} "
            f"{r.hit_ratio:>9.4f} {100 * r.saved_compute_ratio:>6.2f}% {versus} "
            f"{r.load_imbalance:>8.3f}x {r.stale_ratio:>6.3f} {r.mispredicted_ratio:>7.3f} "
            f"{r.preemptions:>7}  {per_engine}"
        )
        lines.append((group, line))
    return _layout(header, lines)


def sign_test(ahead: int, behind: int) -> float:
    """One-sided sign test: the chance of `ahead` or more wins in `ahead + behind` fair
    coin flips (1.0 when there are none)."""
    n = ahead + behind
    return sum(comb(n, k) for k in range(ahead, n + 1)) / 2**n if n else 1.0


def spread_table(rows: list[FleetRow]) -> str:
    """The spread over timings (module doc): one line per cell and policy."""
    # (capacity, engines, router, policy) -> (prefill tps, decode tps) -> saved compute, %
    saved: dict[tuple, dict[tuple[float, float], float]] = defaultdict(dict)
    for r in rows:
        cell = (r.capacity_blocks, r.engines, r.router, r.policy)
        saved[cell][(r.prefill_tps, r.decode_tps)] = 100 * r.saved_compute_ratio
    header = (
        f"{'capacity':>8} {'N':>2} {'router':<12} {'policy':<7} {'runs':>4} "
        f"{'saved: median [range] %':<24} {'vs lru: median [range] pt':<26} {'ahead':>7} "
        f"{'sign p':>7}"
    )
    lines = []
    for cell, by_timing in saved.items():
        capacity, engines, router, policy = cell
        values = list(by_timing.values())
        spread = f"{median(values):.2f} [{min(values):.2f}-{max(values):.2f}]"
        line = f"{capacity:>8} {engines:>2} {router:<12} {policy:<7} {len(values):>4} {spread:<24}"
        lru = saved.get((capacity, engines, router, "lru"), {})
        diffs = [value - lru[timing] for timing, value in by_timing.items() if timing in lru]
        if policy != "lru" and diffs:
            ahead, behind = sum(d > 0 for d in diffs), sum(d < 0 for d in diffs)
            versus = f"{median(diffs):+.2f} [{min(diffs):+.2f}..{max(diffs):+.2f}]"
            line += f" {versus:<26} {f'{ahead}/{len(diffs)}':>7} {sign_test(ahead, behind):>7.3f}"
        lines.append(((capacity, engines), line.rstrip()))
    return _layout(header, lines)


def _layout(header: str, lines: list[tuple[tuple[int, int], str]]) -> str:
    """`header`, a rule, then the lines, a blank line between (capacity, engines) groups."""
    out = [header, "-" * len(header)]
    for i, (group, line) in enumerate(lines):
        if i and group != lines[i - 1][0]:
            out.append("")
        out.append(line)
    return "\n".join(out)
