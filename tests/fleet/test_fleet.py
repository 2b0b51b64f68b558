"""The fleet replay: routers fed only by KV events, simulated engines, the fleet loop,
its report and the ``kvplug replay --engines`` command."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from click.testing import CliRunner
from hypothesis import given
from hypothesis import strategies as st

from kvplug.cli import main
from kvplug.core.events import BlockRemoved, BlockStored
from kvplug.core.model_spec import load_model
from kvplug.errors import ConfigError, KVPlugError, UnknownPolicyError, UnknownRouterError
from kvplug.fleet.loop import replay_fleet
from kvplug.fleet.report import render, sign_test
from kvplug.fleet.router import (
    APPROX_THRESHOLD,
    BALANCE_ABS,
    ROUTERS,
    ApproxTree,
    CacheAware,
    LeastLoaded,
    RoundRobin,
    make_router,
)
from kvplug.fleet.runner import build_fleet, run_fleet
from kvplug.fleet.view import EventFeed, KeyScheme, PrefixView
from kvplug.policies.cost import DEFAULT_FREQUENCY_WEIGHT
from kvplug.replay.loop import Timing, make_jobs
from kvplug.replay.runner import run_replay
from kvplug.replay.synthetic import synthetic_trace
from kvplug.replay.trace import read_trace, write_trace

MOONCAKE = (
    Path(__file__).resolve().parents[3] / "shared" / "traces" / "mooncake_synthetic_trace.jsonl"
)
MODEL = load_model(None)


@pytest.fixture(scope="module")
def small_trace():
    """A minute of the mixed workload: shared prompts, chats and agents (about 240 requests)."""
    return synthetic_trace("mixed", duration=60.0, rate=4.0, seed=3)


def _capacity(trace, fraction: float) -> int:
    return max(1, round(fraction * trace.distinct_blocks))


# ---------------------------------------------------------------- the router's view


def test_view_follows_events_in_order_after_the_lag():
    view = PrefixView(2)
    feed = EventFeed(view, lag_s=1.0)
    scheme = KeyScheme.for_engines(1)
    keys = scheme.prompt_keys([7, 8, 9])
    feed.publish(0, BlockStored(keys[0], None, 1))
    feed.now = 0.5
    feed.publish(0, BlockStored(keys[1], keys[0], 1))
    feed.deliver(0.9)
    assert view.prefix_blocks(0, keys) == 0 and feed.in_flight == 2
    feed.deliver(1.0)
    assert view.prefix_blocks(0, keys) == 1
    feed.deliver(1.5)
    assert view.prefix_blocks(0, keys) == 2 and view.prefix_blocks(1, keys) == 0
    feed.now = 2.0
    feed.publish(0, BlockRemoved(keys[0]))
    feed.deliver(3.0)
    assert view.prefix_blocks(0, keys) == 0  # a prefix stops at its first missing block


def test_event_fed_view_is_exactly_each_cache_without_lag(small_trace):
    """With no lag, the keys the router computes and learns from events predict every
    engine's prefix match exactly, at every decision and at the end."""
    jobs = make_jobs(small_trace, MODEL)
    engines, feed = build_fleet(jobs, "cost", 3, _capacity(small_trace, 0.05) // 3, 512, Timing())
    scheme = KeyScheme.for_engines(1)
    stats = replay_fleet(engines, make_router("cache-aware", 3), feed, scheme, jobs)
    assert stats.decisions == len(jobs) and stats.stale == 0
    feed.deliver(float("inf"))
    for engine in engines:
        for job in jobs:
            keys = scheme.prompt_keys(job.prompt[:-1])
            held = len(engine.arm.cache.match(job.prompt))
            assert feed.view.prefix_blocks(engine.engine_id, keys) == held


def test_lagged_events_make_the_view_stale(small_trace):
    jobs = make_jobs(small_trace, MODEL)
    capacity = _capacity(small_trace, 0.05) // 2
    stale = []
    for lag in (0.0, 30.0):
        engines, feed = build_fleet(jobs, "lru", 2, capacity, 512, Timing(), lag)
        router = make_router("cache-aware", 2)
        stats = replay_fleet(engines, router, feed, KeyScheme.for_engines(1), jobs)
        stale.append(stats.stale_ratio)
        assert stats.mean_events_in_flight > 0 if lag else stats.mean_events_in_flight == 0
    assert stale[0] == 0 < stale[1]


# ---------------------------------------------------------------- routers


def test_round_robin_takes_turns_and_least_loaded_takes_the_idlest():
    view = PrefixView(3)
    rr = RoundRobin(3)
    assert [rr.choose([], [5, 0, 0], view) for _ in range(4)] == [0, 1, 2, 0]
    ll = LeastLoaded(3)
    assert ll.choose([], [2, 1, 3], view) == 1
    assert [ll.choose([], [0, 0, 0], view) for _ in range(3)] == [2, 0, 1]  # ties in turn


def test_cache_aware_prefers_the_prefix_unless_the_engine_is_too_busy():
    view = PrefixView(2)
    keys = KeyScheme.for_engines(1).prompt_keys([1, 2, 3, 4])
    for key in keys[:3]:
        view.apply(1, BlockStored(key, None, 1))
    assert CacheAware(2, load_penalty=1.0).choose(keys, [0, 0], view) == 1
    assert CacheAware(2, load_penalty=1.0).choose(keys, [0, 1], view) == 0  # 0.75 - 1 < 0
    assert CacheAware(2, load_penalty=0.5).choose(keys, [0, 1], view) == 1  # 0.75 - 0.5 > 0


def test_approx_tree_follows_what_it_routed_as_the_real_routers_cache_aware_does():
    """vllm-router's and sglang-router's own policy: a prompt goes where the router sent
    over `APPROX_THRESHOLD` of it before, whatever the KV events say; a new one goes to
    the engine it sent the fewest blocks; only loads out of balance override both."""
    view = PrefixView(2)  # it reads no event: this view stays empty
    scheme = KeyScheme.for_engines(1)
    chat = scheme.prompt_keys(list(range(10)))
    other = scheme.prompt_keys(list(range(100, 104)))
    router = ApproxTree(2)
    first = router.choose(chat[:4], [0, 0], view)
    assert router.choose(chat, [0, 5], view) == first  # 4 of 10 routed there: over 0.3
    assert router.choose(other, [0, 0], view) == 1 - first  # new: the engine it used least
    below = scheme.prompt_keys([*range(3), *range(300, 310)])  # 3 of 13 are the chat's
    above = scheme.prompt_keys([*range(5), *range(400, 409)])  # 5 of 14
    assert 3 / 13 <= APPROX_THRESHOLD < 5 / 14
    assert router.choose(below, [0, 0], view) == 1 - first  # the engine it sent fewer blocks
    assert router.choose(above, [0, 0], view) == first
    busy = [BALANCE_ABS + 10, 0] if first == 0 else [0, BALANCE_ABS + 10]
    assert router.choose(chat, busy, view) == 1 - first  # out of balance: the least busy
    assert router.choose(chat, [BALANCE_ABS, BALANCE_ABS * 2], view) == first  # 64 apart only


def test_approx_tree_keeps_every_chat_of_the_served_workload_on_one_engine():
    """On the live A/B's chats (`served-chats`), each chat's turns all reach the engine
    its first turn did, and the chats split evenly, as the live routers' counters showed
    (every later turn a prefix hit)."""
    trace = synthetic_trace("served-chats", seed=1)
    router, scheme = ApproxTree(2), KeyScheme.for_engines(1)
    engine_of: dict[str, set[int]] = {}
    for job in make_jobs(trace, MODEL):
        keys = scheme.prompt_keys(job.prompt[:-1])
        chosen = router.choose(keys, [0, 0], PrefixView(2))
        engine_of.setdefault(trace.requests[job.index].session, set()).add(chosen)
    assert len(engine_of) == 50 and all(len(engines) == 1 for engines in engine_of.values())
    per_engine = [sum(1 for e in engine_of.values() if e == {k}) for k in (0, 1)]
    assert per_engine == [25, 25]


@given(
    st.lists(st.lists(st.integers(1, 8), min_size=1, max_size=5), min_size=1, max_size=6),
    st.randoms(use_true_random=False),
    st.integers(2, 4),
)
def test_approx_tree_never_splits_a_chat_whose_turns_grow_by_at_most_double(chats, rng, engines):
    """Under balanced loads, a turn that resends its chat's last prompt and adds at most
    twice as many blocks (so the routed prefix covers over `APPROX_THRESHOLD` of it) goes
    where that prompt went, whatever the other chats' turns in between."""
    scheme, router = KeyScheme.for_engines(1), ApproxTree(engines)
    pending = [(chat, turn) for chat, growth in enumerate(chats) for turn in range(len(growth))]
    rng.shuffle(pending)
    pending.sort(key=lambda item: item[1])  # each chat's turns in order; chats interleaved
    prompts: dict[int, list[int]] = {}
    engine_of: dict[int, set[int]] = {}
    for chat, turn in pending:
        prompt = prompts.get(chat, [1_000 * (chat + 1)])
        grown = [*prompt, *range(len(prompt) * 10_000, len(prompt) * 10_000 + chats[chat][turn])]
        grown = grown[: len(prompt) * 3]  # at most twice the blocks it had
        prompts[chat] = grown
        chosen = router.choose(scheme.prompt_keys(grown), [0] * engines, PrefixView(engines))
        engine_of.setdefault(chat, set()).add(chosen)
    assert all(len(used) == 1 for used in engine_of.values())


def test_a_policy_config_reaches_every_engine_of_the_fleet(small_trace):
    jobs = make_jobs(small_trace, MODEL)
    config = {"frequency_weight": 0.25, "queue_depth": 3}  # not a policy's: left out
    engines, _ = build_fleet(jobs, "cost", 2, 50, 512, Timing(), policy_config=config)
    assert [engine.arm.cache.policy.frequency_weight for engine in engines] == [0.25, 0.25]
    default, _ = build_fleet(jobs, "cost", 2, 50, 512, Timing())
    assert default[0].arm.cache.policy.frequency_weight == DEFAULT_FREQUENCY_WEIGHT
    with pytest.raises(ConfigError, match="taken by none of the arms lru"):
        run_fleet(small_trace, ["approx-tree"], ["lru"], [2], [100], MODEL,
                  policy_config={"frequency_weight": 0.5})  # fmt: skip


def test_bad_router_input_names_what_is_accepted():
    with pytest.raises(UnknownRouterError, match="accepted: round-robin, least-loaded"):
        make_router("random", 2)
    with pytest.raises(ConfigError, match="integer >= 1"):
        make_router("round-robin", 0)
    with pytest.raises(ConfigError, match="load penalty"):
        CacheAware(2, load_penalty=-1)
    with pytest.raises(ConfigError, match="event lag"):
        EventFeed(PrefixView(1), lag_s=-1)


# ---------------------------------------------------------------- the fleet replay


def test_one_engine_fleet_is_the_realistic_replay(small_trace):
    """The fleet loop runs the realistic replay's model: with one engine and any router it
    reproduces the single-cache replay, request for request."""
    capacity = _capacity(small_trace, 0.05)
    (single,) = run_replay(small_trace, ["cost"], [capacity], MODEL)
    for router in ROUTERS:
        (fleet,) = run_fleet(small_trace, [router], ["cost"], [1], [capacity], MODEL)
        assert fleet.saved_flops == single.saved_flops
        assert fleet.hit_ratio == single.hit_ratio
        assert (fleet.preemptions, fleet.rejected) == (single.preemptions, single.rejected)
        assert fleet.load_imbalance == 1.0


def test_fleet_rows_account_for_every_request(small_trace):
    capacity = _capacity(small_trace, 0.1)
    rows = run_fleet(small_trace, list(ROUTERS), ["lru", "cost"], [2, 4], [capacity], MODEL)
    assert len(rows) == len(ROUTERS) * 2 * 2
    for row in rows:
        assert sum(engine.routed for engine in row.per_engine) == len(small_trace.requests)
        assert row.requests + row.rejected >= len(small_trace.requests)
        assert row.capacity_blocks == capacity // row.engines * row.engines
        assert row.load_imbalance >= 1.0
        if row.router == "round-robin":
            routed = [engine.routed for engine in row.per_engine]
            assert max(routed) - min(routed) <= 1


def test_cache_aware_routing_keeps_shared_prefixes_together(small_trace):
    """Round-robin spreads every shared prefix over all engines; routing by the engines'
    events keeps it where it is cached, so the fleet saves more compute."""
    capacity = _capacity(small_trace, 0.1)
    rows = run_fleet(small_trace, ["round-robin", "cache-aware"], ["lru"], [4], [capacity], MODEL)
    round_robin, cache_aware = rows
    assert cache_aware.saved_compute_ratio > round_robin.saved_compute_ratio


def test_fleet_capacity_must_cover_the_engines(small_trace):
    with pytest.raises(KVPlugError, match="at least one block per engine"):
        run_fleet(small_trace, ["round-robin"], ["lru"], [4], [3], MODEL)
    with pytest.raises(UnknownPolicyError, match="accepted: .*lru"):
        run_fleet(small_trace, ["round-robin"], ["belady"], [2], [100], MODEL)


def test_report_renders_every_format(small_trace):
    rows = run_fleet(small_trace, ["round-robin"], ["lru", "cost"], [2], [200], MODEL)
    text = render(rows, "table")
    assert "vs rr/lru" in text and "round-robin" in text
    assert json.loads(render(rows, "json"))[1]["per_engine"][0]["routed"] > 0
    assert render(rows, "csv").splitlines()[0].startswith("router,policy,engines")


def test_fleet_runs_every_timing_and_reports_the_spread(small_trace):
    """Each timing is a run of its own, tagged with its speeds; the table then gives each
    cell's spread and the paired comparison with lru under the same timing."""
    timings = [Timing(20_000.0, 30.0), Timing(20_000.0, 50.0), Timing(10_000.0, 40.0)]
    rows = run_fleet(
        small_trace, ["least-loaded"], ["lru", "cost"], [2], [200], MODEL, timings=timings
    )
    assert [(r.prefill_tps, r.decode_tps, r.policy) for r in rows] == [
        (t.prefill_tps, t.decode_tps, policy) for t in timings for policy in ("lru", "cost")
    ]
    single = run_fleet(small_trace, ["least-loaded"], ["cost"], [2], [200], MODEL,
                       timings=[timings[2]])  # fmt: skip
    assert single[0].saved_flops == rows[5].saved_flops  # a timing's run does not depend on others
    lines = render(rows, "table").splitlines()
    assert "sign p" in lines[0]
    lru_line, cost_line = lines[2:4]
    assert lru_line.split()[3:5] == ["lru", "3"] and "/" not in lru_line.split()[-1]
    diffs = [100 * (cost.saved_compute_ratio - lru.saved_compute_ratio) for lru, cost in
             zip(rows[0::2], rows[1::2], strict=True)]  # fmt: skip
    ahead = sum(d > 0 for d in diffs)
    assert cost_line.split()[3:5] == ["cost", "3"]
    assert f"{ahead}/3" in cost_line
    assert f"{sign_test(ahead, sum(d < 0 for d in diffs)):.3f}" in cost_line
    assert "sign p" not in render(rows[:2], "table")  # one timing: the per-run table


def test_sign_test_examples():
    assert sign_test(0, 0) == 1.0
    assert sign_test(6, 0) == 1 / 64
    assert sign_test(3, 3) == 42 / 64
    assert sign_test(0, 5) == 1.0


@given(st.integers(0, 60), st.integers(0, 60))
def test_sign_test_is_a_tail_probability(ahead, behind):
    """p lies in (0, 1], never rises as wins are added, and the two tails of the same
    flips cover every outcome exactly once."""
    p = sign_test(ahead, behind)
    assert 0.0 < p <= 1.0
    assert sign_test(ahead + 1, behind) <= p
    if ahead:
        assert sign_test(ahead, behind) + sign_test(behind + 1, ahead - 1) == pytest.approx(1.0)


# ---------------------------------------------------------------- the command


def test_replay_command_runs_a_fleet(small_trace, tmp_path):
    path = write_trace(small_trace, tmp_path / "small.jsonl")
    result = CliRunner().invoke(
        main,
        ["replay-fleet", str(path), "--engines", "2", "--router", "cache-aware",
         "--capacity-blocks", "120", "--event-lag", "0.5", "--format", "json", "--quiet"],
    )  # fmt: skip
    assert result.exit_code == 0, result.output
    rows = json.loads(result.output)
    assert [(r["router"], r["policy"], r["engines"]) for r in rows] == [
        ("cache-aware", "lru", 2),
        ("cache-aware", "cost", 2),
    ]
    assert all(r["event_lag_s"] == 0.5 for r in rows)


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["replay-fleet", "--engines", "0"], "--engines: expected positive numbers"),
        (["replay-fleet", "--router", "random"], "accepted: round-robin, least-loaded"),
        (["replay-fleet", "--policy", "vllm-stock"], "cannot run in a fleet replay"),
        (["replay-fleet", "--sequential"], "--sequential does not apply to the fleet replay"),
        (
            ["replay-fleet", "--policy-config", '{"frequency_wieght": 1}'],
            "policy config key 'frequency_wieght' is taken by none of the arms lru, cost",
        ),
        (["replay-fleet", "--policy-config", "[1]"], "--policy-config"),
        (["replay", "--decode-tps", "30,40"], "apply to kvplug replay-fleet only"),
        (["replay-fleet", "--prefill-tps", "0"], "--prefill-tps: expected positive numbers"),
        (["replay-fleet", "--decode-tps", "fast"], "--decode-tps: expected comma-separated"),
    ],
)
def test_replay_command_rejects_bad_fleet_options(args, message):
    command, *rest = args
    result = CliRunner().invoke(main, [command, "synthetic:system-prompts", *rest])
    assert result.exit_code != 0
    assert message in result.output


# ---------------------------------------------------------------- the shared trace


@pytest.mark.skipif(not MOONCAKE.exists(), reason=f"the shared Mooncake trace is not at {MOONCAKE}")
def test_mooncake_cache_aware_cost_beats_round_robin_lru():
    """The issue's headline, at one point (4 engines, 5% of distinct blocks): cache-aware
    routing with `cost` saves more compute than round-robin with `lru`, within 1.25x load."""
    trace = read_trace(MOONCAKE)
    capacity = _capacity(trace, 0.05)
    baseline = run_fleet(trace, ["round-robin"], ["lru"], [4], [capacity], MODEL)[0]
    kvplug = run_fleet(trace, ["cache-aware"], ["cost"], [4], [capacity], MODEL)[0]
    assert kvplug.saved_compute_ratio > baseline.saved_compute_ratio
    assert kvplug.load_imbalance <= 1.25
