"""``kvplug bench vllm-step`` at a tiny size: the report's shape, the same workload in every
arm, kvplug's pool really in the kvplug arms, and a told arm replaying cost's decisions in
vLLM's own scheduler and pool."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

pytestmark = pytest.mark.engine_vllm
pytest.importorskip("vllm", reason="vLLM is not installed (pip install 'kvplug[vllm]')")

from click.testing import CliRunner  # noqa: E402
from vllm.v1.core.block_pool import BlockPool  # noqa: E402

from kvplug.bench.told_pool import ToldBlockPool  # noqa: E402
from kvplug.bench.vllm_step import (  # noqa: E402
    STOCK,
    Arm,
    ArmResult,
    RequestStream,
    Workload,
    bench_size,
    format_table,
    report,
)
from kvplug.cli.bench import bench  # noqa: E402
from kvplug.policies import make_policy  # noqa: E402
from kvplug.tools.tiny_model import build_tiny_model  # noqa: E402
from kvplug.vllm.block_pool import KVPlugBlockPool, pool_class  # noqa: E402
from kvplug.vllm.dense_pool import DenseCostPool, DenseFreeQueue  # noqa: E402

NUM_BLOCKS = 500
STEPS = 24
ROUNDS = 3
TINY = Workload(
    max_num_seqs=8,
    max_num_batched_tokens=512,
    concurrency=12,
    num_prefixes=4,
    prefix_blocks=(1, 4),
    suffix_blocks=(1, 4),
    output_tokens=(2, 8),
    follow_up_window=200,
    max_prompt_blocks=16,
)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_tiny_model(tmp_path_factory.mktemp("models") / "llama", arch="llama")


@pytest.fixture(scope="module")
def run(model_dir: Path) -> tuple[list[ArmResult], list[Arm]]:
    arms: list[Arm] = []
    results = bench_size(model_dir, NUM_BLOCKS, ["lru", "cost"], STEPS, ROUNDS, TINY, arms_out=arms)
    return results, arms


def test_report_structure(run: tuple[list[ArmResult], list[Arm]]) -> None:
    results, _ = run
    assert [r.arm for r in results] == [STOCK, "lru", "cost"]
    for r in results:
        assert r.num_blocks == NUM_BLOCKS
        assert r.timed_steps == STEPS
        assert len(r.round_ratios) == ROUNDS
        assert r.step_ms > 0 and r.mean_ms > 0 and r.cpu_ms > 0
        assert r.ratio > 0 and r.mean_ratio > 0 and r.cpu_ratio > 0
        assert r.scheduled_tokens > 0 and r.finished_requests > 0
        assert 0 <= r.hit_tokens <= r.prompt_tokens
    assert results[0].ratio == 1.0
    table = format_table(results)
    assert table.count("\n") == len(results) + 1
    data = json.loads(json.dumps(report(results, TINY, STEPS, ROUNDS)))
    assert data["benchmark"] == "vllm-step"
    assert [row["arm"] for row in data["results"]] == [STOCK, "lru", "cost"]


def test_same_workload(run: tuple[list[ArmResult], list[Arm]]) -> None:
    """kvplug's lru evicts in vLLM's order, so stock and lru do exactly the same work; cost
    keeps other blocks but serves the same request stream."""
    results, arms = run
    stock, lru, cost = results
    assert lru.scheduled_tokens == stock.scheduled_tokens
    assert lru.prompt_tokens == stock.prompt_tokens
    assert lru.hit_tokens == stock.hit_tokens
    assert lru.finished_requests == stock.finished_requests
    reference = RequestStream(TINY)
    planned = [reference.next() for _ in range(max(arm.stream.count for arm in arms))]
    for arm in arms:
        assert arm.stream.history
        for request in arm.stream.history:
            assert request == planned[request.number]


def test_pools(run: tuple[list[ArmResult], list[Arm]]) -> None:
    results, arms = run
    stock, *kvplug_arms = arms
    assert type(stock.pool) is BlockPool and results[0].pool == "BlockPool"
    assert results[0].evictions is None
    for arm, result in zip(kvplug_arms, results[1:], strict=True):
        assert isinstance(arm.pool, KVPlugBlockPool)
        # lru runs on vLLM's own free queue (ReleaseOrderPool); other policies are tracked
        assert result.pool == pool_class(make_policy(arm.name)).__name__
        assert arm.pool.policy.name == arm.name
        assert result.evictions is not None and result.evictions > 0  # the pool was full
        arm.pool.check_invariants()


def test_cli_json(tmp_path: Path, model_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import kvplug.bench.vllm_step as vllm_bench

    monkeypatch.setattr(vllm_bench, "Workload", lambda seed=0: TINY)
    original = vllm_bench.bench_vllm_step

    def with_model(*args, **kwargs):  # type: ignore[no-untyped-def]
        return original(*args, model_dir=model_dir, **kwargs)

    monkeypatch.setattr(vllm_bench, "bench_vllm_step", with_model)
    path = tmp_path / "report.json"
    args = ["step", "--blocks", "300", "--steps", "4", "--rounds", "2"]
    result = CliRunner().invoke(bench, [*args, "--policies", "lru", "--json", str(path)])
    assert result.exit_code == 0, result.output
    assert "stock" in result.output and "lru" in result.output
    data = json.loads(path.read_text())
    assert [(row["arm"], row["num_blocks"]) for row in data["results"]] == [
        (STOCK, 300),
        ("lru", 300),
    ]


def test_async_scheduling_gets_vllms_async_scheduler_with_kvplug_pool(model_dir: Path) -> None:
    from vllm.v1.core.sched.async_scheduler import AsyncScheduler

    import kvplug.vllm
    from kvplug.bench.vllm_step import build_vllm_config, scheduler_kwargs

    config = build_vllm_config(model_dir, TINY, NUM_BLOCKS)
    config.scheduler_config.async_scheduling = True
    scheduler = kvplug.vllm.Scheduler(**scheduler_kwargs(config, TINY, NUM_BLOCKS))
    assert isinstance(scheduler, AsyncScheduler)
    assert type(scheduler).__name__ == "KVPlugAsyncScheduler"
    assert isinstance(scheduler.kv_cache_manager.block_pool, KVPlugBlockPool)


def test_the_decision_digest_tells_policies_apart_and_repeats(
    model_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The same arm twice gives one digest; a policy that keeps other blocks another; and a
    pool that evicts another victim (the policy's order reversed) changes it."""
    from kvplug.bench.vllm_step import decision_digest

    cost = decision_digest(model_dir, NUM_BLOCKS, "cost", STEPS, TINY)
    assert decision_digest(model_dir, NUM_BLOCKS, "cost", STEPS, TINY) == cost
    assert decision_digest(model_dir, NUM_BLOCKS, "lru", STEPS, TINY) != cost
    served = pool_class(make_policy("cost"))
    # the dense pool's queue hands blocks out in one compiled call; the record pool's
    # victims come from evict_n
    taker = DenseFreeQueue if served is DenseCostPool else served
    name = "popleft_n" if served is DenseCostPool else "evict_n"
    original = getattr(taker, name)
    monkeypatch.setattr(taker, name, lambda self, n: original(self, n)[::-1])
    assert decision_digest(model_dir, NUM_BLOCKS, "cost", STEPS, TINY) != cost


def test_the_command_prints_one_digest_per_arm() -> None:
    args = ["step", "--blocks", "600", "--policies", "lru,cost", "--steps", "5", "--rounds", "1"]
    result = CliRunner().invoke(bench, [*args, "--digest"])
    assert result.exit_code == 0, result.output
    rows = re.findall(r"600 blocks\s+(\S+)\s+([0-9a-f]{64})$", result.output, re.M)
    assert [arm for arm, _ in rows] == ["lru", "cost"]
    assert rows[0][1] != rows[1][1]


def test_a_told_arm_schedules_as_the_policys_arm_in_vllms_own_scheduler(model_dir: Path) -> None:
    """``told:cost`` is vLLM's own scheduler whose pool hands out the blocks cost's arm
    handed out (recorded in a first run): it schedules and hits the tokens cost's arm
    does (the benchmark raises otherwise), which are not stock's."""
    arms: list[Arm] = []
    results = bench_size(
        model_dir, NUM_BLOCKS, ["cost"], STEPS, ROUNDS, TINY, arms_out=arms, told=["cost"]
    )
    assert [r.arm for r in results] == [STOCK, "cost", "told:cost"]
    stock, cost, told = results
    assert type(arms[2].pool) is ToldBlockPool and told.evictions is None
    assert (told.scheduled_tokens, told.hit_tokens) == (cost.scheduled_tokens, cost.hit_tokens)
    assert told.warmup_steps == cost.warmup_steps
    assert "told:cost" in format_table(results)


def test_step_told_is_checked() -> None:
    result = CliRunner().invoke(bench, ["step", "--told", "nope"])
    assert result.exit_code == 2
    assert "--told" in result.output and "cost" in result.output
