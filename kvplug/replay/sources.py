"""What a replay runs on: a trace named on the command line, and cache sizes relative to it.

A source is a trace file (Mooncake or Bailian JSON lines), ``packaged:NAME`` for a trace
shipped in the package (`PACKAGED_TRACES`; their origin and licence are in
``kvplug/data/traces/README.md``), or ``synthetic:NAME[:SEED]`` for a seeded synthetic
workload.
"""

from __future__ import annotations

from importlib import resources
from pathlib import Path

from kvplug.errors import KVPlugError
from kvplug.replay.synthetic import synthetic_trace
from kvplug.replay.trace import Trace, read_trace

# name -> file under kvplug/data/traces
PACKAGED_TRACES = {"mooncake": "mooncake.jsonl", "synthetic-mixed": "synthetic-mixed.jsonl"}
DEFAULT_AB_TRACE = "packaged:mooncake"  # the A/B's default: real traffic, shipped with kvplug


def packaged_trace_path(name: str = "synthetic-mixed") -> Path:
    """The file of packaged trace `name`."""
    if name not in PACKAGED_TRACES:
        raise KVPlugError(
            f"unknown packaged trace {name!r}; packaged: {', '.join(PACKAGED_TRACES)}"
        )
    return Path(str(resources.files("kvplug") / "data" / "traces" / PACKAGED_TRACES[name]))


def bundled_trace_path() -> Path:
    """The small synthetic trace the tests and quick runs use."""
    return packaged_trace_path("synthetic-mixed")


def load_trace(source: str, fmt: str | None = None) -> Trace:
    """The trace `source` names (module docstring)."""
    if source.startswith("synthetic:"):
        name, _, seed = source.partition(":")[2].partition(":")
        if seed and not seed.isdigit():
            raise KVPlugError(f"synthetic seed must be an integer, got {seed!r} in {source!r}")
        return synthetic_trace(name, seed=int(seed or 0))
    if source.startswith("packaged:"):
        return read_trace(packaged_trace_path(source.partition(":")[2]), fmt)
    return read_trace(source, fmt)


def capacities_for(trace: Trace, fractions: list[float]) -> list[int]:
    """Cache sizes in blocks: each fraction of `trace`'s distinct blocks, at least one."""
    distinct = trace.distinct_blocks
    return [max(1, round(f * distinct)) for f in fractions]
