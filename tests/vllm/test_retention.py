"""Retention inside vLLM: a request's prompt prefix held in vLLM's own pool after it ends
(`kvplug.vllm.retention`), through the real manager; asked for by ``kvplug_retain_s``
through the real scheduler."""

from __future__ import annotations

import pytest

pytest.importorskip("vllm", reason="vLLM is not installed (pip install 'kvplug[vllm]')")

from types import SimpleNamespace  # noqa: E402

from kvplug.core.retention import RetentionBook  # noqa: E402
from kvplug.engine_stats import PoolStats  # noqa: E402
from kvplug.errors import ConfigError  # noqa: E402
from kvplug.policies import make_policy  # noqa: E402
from kvplug.replay.arms.base import FRESH_UNIT_BASE as F  # noqa: E402
from kvplug.replay.arms.vllm import VLLMStockArm  # noqa: E402
from kvplug.vllm.retention import RETAIN_ARG, PoolRetention, refusal_for  # noqa: E402

SYSTEM = [1, 2, 3, 4, 5, 6]


def _flood(arm: VLLMStockArm, start: int, count: int) -> None:
    for i in range(start, start + count):
        prompt = [1000 + 10 * i + k for k in range(6)] + [F + i]
        assert arm.admit(i, prompt, 6) == 0
        arm.finish(i)


def _system(arm: VLLMStockArm, req_id: int, retain: float = 0.0) -> int:
    """The system prompt as one request; returns its prefix hit (in blocks)."""
    hits = arm.admit(req_id, [*SYSTEM, F + 500 + req_id], 6)
    assert hits is not None
    if retain:
        assert arm.retain(req_id, retain)
    arm.finish(req_id)
    if arm.retention is not None:
        arm.retention.check_invariants()
    return hits


@pytest.mark.parametrize("policy", ["lru", "cost"])
@pytest.mark.parametrize("retained", [False, True])
def test_a_retained_prefix_survives_a_flood_in_vllms_pool(policy, retained) -> None:
    arm = VLLMStockArm(32, make_policy(policy))  # each tenant may retain 8 blocks
    _system(arm, 0, retain=60.0 if retained else 0.0)
    _flood(arm, 10, 12)  # 72 one-off blocks through 32
    assert _system(arm, 1) == (6 if retained else 0)
    assert arm.manager.block_pool.stats.retentions == int(retained)


def test_an_expired_retention_frees_its_blocks_to_the_policy() -> None:
    arm = VLLMStockArm(32, make_policy("lru"))
    _system(arm, 0, retain=30.0)
    retention = arm.retention
    assert retention is not None and retention.retained_blocks() == 6
    held = [arm.manager.block_pool.blocks[b] for b in retention.holds]
    assert all(block.ref_cnt == 1 for block in held)
    arm.advance(31.0)
    assert retention.retained_blocks() == 0 and all(block.ref_cnt == 0 for block in held)
    _flood(arm, 10, 12)
    assert _system(arm, 1) == 0


def test_an_allocation_with_no_room_ends_the_oldest_retention_and_only_it() -> None:
    arm = VLLMStockArm(16, make_policy("cost"))
    arm.retention = PoolRetention(  # a tenant may retain the whole cache here
        arm.manager, RetentionBook(16), arm.manager.block_pool.stats, clock=lambda: arm.now
    )
    _system(arm, 0, retain=60.0)  # 6 blocks
    assert arm.admit(1, [*range(200, 206), F + 1], 6) == 0
    assert arm.retain(1, 60.0)
    arm.finish(1)  # 12 blocks retained of 16
    retention = arm.retention
    assert retention is not None and len(retention.book) == 2
    assert arm.admit(2, [*range(300, 308), F + 2], 8) == 0  # needs 9: the oldest ends
    assert [r.blocks for r in retention.book.live.values()] == [tuple(retention.holds)]
    assert retention.manager.block_pool.stats.retentions == 2
    retention.check_invariants()


@pytest.mark.parametrize("value", [0, -3, "60", float("nan"), 7200, True])
def test_a_bad_ask_is_not_served_and_counted(value) -> None:
    arm = VLLMStockArm(16, make_policy("lru"))
    retention = arm.retention
    assert retention is not None
    request = SimpleNamespace(
        request_id="r", sampling_params=SimpleNamespace(extra_args={RETAIN_ARG: value})
    )
    assert retention.on_finish(request, "") is None
    assert retention.stats.retentions_refused == 1 and len(retention.book) == 0


def test_a_model_with_other_groups_refuses_defaults_at_start_and_asks_per_request() -> None:
    arm = VLLMStockArm(16, make_policy("lru"))
    refusal = refusal_for(False)
    assert refusal_for(True) is None and "sliding-window or Mamba groups" in refusal
    with pytest.raises(ConfigError, match="default_seconds cannot be served: .*Mamba groups"):
        PoolRetention(arm.manager, RetentionBook(4), PoolStats(), {"": 60.0}, refusal)
    retention = PoolRetention(arm.manager, RetentionBook(4), PoolStats(), None, refusal)
    request = SimpleNamespace(
        request_id="r", sampling_params=SimpleNamespace(extra_args={RETAIN_ARG: 60})
    )
    assert retention.on_finish(request, "") is None and retention.stats.retentions_refused == 1


def test_vllms_own_cache_keeps_nothing_on_request() -> None:
    arm = VLLMStockArm(16)
    assert arm.retention is None and not arm.retain(0, 60.0)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory):
    from kvplug.tools.tiny_model import build_tiny_model

    return build_tiny_model(tmp_path_factory.mktemp("models") / "llama", arch="llama")


@pytest.mark.vllm_engine
def test_the_scheduler_keeps_what_a_request_asks_for_until_it_expires(model_dir) -> None:
    """Through kvplug's real scheduler: ``kvplug_retain_s`` in a request's extra args
    keeps its prompt's cached blocks after it finishes, the gauge shows them, a bad ask
    is counted and not served, and the retention ends when its time has passed."""
    from vllm.sampling_params import SamplingParams
    from vllm.utils.hashing import get_hash_fn_by_name
    from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash
    from vllm.v1.request import Request

    import kvplug.vllm
    from kvplug.bench.vllm_step import Workload, build_vllm_config, scheduler_kwargs
    from kvplug.vllm.compat import model_runner_output

    workload = Workload(max_num_seqs=4, max_num_batched_tokens=256, concurrency=4)
    config = build_vllm_config(model_dir, workload, 64)
    config.additional_config = {"kvplug": {"policy": "cost"}}
    scheduler = kvplug.vllm.Scheduler(**scheduler_kwargs(config, workload, 64))
    retention = scheduler.kvplug_retention
    now = [0.0]
    retention.clock = lambda: now[0]
    hash_fn = get_hash_fn_by_name(config.cache_config.prefix_caching_hash_algo)
    init_none_hash(hash_fn)
    hasher = get_request_block_hasher(workload.block_size, hash_fn)

    def run(req_id: str, prompt: list[int], extra: dict | None) -> None:
        params = SamplingParams(max_tokens=1, ignore_eos=True, extra_args=extra)
        scheduler.add_request(Request(req_id, prompt, params, None, block_hasher=hasher))
        while req_id in scheduler.requests:
            output = scheduler.schedule()
            ids = list(output.num_scheduled_tokens)
            sampled = [[] if scheduler.requests[i].is_prefill_chunk else [7] for i in ids]
            scheduler.update_from_output(output, model_runner_output(ids, sampled))

    run("kept", list(range(1, 50)), {"kvplug_retain_s": 30})  # 3 full blocks of 16
    assert retention.retained_blocks() == 3
    gauges = scheduler.refresh_kvplug_gauges()
    assert gauges.retained_blocks == 3 and list(gauges.retained_bytes) == [""]
    run("bad", list(range(100, 150)), {"kvplug_retain_s": "forever"})
    stats = scheduler.kvplug_stats
    assert (stats.retentions, stats.retentions_refused) == (1, 1)
    retention.check_invariants()
    now[0] = 31.0
    scheduler.schedule()  # each step first ends what has expired
    assert retention.retained_blocks() == 0 and len(retention.book) == 0
