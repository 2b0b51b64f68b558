"""kvplug's metrics with several vLLM API servers (``--api-server-count > 1``).

There vLLM sets ``$PROMETHEUS_MULTIPROC_DIR`` before it starts any process, and each API
server's ``/metrics`` is a fresh registry over `MultiProcessCollector` (the files in that
folder), not the global registry kvplug's collector sits in. These tests run each
"engine core" as its own process, as vLLM does, and read the folder the way every API
server does: each engine's stats appear under its own ``engine`` label, exact, and any
number of readers see the same values. Without the variable nothing is written there.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("prometheus_client", reason="prometheus_client comes with vLLM")

from prometheus_client import CollectorRegistry, generate_latest  # noqa: E402
from prometheus_client.multiprocess import MultiProcessCollector  # noqa: E402
from prometheus_client.parser import text_string_to_metric_families  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]

ENGINE_CORE = """
import json, sys
from kvplug.vllm.stats import PoolStats, SnapshotWriter
engine, snapshots = sys.argv[1], json.loads(sys.argv[2])
writer = SnapshotWriter(engine)
assert (writer.mirror is not None) == (sys.argv[3] == "mirrored")
for snapshot in snapshots:
    writer.write(PoolStats(**snapshot), "cost")
"""


def _engine_core(engine: str, snapshots: list[dict], env: dict[str, str], mirrored: bool) -> None:
    """One engine-core process writing `snapshots` in turn, as kvplug's scheduler does."""
    subprocess.run(
        [sys.executable, "-c", ENGINE_CORE, engine, json.dumps(snapshots),
         "mirrored" if mirrored else "plain"],
        env={**env, "PYTHONPATH": str(ROOT)},
        check=True,
        timeout=60,
    )  # fmt: skip


def _scrape(multiproc_dir: Path) -> dict[tuple[str, str], float]:
    """What an API server's /metrics shows in multiprocess mode: (sample, engine) -> value."""
    registry = CollectorRegistry()
    MultiProcessCollector(registry, path=str(multiproc_dir))
    text = generate_latest(registry).decode()
    return {
        (sample.name, sample.labels["engine"]): sample.value
        for family in text_string_to_metric_families(text)
        for sample in family.samples
        if sample.name.startswith("kvplug_")
    }


def _env(tmp_path: Path, multiproc: bool) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k != "PROMETHEUS_MULTIPROC_DIR"}
    env["KVPLUG_METRICS_DIR"] = str(tmp_path / "kvplug-metrics")
    if multiproc:
        (tmp_path / "prom").mkdir()
        env["PROMETHEUS_MULTIPROC_DIR"] = str(tmp_path / "prom")
    return env


def test_every_api_server_sees_each_engines_metrics(tmp_path):
    env = _env(tmp_path, multiproc=True)
    final = {}
    for rank, scale in (("0", 1), ("1", 10)):
        snapshots = [
            {"requests": 2 * scale, "prompt_tokens": 300 * scale, "cached_blocks": 7 * scale},
            {"requests": 5 * scale, "prompt_tokens": 900 * scale, "cached_blocks": 3 * scale,
             "saved_flops": 1.5e12 * scale},
        ]  # fmt: skip
        _engine_core(rank, snapshots, env, mirrored=True)
        final[rank] = snapshots[-1]
    first_server, second_server = _scrape(tmp_path / "prom"), _scrape(tmp_path / "prom")
    assert first_server == second_server
    for rank, snapshot in final.items():
        assert first_server[("kvplug_requests_total", rank)] == snapshot["requests"]
        assert first_server[("kvplug_prompt_tokens_total", rank)] == snapshot["prompt_tokens"]
        assert first_server[("kvplug_saved_flops_total", rank)] == snapshot["saved_flops"]
        assert first_server[("kvplug_cached_blocks", rank)] == snapshot["cached_blocks"]
        assert first_server[("kvplug_evictions_total", rank)] == 0
    # the single-server path is still written: one JSON snapshot per engine
    assert sorted(p.name for p in (tmp_path / "kvplug-metrics").iterdir()) == [
        "engine-0.json",
        "engine-1.json",
    ]


def test_without_multiprocess_mode_nothing_is_mirrored(tmp_path):
    env = _env(tmp_path, multiproc=False)
    _engine_core("0", [{"requests": 1}], env, mirrored=False)
    snapshot = json.loads((tmp_path / "kvplug-metrics" / "engine-0.json").read_text())
    assert snapshot["requests"] == 1 and snapshot["policy"] == "cost"


def _tenant_samples(text: str) -> dict[tuple[str, str], float]:
    return {
        (sample.labels["engine"], sample.labels["tenant"]): sample.value
        for family in text_string_to_metric_families(text)
        for sample in family.samples
        if sample.name == "kvplug_retained_bytes"
    }


@pytest.mark.parametrize("multiproc", [True, False])
def test_retained_bytes_are_shown_per_tenant_and_a_tenant_that_keeps_nothing_shows_0(
    tmp_path, multiproc
):
    """Both ways to ``/metrics`` (several API servers, one): one series per tenant."""
    env = _env(tmp_path, multiproc=multiproc)
    snapshots = [
        {"retained_bytes": {"acme": 4096, "": 1024}},
        {"retained_bytes": {"acme": 2048}},  # the default tenant's retentions ended
    ]
    _engine_core("0", snapshots, env, mirrored=multiproc)
    if multiproc:
        registry = CollectorRegistry()
        MultiProcessCollector(registry, path=str(tmp_path / "prom"))
        assert _tenant_samples(generate_latest(registry).decode()) == {
            ("0", "acme"): 2048.0,
            ("0", ""): 0.0,
        }
    else:
        from kvplug.vllm.stats import KVPlugCollector

        registry = CollectorRegistry()
        registry.register(KVPlugCollector(tmp_path / "kvplug-metrics"))
        assert _tenant_samples(generate_latest(registry).decode()) == {("0", "acme"): 2048.0}
