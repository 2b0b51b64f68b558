"""The Prometheus text a server returns on ``GET /metrics``, summed over label sets.

vLLM names its prefix-cache counters ``vllm:prefix_cache_queries`` and
``vllm:prefix_cache_hits`` (in tokens); SGLang counts ``sglang:prompt_tokens`` and
``sglang:cached_tokens`` per finished request. The text format adds ``_total`` to
counters. kvplug exports its own families named ``kvplug_*`` or ``kvplug:*``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

PREFIX_CACHE_QUERIES = "vllm:prefix_cache_queries"
PREFIX_CACHE_HITS = "vllm:prefix_cache_hits"
PREEMPTIONS = "vllm:num_preemptions"
KVPLUG_PREFIXES = ("kvplug_", "kvplug:")
_SUFFIXES = ("_total", "_bucket", "_sum", "_count", "_created")
_CUMULATIVE = {"counter", "histogram", "summary"}


@dataclass(frozen=True)
class PrefixCounters:
    """An engine's counter names: prompt tokens looked up in its prefix cache, the tokens
    found there, and requests preempted (vLLM) or retracted (SGLang)."""

    queries: str
    hits: str
    preemptions: str


VLLM_COUNTERS = PrefixCounters(PREFIX_CACHE_QUERIES, PREFIX_CACHE_HITS, PREEMPTIONS)
SGLANG_COUNTERS = PrefixCounters(
    "sglang:prompt_tokens", "sglang:cached_tokens", "sglang:num_retracted_requests"
)


@dataclass
class Metrics:
    """Sample name -> value summed over its label sets, and family name -> type."""

    values: dict[str, float] = field(default_factory=dict)
    types: dict[str, str] = field(default_factory=dict)

    def family(self, sample: str) -> str:
        if sample in self.types:
            return sample
        for suffix in _SUFFIXES:
            if sample.endswith(suffix) and sample.removesuffix(suffix) in self.types:
                return sample.removesuffix(suffix)
        return sample

    def get(self, name: str) -> float | None:
        """A counter by its family name (``_total`` added if needed), or any sample."""
        for sample in (name + "_total", name):
            if sample in self.values:
                return self.values[sample]
        return None

    def since(self, before: Metrics) -> Metrics:
        """Counters, histograms and summaries as increments since `before`; gauges as now.
        ``_created`` timestamps are dropped."""
        values = {}
        for sample, value in self.values.items():
            if sample.endswith("_created"):
                continue
            if self.types.get(self.family(sample)) in _CUMULATIVE:
                value -= before.values.get(sample, 0.0)
            values[sample] = value
        return Metrics(values, dict(self.types))

    def kvplug(self) -> dict[str, float]:
        """kvplug's own samples (no histogram buckets, no ``_created``), sorted by name."""
        return {
            name: value
            for name, value in sorted(self.values.items())
            if name.startswith(KVPLUG_PREFIXES) and not name.endswith(("_bucket", "_created"))
        }


def sum_metrics(parts: list[Metrics]) -> Metrics:
    """Several servers' samples as one fleet's: each sample summed over the servers."""
    total = Metrics()
    for part in parts:
        total.types.update(part.types)
        for name, value in part.values.items():
            total.values[name] = total.values.get(name, 0.0) + value
    return total


def parse_metrics(text: str) -> Metrics:
    """Parse the Prometheus text exposition format; malformed lines are skipped."""
    metrics = Metrics()
    for raw in text.splitlines():
        line = raw.strip()
        if not line:
            continue
        if line.startswith("#"):
            parts = line.split()
            if len(parts) >= 4 and parts[1] == "TYPE":
                metrics.types[parts[2]] = parts[3]
            continue
        name, value = _sample(line)
        if name is None:
            continue
        metrics.values[name] = metrics.values.get(name, 0.0) + value
    return metrics


def _sample(line: str) -> tuple[str | None, float]:
    """``name{labels} value [timestamp]`` -> (name, value); (None, 0) if malformed."""
    if "{" in line:
        name, _, rest = line.partition("{")
        # label values may hold spaces or braces inside quotes: find the closing brace
        end, quoted, escaped = -1, False, False
        for i, ch in enumerate(rest):
            if escaped:
                escaped = False
            elif ch == "\\":
                escaped = True
            elif ch == '"':
                quoted = not quoted
            elif ch == "}" and not quoted:
                end = i
                break
        if end < 0:
            return None, 0.0
        fields = rest[end + 1 :].split()
    else:
        name, *fields = line.split()
    try:
        value = float(fields[0])
    except (IndexError, ValueError):
        return None, 0.0
    if not name or math.isnan(value):
        return None, 0.0
    return name.strip(), value
