"""Sessions inside vLLM: a request's ``kvplug_session`` (``vllm_xargs``), or its OpenAI
``user`` field, reaches the policy's classes through the real manager and both pools;
a bad value names none and is counted; the replay's vLLM arm decides as kvplug's own
cache does when told sessions."""

from __future__ import annotations

from dataclasses import replace

import pytest

pytest.importorskip("vllm", reason="vLLM is not installed (pip install 'kvplug[vllm]')")

from vllm.sampling_params import SamplingParams  # noqa: E402

from kvplug.core.model_spec import load_model  # noqa: E402
from kvplug.policies import make_policy  # noqa: E402
from kvplug.replay.arms.base import FRESH_UNIT_BASE as F  # noqa: E402
from kvplug.replay.arms.vllm import VLLMStockArm  # noqa: E402
from kvplug.replay.runner import run_replay  # noqa: E402
from kvplug.replay.synthetic import synthetic_trace  # noqa: E402
from kvplug.vllm.dense_pool import CHOICE_VARIABLE  # noqa: E402
from kvplug.vllm.openai_user import forward_user_field  # noqa: E402


@pytest.mark.parametrize("dense", ["1", "0"])
@pytest.mark.parametrize(
    ("extra_args", "named", "refused"),
    [
        (None, False, 0),
        ({"kvplug_session": "chat-1"}, True, 0),
        ({"kvplug_session": 42}, True, 0),
        ({"kvplug_session": ""}, False, 1),
        ({"kvplug_session": {"id": 1}}, False, 1),
    ],
)
def test_a_request_s_session_reaches_the_policy_s_classes(
    extra_args, named, refused, dense, monkeypatch
) -> None:
    monkeypatch.setenv(CHOICE_VARIABLE, dense)
    arm = VLLMStockArm(8, make_policy("cost"))
    prompt = [11, 12, 13, 14, F]
    assert arm.admit(0, prompt, 5) == 0
    request = arm._requests[0]
    request.sampling_params = SamplingParams(max_tokens=64, extra_args=extra_args)
    arm.finish(0, 10)
    pool = arm.manager.block_pool
    classes = pool.policy.learned()
    assert classes and {cls[-1] for cls in classes} == {int(named)}
    assert (pool.stats.session_requests, pool.stats.sessions_refused) == (int(named), refused)
    assert (type(pool).__name__ == "DenseCostPool") == (dense == "1")


def test_the_openai_user_field_is_forwarded_as_the_session() -> None:
    from vllm.entrypoints.openai.chat_completion.protocol import ChatCompletionRequest
    from vllm.entrypoints.openai.completion.protocol import CompletionRequest

    forward_user_field()
    assert forward_user_field() == []  # once
    chat = [{"role": "user", "content": "hi"}]

    def extra(request) -> object:
        return request.to_sampling_params(16, {}).extra_args

    assert extra(ChatCompletionRequest(model="m", messages=chat, user="alice")) == {
        "kvplug_session": "alice"
    }
    own = {"kvplug_session": "chat-7", "x": 1}
    assert extra(ChatCompletionRequest(model="m", messages=chat, user="a", vllm_xargs=own)) == own
    assert extra(ChatCompletionRequest(model="m", messages=chat)) is None
    assert extra(CompletionRequest(model="m", prompt="x", user="bob")) == {"kvplug_session": "bob"}


@pytest.mark.parametrize("policy", ["cost", "learned"])
def test_the_vllm_arm_told_sessions_decides_as_kvplug_s_cache(policy: str) -> None:
    """A mix of chats that name their session and one-off requests that do not: vLLM's
    manager with kvplug's pool and kvplug's own cache, told the same sessions, save the
    same compute, and the sessions change what they save. One request at a time: with
    requests in flight, vLLM frees a step's finished blocks and allocates its new ones in
    its own order, so the two can rank a released block under a different inflation."""
    trace = synthetic_trace("conversations", seed=5, duration=400.0, rate=3.0)
    mixed = synthetic_trace("system-prompts", seed=6, duration=400.0, rate=3.0)
    offset = 1 + max(h for r in trace.requests for h in r.hash_ids)
    trace.requests.extend(
        replace(r, hash_ids=tuple(h + offset for h in r.hash_ids)) for r in mixed.requests
    )
    trace.requests.sort(key=lambda r: r.arrival)
    arms = [policy, f"vllm-kvplug:{policy}"]
    model = load_model(None)
    told = run_replay(trace, arms, [1000], model, sequential=True, sessions=True)
    plain = run_replay(trace, arms, [1000], model, sequential=True)
    assert told[0].saved_flops == told[1].saved_flops
    assert plain[0].saved_flops == plain[1].saved_flops
    assert told[0].saved_flops != plain[0].saved_flops
