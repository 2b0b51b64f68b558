"""What kvplug counts inside vLLM, and how it reaches vLLM's ``/metrics`` endpoint.

The scheduler (in vLLM's engine-core process) owns a `PoolStats`. `SnapshotWriter`
writes it as JSON, at most a few times a second, into a folder that the API server
process named in ``$KVPLUG_METRICS_DIR`` (kvplug's ``vllm.general_plugins`` entry point
does this before the engine core is started, so the engine core inherits it) and where
that process's `KVPlugCollector` reads it at each scrape, exposing ``kvplug_*``
Prometheus metrics next to vLLM's own.

With several API servers (``--api-server-count > 1``, which ``vllm serve`` also picks
by default for ``--data-parallel-size > 1``) vLLM runs Prometheus in multiprocess mode:
it names ``$PROMETHEUS_MULTIPROC_DIR`` before starting any process, and every API
server's ``/metrics`` shows only the per-process files there, never a registered
collector. There the engine core also writes its stats into that folder
(`MultiprocessMirror`), so every API server reports the same ``kvplug_*`` series, one
``engine`` label per data-parallel rank. Exactly one path is visible in each mode.
The counters themselves (`PoolStats`, their names and help texts) are
engine-neutral and live in `kvplug.engine_stats`.
"""

from __future__ import annotations

import atexit
import json
import os
import shutil
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from kvplug.engine_stats import GAUGES, HELP, TENANT_GAUGES, PoolStats

METRICS_DIR_ENV = "KVPLUG_METRICS_DIR"
PROMETHEUS_MULTIPROC_ENV = "PROMETHEUS_MULTIPROC_DIR"  # set by vLLM for several API servers

__all__ = ["GAUGES", "HELP", "PoolStats"]


def claim_metrics_dir() -> Path:
    """Name this process's snapshot folder in the environment its children inherit
    (unless a parent already did) and return it. A folder made here is new (never a dead
    server's) and is removed when this process exits."""
    if not os.environ.get(METRICS_DIR_ENV):
        path = tempfile.mkdtemp(prefix="kvplug-metrics-")
        atexit.register(shutil.rmtree, path, ignore_errors=True)
        os.environ[METRICS_DIR_ENV] = path
    return Path(os.environ[METRICS_DIR_ENV])


class MultiprocessMirror:
    """`PoolStats` as prometheus_client metrics in vLLM's multiprocess folder.

    Only for a process started with ``$PROMETHEUS_MULTIPROC_DIR`` set (prometheus_client
    picks its file-backed values when it is imported). The metrics live in a private
    registry, so this process exposes nothing itself; the API servers'
    ``MultiProcessCollector`` reads the files. Invariant: after `write`, each series equals
    the snapshot's field (counters are advanced by the difference, and `PoolStats`
    counters never decrease; gauges keep the most recent value).
    """

    def __init__(self, engine: str) -> None:
        from prometheus_client import CollectorRegistry, Counter, Gauge

        self.engine = engine
        registry = CollectorRegistry()  # never exposed by this process
        labels = ("engine", "policy")
        self._metrics: dict[str, Any] = {}
        for name, text in HELP.items():
            if name in GAUGES:
                metric = Gauge(
                    f"kvplug_{name}", text, labels, registry=registry,
                    multiprocess_mode="mostrecent",
                )  # fmt: skip
            else:
                metric = Counter(f"kvplug_{name}", text, labels, registry=registry)
            self._metrics[name] = metric
        for name, text in TENANT_GAUGES.items():
            self._metrics[name] = Gauge(
                f"kvplug_{name}", text, (*labels, "tenant"), registry=registry,
                multiprocess_mode="mostrecent",
            )  # fmt: skip
        self._written: dict[str, float] = {}  # counter name -> value already in the files
        self._tenants: dict[str, set[str]] = {name: set() for name in TENANT_GAUGES}

    def write(self, stats: PoolStats, policy: str) -> None:
        for name, values in stats.as_dict().items():
            if name not in TENANT_GAUGES:
                continue
            gone = self._tenants[name] - values.keys()  # a tenant with nothing kept: 0
            for tenant, value in [*values.items(), *((t, 0) for t in gone)]:
                self._metrics[name].labels(self.engine, policy, tenant).set(value)
            self._tenants[name] |= values.keys()
        for name, value in stats.as_dict().items():
            if name in TENANT_GAUGES:
                continue
            series = self._metrics[name].labels(self.engine, policy)
            if name in GAUGES:
                series.set(value)
            else:
                series.inc(max(0.0, value - self._written.get(name, 0.0)))
                self._written[name] = max(value, self._written.get(name, 0.0))


class SnapshotWriter:
    """Writes `PoolStats` snapshots into the folder named by ``$KVPLUG_METRICS_DIR``, and
    into vLLM's multiprocess Prometheus folder when there is one."""

    def __init__(self, engine: str, interval_s: float = 0.25) -> None:
        self.path = Path(os.environ[METRICS_DIR_ENV]) / f"engine-{engine}.json"
        self.interval_s = interval_s
        self._last = 0.0
        self.mirror = (
            MultiprocessMirror(engine) if os.environ.get(PROMETHEUS_MULTIPROC_ENV) else None
        )

    def due(self, force: bool = False) -> bool:
        """Whether to write now: `force`, or `interval_s` since the last write."""
        return force or time.monotonic() - self._last >= self.interval_s

    def write(self, stats: PoolStats, policy: str) -> None:
        self._last = time.monotonic()
        self.path.parent.mkdir(parents=True, exist_ok=True)
        tmp = self.path.with_suffix(".tmp")
        tmp.write_text(json.dumps({"policy": policy, **stats.as_dict()}))
        tmp.replace(self.path)  # atomic: a scrape never sees half a file
        if self.mirror is not None:
            self.mirror.write(stats, policy)


def read_snapshots(directory: Path) -> Iterator[tuple[str, dict[str, Any]]]:
    """(engine, snapshot) for each engine that has written one."""
    if not directory.is_dir():
        return
    for path in sorted(directory.glob("engine-*.json")):
        try:
            data = json.loads(path.read_text())
        except (OSError, json.JSONDecodeError):
            continue  # being replaced right now; the next scrape reads it
        yield path.stem.removeprefix("engine-"), data


class KVPlugCollector:
    """A prometheus_client collector over the snapshots in `directory`. It yields nothing
    until a kvplug scheduler has written one, so without kvplug enabled ``/metrics`` is
    unchanged."""

    def __init__(self, directory: Path) -> None:
        self.directory = directory

    def collect(self) -> Iterator[Any]:
        from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

        snapshots = list(read_snapshots(self.directory))
        if not snapshots:
            return
        labels = ["engine", "policy"]
        for field, text in HELP.items():
            family_cls = GaugeMetricFamily if field in GAUGES else CounterMetricFamily
            family = family_cls(f"kvplug_{field}", text, labels=labels)
            for engine, data in snapshots:
                family.add_metric([engine, data["policy"]], data[field])
            yield family
        for field, text in TENANT_GAUGES.items():
            family = GaugeMetricFamily(f"kvplug_{field}", text, labels=[*labels, "tenant"])
            for engine, data in snapshots:
                for tenant, value in data.get(field, {}).items():
                    family.add_metric([engine, data["policy"], tenant], value)
            yield family
