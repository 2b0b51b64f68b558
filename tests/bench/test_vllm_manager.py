"""``kvplug bench vllm-manager`` at a tiny size: the report's shape, the same requests in
every arm, kvplug's lru deciding exactly as stock, a told arm replaying cost's decisions in
vLLM's own pool, and bad input named. No timed checks."""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import pytest

pytestmark = pytest.mark.engine_vllm
pytest.importorskip("vllm", reason="vLLM is not installed (pip install 'kvplug[vllm]')")

from click.testing import CliRunner  # noqa: E402
from vllm.v1.core.block_pool import BlockPool  # noqa: E402

from kvplug.bench.told_pool import ToldBlockPool, make_told, record_handouts  # noqa: E402
from kvplug.bench.vllm_manager import (  # noqa: E402
    STOCK,
    ManagerArm,
    ManagerResult,
    bench_size,
    format_table,
    parse_models,
    report,
)
from kvplug.cli.bench import bench  # noqa: E402
from kvplug.core.model_spec import load_model  # noqa: E402
from kvplug.errors import KVPlugError  # noqa: E402
from kvplug.policies import make_policy  # noqa: E402
from kvplug.replay.loop import make_jobs  # noqa: E402
from kvplug.replay.sources import bundled_trace_path  # noqa: E402
from kvplug.replay.trace import Trace, read_trace  # noqa: E402
from kvplug.vllm.block_pool import KVPlugBlockPool, pool_class  # noqa: E402

REQUESTS = 150
ROUNDS = 3
FRACTION = 0.1
MODELS = ["full", "gemma3-like"]

Run = tuple[list[ManagerResult], list[ManagerArm]]


@pytest.fixture(scope="module")
def trace() -> Trace:
    full = read_trace(bundled_trace_path())
    return replace(full, requests=full.requests[:REQUESTS])


@pytest.fixture(scope="module", params=MODELS)
def run(request: pytest.FixtureRequest, trace: Trace) -> Run:
    ((model, spec),) = parse_models(request.param)
    jobs = make_jobs(trace, load_model(None))
    arms: list[ManagerArm] = []
    results = bench_size(model, spec, trace, jobs, FRACTION, ["lru", "cost"], ROUNDS, arms_out=arms)
    return results, arms


def test_report_structure(run: Run, trace: Trace) -> None:
    results, _ = run
    assert [r.arm for r in results] == [STOCK, "lru", "cost"]
    assert [r.target for r in results] == [None, 1.05, 1.25]
    for r in results:
        assert r.fraction == FRACTION and r.num_blocks == results[0].num_blocks
        assert r.warmup_requests > 0 and r.timed_requests > 0
        assert r.warmup_requests + r.timed_requests == REQUESTS
        assert len(r.round_ratios) == ROUNDS
        assert r.p50_us > 0 and r.p99_us >= r.p50_us and r.total_ms > 0 and r.cpu_ms > 0
        parts = r.lookup_ms + r.prefill_ms + r.decode_ms + r.free_ms
        assert parts == pytest.approx(r.total_ms)
        assert set(r.part_ratios) == {"lookup", "prefill", "decode", "free"}
        assert 0 <= r.gc_share <= 1
        assert 0 < r.hit_tokens <= r.prompt_tokens
    stock = results[0]
    assert stock.ratio == stock.total_ratio == 1.0 and stock.round_ratios == [1.0] * ROUNDS
    assert stock.evictions is None and stock.pool == "BlockPool"
    table = format_table(results)
    assert table.count("\n") == len(results) + 1
    data = json.loads(json.dumps(report(results, trace, ROUNDS)))
    assert data["benchmark"] == "vllm-manager" and data["requests"] == REQUESTS
    assert [row["arm"] for row in data["results"]] == [STOCK, "lru", "cost"]


def test_same_requests(run: Run) -> None:
    """Every arm runs every request once, in trace order; warm-up and timed alike."""
    results, arms = run
    for arm, result in zip(arms, results, strict=True):
        assert arm.seen == list(range(REQUESTS))
        assert len(arm.times) == result.timed_requests
    assert len({r.prompt_tokens for r in results}) == 1


def test_lru_hits_equal_stock(run: Run) -> None:
    """kvplug's lru evicts in vLLM's order: the same hit on every request."""
    results, arms = run
    stock, lru, _ = arms
    assert lru.hits == stock.hits
    assert results[1].hit_tokens == results[0].hit_tokens
    assert results[1].rejected == results[0].rejected


def test_pools(run: Run) -> None:
    results, arms = run
    stock, *kvplug_arms = arms
    assert type(stock.pool) is BlockPool
    for arm, result in zip(kvplug_arms, results[1:], strict=True):
        assert isinstance(arm.pool, KVPlugBlockPool)
        # lru runs on vLLM's own free queue (ReleaseOrderPool); other policies are tracked,
        # cost on the dense core unless a sliding-window group needs the record pool
        kinds = getattr(arm.pool, "group_kinds", None)
        assert result.pool == pool_class(make_policy(arm.name), kinds).__name__
        assert arm.pool.policy.name == arm.name
        assert result.evictions is not None and result.evictions > 0  # the pool was full
        arm.pool.check_invariants()


def test_cli_json(tmp_path: Path) -> None:
    path = tmp_path / "report.json"
    args = ["manager", "--requests", "100", "--models", "full", "--policies", "lru"]
    args += ["--capacity-fractions", "0.1", "--rounds", "2", "--json", str(path)]
    result = CliRunner().invoke(bench, args)
    assert result.exit_code == 0, result.output
    assert "stock" in result.output and "<=1.05x" in result.output
    data = json.loads(path.read_text())
    assert [(row["model"], row["arm"]) for row in data["results"]] == [
        ("full", STOCK),
        ("full", "lru"),
    ]


@pytest.mark.parametrize(
    ("option", "value", "accepted"),
    [
        ("--policies", "lru,nope", "cost, gdsf, learned, lfu, lru"),
        ("--policies", "stock", "cost, gdsf, learned, lfu, lru"),
        ("--capacity-fractions", "0.05,1.5", "(0, 1]"),
        ("--capacity-fractions", "x", "(0, 1]"),
        ("--models", "llama", "full, gemma3-like, nemotron-h-like"),
    ],
)
def test_bad_input_names_what_is_accepted(option: str, value: str, accepted: str) -> None:
    result = CliRunner().invoke(bench, ["manager", option, value])
    assert result.exit_code == 2
    assert option in result.output and accepted in result.output


def test_hybrid_policies_are_checked() -> None:
    args = ["manager", "--models", "gemma3-like", "--policies", "lfu"]
    result = CliRunner().invoke(bench, args)
    assert result.exit_code == 2
    assert "hybrid" in result.output and "lru, cost" in result.output


@pytest.mark.parametrize("model", MODELS)
def test_a_told_arm_makes_the_policys_decisions_in_vllms_own_pool(model: str, trace: Trace) -> None:
    """``told:cost`` is vLLM's own `BlockPool` handing out the blocks cost's pool handed out
    (recorded in a first run): every request gets cost's hits, which differ from stock's,
    and nothing of kvplug's pool runs in it."""
    ((name, spec),) = parse_models(model)
    jobs = make_jobs(trace, load_model(None))
    arms: list[ManagerArm] = []
    results = bench_size(name, spec, trace, jobs, FRACTION, ["cost"], ROUNDS, arms, told=["cost"])
    assert [r.arm for r in results] == [STOCK, "cost", "told:cost"]
    stock, cost, told = arms
    assert type(told.pool) is ToldBlockPool and results[2].evictions is None
    assert told.hits == cost.hits != stock.hits
    assert results[2].hit_tokens == results[1].hit_tokens


def test_a_told_pool_refuses_a_replay_that_diverged(trace: Trace) -> None:
    ((name, spec),) = parse_models("full")
    jobs = make_jobs(trace, load_model(None))
    recorder = ManagerArm("cost", spec, 200, trace.block_tokens)
    handouts = record_handouts(recorder.pool)
    for job in jobs[:20]:
        recorder.run(job)
    assert handouts and all(handouts)
    told = ManagerArm("told:cost", spec, 200, trace.block_tokens, handouts[:3])
    with pytest.raises(KVPlugError, match="replay diverged"):
        for job in jobs[:20]:
            told.run(job)
    with pytest.raises(TypeError, match="only vLLM's own BlockPool"):
        make_told(recorder.pool, handouts)


def test_told_is_checked_like_policies() -> None:
    result = CliRunner().invoke(bench, ["manager", "--models", "full", "--told", "nope"])
    assert result.exit_code == 2
    assert "--told" in result.output and "cost" in result.output
