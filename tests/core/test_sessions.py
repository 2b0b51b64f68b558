"""Sessions: what a request's session tells `cost`, and which values name one."""

from __future__ import annotations

import logging
from dataclasses import replace

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvplug.core.cache import KVCache
from kvplug.core.model_spec import load_model
from kvplug.core.sessions import MAX_SESSION_CHARS, check_session, names_session
from kvplug.engine_stats import PoolStats
from kvplug.errors import ConfigError
from kvplug.policies import make_policy
from kvplug.replay.runner import reads_sessions, row_name, run_replay
from kvplug.replay.synthetic import synthetic_trace
from kvplug.replay.trace import Trace


def _serve(cache: KVCache, req: str, prompt: list[int], session: bool) -> int:
    cached = cache.add_request(req, prompt)
    cache.append(req, prompt[cached:])
    cache.complete_step()
    cache.finish(req, output_tokens=100, session=session)
    return cached


def _follow_ups(policy: str, sessions: bool, rounds: int = 300) -> tuple[KVCache, int]:
    """Each round: a request of a session, four one-off requests alike in every other
    way (length, output, no hit), then the session's next turn. Only the next turns
    reuse anything. Returns the cache and how many of the last 100 found their prefix."""
    cache = KVCache(16, 1, policy=make_policy(policy, {"tokens_per_block": 512}))
    hits = 0
    for i in range(rounds):
        turn = [1000 + i, 1, 2, 3, 4]
        _serve(cache, f"s{i}", turn, sessions)
        for k in range(4):
            _serve(cache, f"o{i}.{k}", [5000 + 4 * i + k, 6, 7, 8, 9], False)
        cached = _serve(cache, f"s{i}b", turn, sessions)
        hits += i >= rounds - 100 and cached == 4
    return cache, hits


@pytest.mark.parametrize("policy", ["cost", "learned"])
def test_cost_keeps_a_session_s_turn_that_one_offs_alike_in_all_else_would_push_out(
    policy: str,
) -> None:
    cache, with_sessions = _follow_ups(policy, sessions=True)
    _, without = _follow_ups(policy, sessions=False)
    assert with_sessions >= 90 and without <= 10, (with_sessions, without)
    learned = cache.policy.learned()
    session_p = max(p for cls, (n, p) in learned.items() if cls[0] == 0 and cls[-1] == 1)
    anonymous_p = max(p for cls, (n, p) in learned.items() if cls[0] == 0 and cls[-1] == 0)
    assert session_p > 0.5 > 0.1 > anonymous_p
    cache.check_invariants()


@pytest.mark.parametrize("value", ["chat-1", 7, "x" * MAX_SESSION_CHARS])
def test_a_string_or_an_integer_names_a_session(value: object) -> None:
    assert check_session(value) == str(value)


@pytest.mark.parametrize(
    ("value", "message"),
    [
        ("", "1 to 256 characters, got 0"),
        ("x" * (MAX_SESSION_CHARS + 1), "1 to 256 characters, got 257"),
        (True, "string or an integer naming the session, got bool"),
        (1.5, "got float 1.5"),
        ({"id": 1}, "got dict"),
    ],
)
def test_a_bad_session_is_refused_naming_what_is_accepted(value: object, message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        check_session(value)


def test_a_bad_session_names_none_and_is_counted_and_logged(caplog) -> None:
    stats, log = PoolStats(), logging.getLogger("test.sessions")
    with caplog.at_level(logging.WARNING, logger="test.sessions"):
        assert names_session(["a"], "alice", stats, "r1", log) is False
    assert (stats.sessions_refused, stats.session_requests) == (1, 0)
    assert "request r1: session not served" in caplog.text
    assert names_session(None, "alice", stats, "r2", log) is True  # the user field
    assert names_session("chat-9", None, stats, "r3", log) is True
    assert names_session(None, None, stats, "r4", log) is False
    assert (stats.sessions_refused, stats.session_requests) == (1, 2)


def test_replay_rows_name_the_arms_that_read_sessions() -> None:
    assert [reads_sessions(arm) for arm in ("cost", "learned", "lru", "belady")] == [
        True,
        True,
        False,
        False,
    ]
    assert row_name("cost", 8, True) == "cost+queue8+sessions"
    assert row_name("lru", 0, True) == "lru" and row_name("vllm-stock", 8, True) == "vllm-stock"
    assert row_name("vllm-kvplug:cost", 0, True) == "vllm-kvplug:cost+sessions"


@given(seed=st.integers(0, 2**16), sequential=st.booleans())
@settings(max_examples=6, deadline=None)
def test_a_trace_whose_requests_name_no_session_replays_as_without_sessions(
    seed: int, sequential: bool
) -> None:
    named = synthetic_trace("mixed", seed=seed, duration=120.0)
    trace = Trace(named.name, named.block_tokens, [replace(r, session="") for r in named.requests])
    model = load_model(None)
    plain = run_replay(trace, ["cost", "learned"], [40, 160], model, sequential=sequential)
    told = run_replay(
        trace, ["cost", "learned"], [40, 160], model, sequential=sequential, sessions=True
    )
    assert [r.policy for r in told] == [f"{r.policy}+sessions" for r in plain]
    assert [(r.saved_flops, r.evictions, r.churn) for r in told] == [
        (r.saved_flops, r.evictions, r.churn) for r in plain
    ]


def test_a_replay_told_sessions_changes_only_what_they_change() -> None:
    trace = synthetic_trace("conversations", seed=3, duration=300.0)
    assert all(request.session for request in trace.requests)
    unnamed = [replace(r, session="") for r in trace.requests]
    anonymous = Trace(trace.name, trace.block_tokens, unnamed)
    model = load_model(None)
    rows = run_replay(trace, ["lru", "cost"], [60], model, sessions=True)
    again = run_replay(anonymous, ["lru", "cost"], [60], model, sessions=True)
    # every request names one: the session bit is the same for all and splits no class
    # (cost learns the same odds under other codes); lru reads none
    assert [r.policy for r in rows] == ["lru", "cost+sessions"]
    assert [r.saved_flops for r in rows] == [r.saved_flops for r in again]
