"""Percentiles, and one arm's summary: latency, throughput, cached tokens, saved compute."""

from __future__ import annotations

import math
import statistics
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field, fields

from kvplug.core.model_spec import ModelSpec
from kvplug.serving.client import RequestResult
from kvplug.serving.metrics import VLLM_COUNTERS, Metrics, PrefixCounters


def percentile(values: Sequence[float], q: float) -> float:
    """The `q`-th percentile (0-100), interpolating linearly between the closest ranks
    (numpy's default); NaN for no values."""
    if not 0 <= q <= 100:
        raise ValueError(f"percentile {q} is not in [0, 100]")
    if not values:
        return math.nan
    ordered = sorted(values)
    rank = q / 100 * (len(ordered) - 1)
    low = math.floor(rank)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (rank - low)


def ratio(part: float, whole: float) -> float:
    return part / whole if whole else 0.0


@dataclass
class ArmSummary:
    """One arm of the A/B. Ratios are fractions in [0, 1]; `available` is False when the
    arm could not run, with the reason in `note`."""

    arm: str
    available: bool = True
    note: str = ""
    requests: int = 0
    succeeded: int = 0
    failed: int = 0
    duration_s: float = 0.0
    ttft_p50_ms: float = math.nan
    ttft_p99_ms: float = math.nan
    request_throughput: float = 0.0  # succeeded requests per second
    output_throughput: float = 0.0  # completion tokens per second
    prompt_tokens: int = 0
    cached_tokens: int = 0
    completion_tokens: int = 0
    cached_token_ratio: float = 0.0
    prefill_compute_saved: float = 0.0  # cached-prefix prefill FLOPs / all prompt FLOPs
    mean_request_compute_saved: float = 0.0  # the same ratio per request, averaged
    server_prefix_cache_queries: float | None = None
    server_prefix_cache_hits: float | None = None
    server_preemptions: float | None = None
    kvplug_metrics: dict[str, float] = field(default_factory=dict)
    # a fleet: each server's prefix lookups and hits (tokens), in order, and the router's
    # own per-worker counters (`kvplug.serving.routers.router_view`)
    server_queries: list[float] = field(default_factory=list)
    server_hits: list[float] = field(default_factory=list)
    router_view: dict[str, float] = field(default_factory=dict)
    startup_s: float = 0.0
    errors: list[str] = field(default_factory=list)  # the first few distinct ones
    log_path: str = ""
    server_args: list[str] = field(default_factory=list)
    runs: list[ArmSummary] = field(default_factory=list)  # each run's, when repeated
    # the requests with the longest TTFT, slowest first (what the p99 is made of): when
    # each was sent (seconds after the first), its TTFT, prompt and cached tokens
    slowest: list[dict[str, float]] = field(default_factory=list)

    @property
    def server_prefix_hit_ratio(self) -> float | None:
        if self.server_prefix_cache_queries is None or self.server_prefix_cache_hits is None:
            return None
        return ratio(self.server_prefix_cache_hits, self.server_prefix_cache_queries)

    def as_dict(self) -> dict:
        out = asdict(self)
        out["server_prefix_hit_ratio"] = self.server_prefix_hit_ratio
        out["runs"] = [run.as_dict() for run in self.runs]
        return out


def request_compute_saved(spec: ModelSpec, prompt_tokens: int, cached_tokens: int) -> float:
    """Prefill FLOPs of the cached prefix over the prefill FLOPs of the whole prompt."""
    cached = min(cached_tokens, prompt_tokens)
    return ratio(spec.prefill_flops(0, cached), spec.prefill_flops(0, prompt_tokens))


def summarize(
    arm: str,
    results: Sequence[RequestResult],
    wall_s: float,
    spec: ModelSpec,
    metrics: Metrics | None = None,
    counters: PrefixCounters = VLLM_COUNTERS,
) -> ArmSummary:
    """An arm's summary from its request results, the run's wall time, and the server's
    metrics over the run (`Metrics.since` the start), read by the engine's `counters`."""
    ok = [r for r in results if r.ok]
    ttfts = [1000 * r.ttft_s for r in ok]
    prompt = sum(r.prompt_tokens for r in ok)
    cached = sum(r.cached_tokens for r in ok)
    completion = sum(r.completion_tokens for r in ok)
    total_flops = sum(spec.prefill_flops(0, r.prompt_tokens) for r in ok)
    saved_flops = sum(spec.prefill_flops(0, min(r.cached_tokens, r.prompt_tokens)) for r in ok)
    per_request = [request_compute_saved(spec, r.prompt_tokens, r.cached_tokens) for r in ok]
    summary = ArmSummary(
        arm=arm,
        requests=len(results),
        succeeded=len(ok),
        failed=len(results) - len(ok),
        duration_s=wall_s,
        ttft_p50_ms=percentile(ttfts, 50),
        ttft_p99_ms=percentile(ttfts, 99),
        request_throughput=ratio(len(ok), wall_s),
        output_throughput=ratio(completion, wall_s),
        prompt_tokens=prompt,
        cached_tokens=cached,
        completion_tokens=completion,
        cached_token_ratio=ratio(cached, prompt),
        prefill_compute_saved=ratio(saved_flops, total_flops),
        mean_request_compute_saved=ratio(sum(per_request), len(per_request)),
        errors=list(dict.fromkeys(r.error for r in results if r.error))[:5],
        slowest=slowest_requests(ok),
    )
    if metrics is not None:
        summary.server_prefix_cache_queries = metrics.get(counters.queries)
        summary.server_prefix_cache_hits = metrics.get(counters.hits)
        if summary.server_prefix_cache_hits is None and summary.server_prefix_cache_queries:
            summary.server_prefix_cache_hits = 0.0  # SGLang shows a counter once it moved
        summary.server_preemptions = metrics.get(counters.preemptions)
        summary.kvplug_metrics = metrics.kvplug()
    return summary


def slowest_requests(results: Sequence[RequestResult], count: int = 8) -> list[dict[str, float]]:
    """The `count` requests with the longest TTFT, slowest first: the requests a TTFT p99
    is made of, with when each was sent and how much of its prompt was cached."""
    if not results:
        return []
    first = min(r.sent_at for r in results)
    slow = sorted(results, key=lambda r: r.ttft_s, reverse=True)[:count]
    return [
        {
            "conversation": r.conversation,
            "turn": r.turn,
            "sent_s": round(r.sent_at - first, 3),
            "ttft_ms": round(1000 * r.ttft_s, 1),
            "prompt_tokens": r.prompt_tokens,
            "cached_tokens": r.cached_tokens,
        }
        for r in slow
    ]


# Fields `combine` takes the median of; the rest come from the first run that ran.
_MEDIAN_FIELDS = {
    f.name: int if f.type == "int" else float
    for f in fields(ArmSummary)
    if f.type in ("int", "float", "float | None")
}


def combine(runs: Sequence[ArmSummary]) -> ArmSummary:
    """One arm's repeated runs as one summary: the median of every number over the runs
    that ran (`runs` keeps each run, for the spread), kvplug's metrics likewise, errors
    and notes gathered. Unavailable only if no run ran."""
    if not runs:
        raise ValueError("no runs to combine")
    ran = [run for run in runs if run.available]
    failed = [run for run in runs if not run.available]
    notes = list(dict.fromkeys(run.note for run in failed if run.note))
    if not ran:
        out = ArmSummary(runs[0].arm, available=False, note="; ".join(notes))
        out.log_path = runs[0].log_path
        out.runs = list(runs)
        return out
    out = ArmSummary(ran[0].arm, log_path=ran[0].log_path, server_args=ran[0].server_args)
    for name, cast in _MEDIAN_FIELDS.items():
        values = [getattr(run, name) for run in ran if getattr(run, name) is not None]
        values = [v for v in values if not (isinstance(v, float) and math.isnan(v))]
        if values:
            setattr(out, name, cast(statistics.median(values)))
    keys = dict.fromkeys(key for run in ran for key in run.kvplug_metrics)
    out.kvplug_metrics = {
        key: statistics.median(run.kvplug_metrics[key] for run in ran if key in run.kvplug_metrics)
        for key in keys
    }
    for name in ("server_queries", "server_hits"):
        lists = [getattr(run, name) for run in ran if getattr(run, name)]
        if lists and len({len(values) for values in lists}) == 1:
            setattr(out, name, [statistics.median(column) for column in zip(*lists, strict=True)])
    views = dict.fromkeys(key for run in ran for key in run.router_view)
    out.router_view = {
        key: statistics.median(run.router_view[key] for run in ran if key in run.router_view)
        for key in views
    }
    out.errors = list(dict.fromkeys(e for run in ran for e in run.errors))[:5]
    if failed:
        out.note = f"{len(failed)} of {len(runs)} runs failed: " + "; ".join(notes)
    out.runs = list(runs)
    return out


def spread(arm: ArmSummary, value: Callable[[ArmSummary], float | None]) -> tuple[float, float]:
    """The smallest and largest of `value` over the runs of `arm` that ran (NaN, NaN if
    none has a value)."""
    values = [value(run) for run in arm.runs if run.available]
    values = [v for v in values if v is not None and not math.isnan(v)]
    return (min(values), max(values)) if values else (math.nan, math.nan)
