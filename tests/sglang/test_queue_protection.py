"""Waiting-queue protection inside SGLang's real radix cache
(`kvplug.sglang.queue_protection`): a request SGLang matched while it waits keeps its
path through a flood, on SGLang's Rust core and on its Python core; the claim ends when
it is admitted or finishes; a hybrid model refuses the setting."""

from __future__ import annotations

from array import array
from itertools import count

import pytest

pytest.importorskip("sglang", reason="SGLang is not installed (see requirements/sglang-replay.txt)")

from kvplug.replay.arms.base import FRESH_UNIT_BASE  # noqa: E402
from kvplug.replay.arms.sglang_kvplug import SGLangKVPlugArm  # noqa: E402
from kvplug.sglang.queue_protection import refusal_for  # noqa: E402

fresh = count(FRESH_UNIT_BASE)
CORES = ["rust", "python"]
WAITING = [1, 2, 3, 4, 5, 6]


def run(arm: SGLangKVPlugArm, req_id: int, prompt: list[int]) -> int:
    """One whole request; returns its prefix hit."""
    hits = arm.admit(req_id, [*prompt, next(fresh)], len(prompt))
    assert hits is not None
    arm.finish(req_id)
    arm.cache.tree_core.check_invariants()
    return hits


def wait(arm: SGLangKVPlugArm, prompt: list[int]):
    """A request SGLang matches while it waits (as its scheduler matches the queue)."""
    from sglang.srt.managers.schedule_batch import Req
    from sglang.srt.sampling.sampling_params import SamplingParams

    with arm._sglang():
        req = Req("waiting", "", array("q", [*prompt, next(fresh)]), SamplingParams())
        req.init_next_round_input(arm.cache)
    return req


@pytest.mark.parametrize("core", CORES)
@pytest.mark.parametrize("policy", ["lru", "cost"])
@pytest.mark.parametrize("protected", [False, True])
def test_a_waiting_requests_path_survives_a_flood_in_sglangs_tree(core, policy, protected):
    arm = SGLangKVPlugArm(24, policy, tree_core=core, queue_depth=4 if protected else 0)
    run(arm, 0, WAITING)
    req = wait(arm, WAITING)  # SGLang matched it; it waits behind what runs next
    assert req.prefix_len == 6
    for i in range(1, 4):  # later prompts, each used twice
        prompt = [100 * i + k for k in range(4)]
        run(arm, i, prompt)
        run(arm, 10 + i, prompt)
    protection = arm.cache.kvplug_protection
    assert (protection is not None) == protected
    # 18 pages cached, 6 free: a 16-page prompt evicts 10 of them
    assert run(arm, 20, [*range(500, 516)]) == 0
    if protected:
        assert arm.cache.tree_core.eviction.num_protected == len(protection.protection.live) > 0
        assert protection.protected_pages() == 6
    assert run(arm, 21, WAITING) == (6 if protected else 0)


@pytest.mark.parametrize("core", CORES)
def test_a_claim_ends_once_its_request_runs_or_finishes(core) -> None:
    arm = SGLangKVPlugArm(24, "cost", tree_core=core, queue_depth=4)
    run(arm, 0, WAITING)
    req = wait(arm, WAITING)
    protection = arm.cache.kvplug_protection
    protection.refresh()
    assert len(protection.protection.live) > 0
    req.lock = arm.cache.lock(req.last_node)  # admitted: SGLang locks its path
    protection.refresh()
    assert protection.protection.live == {}
    assert arm.cache.tree_core.eviction.num_protected == 0
    arm.cache.unlock(req.lock)
    req.lock = None
    req.finished_reason = "stop"  # finished: it leaves the record
    arm.cache.on_release(req, checkpointed=False)
    protection.refresh()
    assert protection.protection.live == {} and not protection._matched
    arm.cache.tree_core.check_invariants()


def test_a_hybrid_model_refuses_queue_protection() -> None:
    assert refusal_for(0, False) is None and refusal_for(8, True) is None
    message = refusal_for(8, False)
    assert message is not None and "full-attention models only" in message
