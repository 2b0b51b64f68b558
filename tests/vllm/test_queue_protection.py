"""Waiting-queue protection inside vLLM (`kvplug.vllm.queue_protection`): through the real
manager and pool, a waiting request's cached prefix outlives a flood and the free queue
shows it last; through the real scheduler, each step claims the waiting queue's hits,
and a pool kvplug does not order refuses the setting at start-up."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

pytest.importorskip("vllm", reason="vLLM is not installed (pip install 'kvplug[vllm]')")

from kvplug.errors import ConfigError  # noqa: E402
from kvplug.policies import make_policy  # noqa: E402
from kvplug.replay.arms.base import FRESH_UNIT_BASE as F  # noqa: E402
from kvplug.replay.arms.vllm import VLLMStockArm  # noqa: E402
from kvplug.vllm.dense_pool import CHOICE_VARIABLE  # noqa: E402


def _prompt(base: int, blocks: int, tail: int) -> list[int]:
    return [base + k for k in range(blocks)] + [F + tail]


def _fill(arm: VLLMStockArm, waiting: list[int]) -> None:
    """The waiting request's prefix cached first, then three prompts each used twice."""
    assert arm.admit(0, waiting, 6) == 0
    arm.finish(0, 1)
    for i in range(1, 4):
        prompt = _prompt(1000 * i, 4, i)
        for run in (i, 10 + i):
            assert arm.admit(run, prompt, 4) is not None
            arm.finish(run, 1)


@pytest.mark.parametrize("dense", ["1", "0"])
@pytest.mark.parametrize("policy", ["cost", "learned", "gdsf"])
@pytest.mark.parametrize("protected", [False, True])
def test_a_waiting_requests_prefix_survives_a_flood_in_vllms_pool(
    policy, protected, dense, monkeypatch
) -> None:
    monkeypatch.setenv(CHOICE_VARIABLE, dense)
    arm = VLLMStockArm(20, make_policy(policy), queue_depth=4 if protected else 0)
    waiting = _prompt(100, 6, 0)
    _fill(arm, waiting)
    arm.protect_waiting([(50, waiting)])
    pool = arm.manager.block_pool
    assert pool.num_protected() == (6 if protected else 0)
    if protected:  # what a lazy offloader or LMCache reads from the head: claimed last
        request = arm._waiting[50]
        hit = arm.manager.coordinator.find_longest_cache_hit(request.block_hashes, 6)[0][0]
        order = pool.free_block_queue.get_all_free_blocks()
        assert {b.block_id for b in order[-6:]} == {b.block_id for b in hit}
    # 18 blocks cached, 2 free: a 14-block prompt evicts 12 of them
    assert arm.admit(20, _prompt(9000, 14, 20), 14) == 0
    arm.finish(20, 1)
    pool.check_invariants()
    assert arm.admit(50, waiting, 6) == (6 if protected else 0)


def test_lru_inside_vllm_refuses_queue_protection() -> None:
    with pytest.raises(ConfigError, match=r"queue_protection.requests = 4 needs a policy"):
        VLLMStockArm(20, make_policy("lru"), queue_depth=4)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory):
    from kvplug.tools.tiny_model import build_tiny_model

    return build_tiny_model(tmp_path_factory.mktemp("models") / "llama", arch="llama")


@pytest.mark.vllm_engine
def test_the_scheduler_claims_the_waiting_queues_hits_each_step(model_dir) -> None:
    """Through kvplug's real scheduler: with requests waiting behind a full batch, each
    step claims the cached blocks of the first of them; the claims end once they run;
    ``lru`` refuses the setting at start-up."""
    from vllm.sampling_params import SamplingParams
    from vllm.utils.hashing import get_hash_fn_by_name
    from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash
    from vllm.v1.request import Request

    import kvplug.vllm
    from kvplug.bench.vllm_step import Workload, build_vllm_config, scheduler_kwargs
    from kvplug.vllm.compat import model_runner_output

    workload = Workload(max_num_seqs=1, max_num_batched_tokens=256, concurrency=1)
    config = build_vllm_config(model_dir, workload, 64)
    config.additional_config = {"kvplug": {"policy": "lru", "queue_protection": {"requests": 2}}}
    with pytest.raises(ConfigError, match="needs a policy kvplug ranks itself"):
        kvplug.vllm.Scheduler(**scheduler_kwargs(config, workload, 64))
    config.additional_config = {"kvplug": {"policy": "cost", "queue_protection": {"requests": 2}}}
    scheduler = kvplug.vllm.Scheduler(**scheduler_kwargs(config, workload, 64))
    hash_fn = get_hash_fn_by_name(config.cache_config.prefix_caching_hash_algo)
    init_none_hash(hash_fn)
    hasher = get_request_block_hasher(workload.block_size, hash_fn)

    def add(req_id: str, prompt: list[int], tokens: int) -> None:
        params = SamplingParams(max_tokens=tokens, ignore_eos=True)
        scheduler.add_request(Request(req_id, prompt, params, None, block_hasher=hasher))

    def step() -> None:
        output = scheduler.schedule()
        ids = list(output.num_scheduled_tokens)
        sampled = [[] if scheduler.requests[i].is_prefill_chunk else [7] for i in ids]
        scheduler.update_from_output(output, model_runner_output(ids, sampled))

    system = list(range(1, 50))  # 3 full blocks of 16
    add("first", system, 1)
    while "first" in scheduler.requests:
        step()
    add("long", list(range(200, 240)), 5)  # one running at a time: the rest wait
    add("again", [*system, 60, 61], 1)
    step()
    protection = scheduler.kvplug_protection
    assert protection is not None and len(protection.protection.live) == 3
    assert scheduler.refresh_kvplug_gauges().protected_blocks == 3
    while scheduler.requests:
        step()
    step()  # an empty queue clears the claims
    assert protection.protection.live == {} and scheduler.kvplug_pool.num_protected() == 0


@settings(max_examples=40, deadline=None)
@given(ops=st.lists(st.tuples(st.integers(0, 5), st.integers(1, 8), st.booleans()), max_size=40))
def test_a_kept_claim_names_the_blocks_a_fresh_lookup_finds(ops) -> None:
    """A claim checked and extended step by step (`direct_lookup`) names exactly the
    blocks vLLM's own lookup would, as requests with shared prefixes come and go and
    evictions take claimed blocks."""
    arm = VLLMStockArm(24, make_policy("cost"), queue_depth=3)
    protection = arm.protection
    assert protection is not None and protection._direct
    waiting = [(100 + n, [7000 + n * 10 + k for k in range(6)] + [F + 100 + n]) for n in range(3)]
    for step, (prefix, blocks, keep) in enumerate(ops):
        prompt = [7000 + prefix * 10 + k for k in range(blocks)] + [F + step]
        if arm.admit(step, prompt, len(prompt) - 1) is not None:
            arm.finish(step, 1)
        if not keep:  # the queue changes: a request leaves, another comes
            waiting = [*waiting[1:], (500 + step, prompt)]
        arm.protect_waiting(waiting)
        requests = [arm._waiting[req_id] for req_id, _ in waiting]
        kept = [protection._claims_of[r.request_id].ids for r in requests]
        fresh = [
            [b.block_id for b in arm.manager.coordinator.find_longest_cache_hit(
                r.block_hashes, r.num_tokens - 1)[0][0]]
            for r in requests
        ]  # fmt: skip
        assert kept == fresh
        arm.manager.block_pool.check_invariants()


@pytest.mark.parametrize("dense", ["1", "0"])
def test_a_prefix_cache_reset_ends_every_claim(dense, monkeypatch) -> None:
    monkeypatch.setenv(CHOICE_VARIABLE, dense)
    arm = VLLMStockArm(20, make_policy("cost"), queue_depth=4)
    waiting = _prompt(100, 6, 0)
    _fill(arm, waiting)
    arm.protect_waiting([(50, waiting)])
    pool = arm.manager.block_pool
    assert pool.num_protected() == 6
    assert pool.reset_prefix_cache()
    pool.check_invariants()
    assert pool.num_protected() == 0
    arm.protect_waiting([(50, waiting)])  # nothing cached: nothing claimed, old claims cleared
    assert pool.num_protected() == 0 and arm.protection.protection.live == {}
    pool.check_invariants()
