"""Sessions inside SGLang: a request's ``kvplug_session`` (``custom_params``), or its
OpenAI ``user`` field, reaches the policy's classes through the real radix cache on both
tree cores; a bad value names none and is counted."""

from __future__ import annotations

from dataclasses import replace

import pytest

pytest.importorskip("sglang", reason="SGLang is not installed (see requirements/sglang-replay.txt)")

from kvplug.core.model_spec import load_model  # noqa: E402
from kvplug.replay.arms.sglang_kvplug import SGLangKVPlugArm  # noqa: E402
from kvplug.replay.runner import run_replay  # noqa: E402
from kvplug.replay.synthetic import synthetic_trace  # noqa: E402
from kvplug.sglang.openai_user import forward_user_field  # noqa: E402


@pytest.mark.parametrize("core", ["python", "rust"])
@pytest.mark.parametrize(
    ("session", "named", "refused"),
    [(None, False, 0), ("chat-1", True, 0), (7, True, 0), ("", False, 1), ([1], False, 1)],
)
def test_a_request_s_session_reaches_the_policy_s_classes(session, named, refused, core) -> None:
    arm = SGLangKVPlugArm(64, "cost", tree_core=core)
    assert arm.admit(0, [*range(1, 31), 999], 30) == 0
    if session is not None:
        params = arm.requests[0].sampling_params
        params.custom_params = {**(params.custom_params or {}), "kvplug_session": session}
    arm.finish(0, 10)
    tree_core = arm.cache.tree_core
    classes = tree_core.eviction.policy.learned()
    assert classes and {cls[-1] for cls in classes} == {int(named)}
    assert (tree_core.stats.session_requests, tree_core.stats.sessions_refused) == (
        int(named),
        refused,
    )


def test_the_openai_user_field_is_forwarded_as_the_session() -> None:
    from sglang.srt.entrypoints.openai.protocol import ChatCompletionRequest, CompletionRequest
    from sglang.srt.entrypoints.openai.serving_completions import OpenAIServingCompletion

    forward_user_field()
    assert forward_user_field() == []  # once
    chat = [{"role": "user", "content": "hi"}]

    def custom(request: ChatCompletionRequest) -> object:
        return request.to_sampling_params([], {}).get("custom_params")

    assert custom(ChatCompletionRequest(model="m", messages=chat, user="alice")) == {
        "kvplug_session": "alice"
    }
    own = {"kvplug_session": "chat-7", "x": 1}
    assert (
        custom(ChatCompletionRequest(model="m", messages=chat, user="a", custom_params=own)) == own
    )
    assert custom(ChatCompletionRequest(model="m", messages=chat)) is None
    serving = object.__new__(OpenAIServingCompletion)  # the builder reads only the request
    built = serving._build_sampling_params(CompletionRequest(model="m", prompt="x", user="bob"))
    assert built["custom_params"] == {"kvplug_session": "bob"}


def test_the_sglang_arm_told_sessions_ranks_by_them() -> None:
    """Chats that name their session among requests that do not: told the sessions,
    kvplug's policy in SGLang's tree keeps other blocks than told none."""
    trace = synthetic_trace("mixed", seed=2, duration=300.0)
    sessions = synthetic_trace("conversations", seed=3, duration=300.0)
    offset = 1 + max(h for r in trace.requests for h in r.hash_ids)
    trace.requests.extend(
        replace(r, hash_ids=tuple(h + offset for h in r.hash_ids)) for r in sessions.requests
    )
    trace.requests.sort(key=lambda r: r.arrival)
    model = load_model(None)
    arm = "sglang-kvplug:cost"
    told = run_replay(trace, [arm], [300], model, sequential=True, sessions=True)
    plain = run_replay(trace, [arm], [300], model, sequential=True)
    assert (told[0].policy, plain[0].policy) == (f"{arm}+sessions", arm)
    assert told[0].saved_flops != plain[0].saved_flops
