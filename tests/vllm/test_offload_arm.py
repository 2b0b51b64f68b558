"""The vLLM arms beside a CPU tier filled the way vLLM's lazy CPU offload fills it: what
the offloader copies is the head of the free queue's walk (kvplug's next victims with
kvplug's pool), the blocks it gives back are held elsewhere, and a prefix the GPU lost but
the CPU tier kept is loaded and counted as saved compute less its reload."""

from __future__ import annotations

import pytest

pytest.importorskip("vllm", reason="vLLM is not installed (pip install 'kvplug[vllm]')")

from vllm.v1.core.kv_cache_utils import get_block_hash  # noqa: E402

from kvplug.core.model_spec import load_model  # noqa: E402
from kvplug.errors import ConfigError  # noqa: E402
from kvplug.policies import make_policy  # noqa: E402
from kvplug.replay.arms.base import FRESH_UNIT_BASE as F  # noqa: E402
from kvplug.replay.arms.vllm_offload import VLLMOffloadArm  # noqa: E402
from kvplug.replay.loop import ReplayCounters, make_jobs  # noqa: E402
from kvplug.replay.runner import build_arm, run_replay  # noqa: E402
from kvplug.replay.sources import load_trace  # noqa: E402


@pytest.mark.parametrize("policy", [None, "lru", "cost"])
def test_the_offloader_copies_the_head_of_the_walk_and_gives_it_back_to_go_first(policy):
    arm = VLLMOffloadArm(8, host_blocks=64, reload_flops=1.0, target_free=3,
                         policy=None if policy is None else make_policy(policy))  # fmt: skip
    pool = arm.manager.block_pool
    for req_id in range(3):  # three 2-block prompts, finished: 6 cached free blocks
        assert arm.admit(req_id, [10 * req_id + 1, 10 * req_id + 2, F + req_id], 2) == 0
        arm.finish(req_id)
    walk = list(pool.free_block_queue.iter_blocks_after(None))
    head = [b for b in walk[:3] if b.block_hash is not None]
    assert head and {get_block_hash(b.block_hash) for b in head} <= set(arm._host)
    if policy == "cost":  # kvplug's pool knows every block it gave back as held elsewhere
        for block in walk:
            if block.block_hash is not None and get_block_hash(block.block_hash) in arm._host:
                assert pool.standing(block).held_elsewhere


def test_a_prefix_the_gpu_lost_is_loaded_from_the_cpu_tier_less_its_reload():
    arm = VLLMOffloadArm(4, host_blocks=64, reload_flops=1.0, target_free=4,
                         policy=make_policy("cost"))  # fmt: skip
    assert arm.admit(0, [1, 2, 3, F], 3) == 0
    arm.finish(0)
    for req_id in range(1, 3):  # push the first prompt's blocks out of the GPU
        assert arm.admit(req_id, [100 + 4 * req_id + k for k in range(4)] + [F + req_id], 4) == 0
        arm.finish(req_id)
    hits = arm.admit(9, [1, 2, 3, 4, F + 9], 4)
    assert hits is not None and hits + arm.loaded == 3 and arm.loaded > 0

    class Job:  # what record_admission reads
        index, input_length, total_flops = 0, 5, 10.0
        prefix_flops = [0.0, 1.0, 3.0, 6.0, 10.0]

    counters = ReplayCounters()
    counters.record_admission(Job, hits, 1, arm)
    assert counters.saved_flops == pytest.approx(6.0 - arm.loaded * 1.0)


def test_a_cpu_tier_runs_beside_vllm_arms_only():
    trace = load_trace("synthetic:multi-turn")
    with pytest.raises(ConfigError, match="vLLM arms only"):
        build_arm("cost", 64, make_jobs(trace, load_model(None)), True, trace.block_tokens,
                  host_blocks=16)  # fmt: skip


def test_the_replay_beside_a_cpu_tier_saves_at_least_as_much_as_without_one():
    trace = load_trace("synthetic:multi-turn")
    model = load_model(None)
    arms = ["vllm-stock", "vllm-kvplug:cost"]
    without = run_replay(trace, arms, [64], model, sequential=True)
    beside = run_replay(trace, arms, [64], model, sequential=True, host_blocks=256)
    for alone, tiered in zip(without, beside, strict=True):
        assert tiered.saved_compute_ratio >= alone.saved_compute_ratio - 1e-9
