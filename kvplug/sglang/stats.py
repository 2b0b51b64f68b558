"""kvplug's counters inside SGLang, and how they reach SGLang's ``/metrics``.

The cache (`kvplug.sglang.backend.KVPlugRadixCache`) counts into a `CacheStats`, the
engine-neutral `kvplug.engine_stats.PoolStats`, so the names are the vLLM adapter's.
SGLang runs its scheduler in its own process and serves ``/metrics`` from another,
aggregating metrics through prometheus_client's multiprocess directory; so when SGLang's
metrics are on (``--enable-metrics``), `PrometheusExporter` creates ``kvplug_<field>``
counters and gauges in the scheduler process (after SGLang has named that directory)
and `PrometheusExporter.publish` moves them to the current counts.
"""

from __future__ import annotations

from typing import Any

from kvplug.engine_stats import GAUGES, HELP, PoolStats

CacheStats = PoolStats


class PrometheusExporter:
    """``kvplug_*`` metrics in the scheduler process, labelled by engine (the TP rank)
    and policy; counters advance by the change since the last `publish`."""

    def __init__(self, engine: str, policy: str) -> None:
        from prometheus_client import Counter, Gauge

        self.labels = {"engine": engine, "policy": policy}
        self._metrics: dict[str, Any] = {}
        for field, text in HELP.items():
            if field in GAUGES:
                metric = Gauge(
                    f"kvplug_{field}", text, list(self.labels), multiprocess_mode="mostrecent"
                )
            else:
                metric = Counter(f"kvplug_{field}", text, list(self.labels))
            self._metrics[field] = metric.labels(**self.labels)
        self._published = PoolStats()

    def publish(self, stats: PoolStats) -> None:
        last = self._published
        for field, metric in self._metrics.items():
            value = getattr(stats, field)
            if field in GAUGES:
                metric.set(value)
            elif value > getattr(last, field):
                metric.inc(value - getattr(last, field))
            setattr(last, field, value)
