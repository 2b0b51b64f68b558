"""Fleet results as a table, JSON or CSV.

The table has one line per fleet capacity x engine count x router x policy. ``vs rr/lru``
is the row's saved compute minus round-robin with ``lru`` at the same capacity and engine
count, in points; per-engine columns list each engine's saved compute in percent.
"""

from __future__ import annotations

import csv
import io
import json

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
    return table(rows)


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
    lines = [header, "-" * len(header)]
    last_group = None
    for r in rows:
        group = (r.capacity_blocks, r.engines)
        if last_group is not None and group != last_group:
            lines.append("")
        last_group = group
        base = baseline.get(group)
        versus = (
            f"{100 * (r.saved_compute_ratio - base.saved_compute_ratio):>+8.2f}p"
            if base
            else f"{'-':>9}"
        )
        per_engine = "/".join(f"{100 * e.saved_compute_ratio:.1f}" for e in r.per_engine)
        lines.append(
            f"{r.capacity_blocks:>8} {r.engines:>2} {r.router:<12} {r.policy:<6} "
            f"{r.hit_ratio:>9.4f} {100 * r.saved_compute_ratio:>6.2f}% {versus} "
            f"{r.load_imbalance:>8.3f}x {r.stale_ratio:>6.3f} {r.mispredicted_ratio:>7.3f} "
            f"{r.preemptions:>7}  {per_engine}"
        )
    return "\n".join(lines)
