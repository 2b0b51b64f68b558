"""Hybrid models: specs, the junction, kvplug's hybrid cache and the hybrid replay."""

from __future__ import annotations

import json
from types import SimpleNamespace

import pytest
from click.testing import CliRunner
from hypothesis import given, settings
from hypothesis import strategies as st

from kvplug.cli import main
from kvplug.core.groups import GroupKind
from kvplug.errors import ConfigError, KVPlugError, UnknownPolicyError
from kvplug.hybrid.cache import HybridCache
from kvplug.hybrid.junction import Holdings, longest_hits
from kvplug.hybrid.policy import hybrid_requests_reaching
from kvplug.hybrid.spec import (
    HYBRID_PRESETS,
    HybridSpec,
    StateGroup,
    hybrid_from_hf_config,
    load_hybrid,
)
from kvplug.replay.hybrid import (
    HybridKVPlugArm,
    build_hybrid_arm,
    cacheable_units,
    capacity_bytes_for,
    check_hybrid_arms,
    run_hybrid_replay,
)
from kvplug.replay.loop import make_jobs, replay
from kvplug.replay.runner import replay_clock
from kvplug.replay.synthetic import synthetic_trace

FULL, WINDOW, MAMBA = GroupKind.FULL, GroupKind.SLIDING_WINDOW, GroupKind.MAMBA
GEMMA = HYBRID_PRESETS["gemma3-like"]
NEMOTRON = HYBRID_PRESETS["nemotron-h-like"]
BT = 512  # tokens per unit, as the Mooncake trace's blocks


def _cache(spec: HybridSpec, pages: int, policy: str = "lru") -> HybridCache:
    return HybridCache(spec, pages * spec.page_bytes(BT), BT, policy)


# ---------------------------------------------------------------- specs


def test_presets_group_layers_as_vllm_does():
    assert [g.kind for g in GEMMA.groups].count(WINDOW) == 5
    assert [g.kind for g in GEMMA.groups].count(FULL) == 1
    assert {g.layers for g in GEMMA.groups} == {8}
    assert GEMMA.window == 1024 and GEMMA.groups[0].window_units(BT) == 2
    assert [g.kind for g in NEMOTRON.groups].count(MAMBA) == 6
    # a Mamba2 checkpoint of 4 layers is about one 512-token KV page of 4 layers
    mamba = NEMOTRON.kind_unit_bytes(MAMBA, BT) / 6
    assert 0.9 < mamba / NEMOTRON.kind_unit_bytes(FULL, BT) < 1.1


def test_full_attention_equivalent_keeps_bytes_and_costs_more_attention():
    full = GEMMA.full_attention_equivalent()
    assert full.kinds() == {FULL}
    assert full.kind_unit_bytes(FULL, BT) == sum(g.unit_bytes(BT) for g in GEMMA.groups)
    # sliding-window layers attend to at most the window: cheaper at long context
    assert full.prefill_flops(0, 32_768) > GEMMA.prefill_flops(0, 32_768)
    assert full.prefill_flops(0, 512) == pytest.approx(GEMMA.prefill_flops(0, 512))


def test_window_flops_are_the_sum_of_min_position_window():
    spec = HybridSpec(
        "w",
        (
            StateGroup(FULL, 1, bytes_per_token=2),
            StateGroup(WINDOW, 1, bytes_per_token=2, sliding_window=4),
        ),
        linear_flops_per_token=0.0,
        full_attention_flops_per_position=0.0,
        window_attention_flops_per_position=1.0,
    )
    for start, end in [(0, 10), (2, 3), (3, 9), (6, 7), (0, 0)]:
        assert spec.prefill_flops(start, end) == sum(min(p, 4) for p in range(start, end))


def test_config_json_is_read_for_each_hybrid_layout(tmp_path):
    gemma = {
        "hidden_size": 64,
        "num_attention_heads": 2,
        "num_hidden_layers": 6,
        "sliding_window": 128,
        "layer_types": ["sliding_attention"] * 5 + ["full_attention"],
    }
    spec = hybrid_from_hf_config(gemma)
    assert [g.kind for g in spec.groups].count(WINDOW) == 5 and spec.window == 128
    nemotron = {
        "hidden_size": 64,
        "num_attention_heads": 2,
        "num_hidden_layers": 6,
        "hybrid_override_pattern": "M-M*-M",
        "mamba_num_heads": 4,
        "mamba_head_dim": 16,
        "ssm_state_size": 8,
    }
    spec = hybrid_from_hf_config(nemotron)
    assert [g.kind for g in spec.groups].count(MAMBA) == 3
    (tmp_path / "config.json").write_text(json.dumps(gemma))
    assert load_hybrid(tmp_path).window == 128
    assert load_hybrid("nemotron-h-like") is NEMOTRON


def test_unmappable_layer_types_name_what_was_found():
    config = {
        "hidden_size": 64,
        "num_attention_heads": 2,
        "num_hidden_layers": 2,
        "layer_types": ["full_attention", "linear_attention"],
    }
    with pytest.raises(ConfigError, match=r"linear_attention.*maps .*full_attention"):
        hybrid_from_hf_config(config)
    with pytest.raises(ConfigError, match="hybrid_override_pattern has layer symbols"):
        hybrid_from_hf_config({**config, "hybrid_override_pattern": "M*X"})
    with pytest.raises(ConfigError, match="neither a preset"):
        load_hybrid("no-such-model")
    with pytest.raises(ConfigError, match="needs a full-attention group"):
        HybridCache(
            HybridSpec("w", (StateGroup(WINDOW, 1, 2, sliding_window=8),), 1.0, 0.0), 100, 4
        )


# ---------------------------------------------------------------- the junction


def _path(kv: str, window: str = "", checkpoint: str = "") -> list[Holdings]:
    n = len(kv)
    window, checkpoint = window.ljust(n, "."), checkpoint.ljust(n, ".")
    return [Holdings(kv[i] == "x", window[i] == "x", checkpoint[i] == "x") for i in range(n)]


def test_junction_is_the_shortest_group_hit():
    # full attention holds 6 units, the window only the 2 before position 4
    path = _path("xxxxxx", "..xx..")
    hits = longest_hits(path, {FULL, WINDOW}, window_units=2)
    assert hits.by_kind == {FULL: 6, WINDOW: 4}
    assert hits.junction == 4


def test_a_mamba_state_serves_only_the_position_it_was_taken_at():
    path = _path("xxxxxx", checkpoint="..x...")
    hits = longest_hits(path, {FULL, MAMBA}, window_units=0)
    assert hits.junction == 3  # not 6, though full attention holds 6
    assert longest_hits(path, {FULL, MAMBA}, 0, limit=2).junction == 0  # not the state at 3
    assert longest_hits(_path("xx.xxx", checkpoint="....x."), {FULL, MAMBA}, 0).junction == 0


def test_a_window_hit_needs_no_unit_outside_its_window():
    # units 1-3 hold no window KV: a hit at 5 needs only units 4 and 5
    hits = longest_hits(_path("xxxxx", "...xx"), {FULL, WINDOW}, window_units=2)
    assert hits.junction == 5
    # a gap inside the window breaks it
    assert longest_hits(_path("xxxxx", "..x.x"), {FULL, WINDOW}, 2).junction == 0
    # near the start the window is shorter than window_units
    assert longest_hits(_path("xx", "x."), {FULL, WINDOW}, 2).junction == 1


# ---------------------------------------------------------------- kvplug's hybrid cache


def test_mamba_checkpoints_at_prompt_end_and_branch_point():
    cache = _cache(NEMOTRON, 200)
    a = list(range(10))
    assert cache.admit(1, a, 10, cacheable=10) == 0
    cache.finish(1)
    held = {node.depth for node in cache.nodes() if node.checkpoint}
    assert held == {10}  # no checkpoint at every block: only at the prompt's end
    # shares 7 units with A: full attention could serve 7, but no state was taken at 7
    b = a[:7] + [100, 101, 102]
    assert cache.admit(2, b, 10, cacheable=10) == 0
    cache.finish(2)
    # B left A's path at 7, a branch point: the state there is kept now
    assert {node.depth for node in cache.nodes() if node.checkpoint} == {7, 10}
    assert cache.admit(3, a[:7] + [200, 201], 9, cacheable=9) == 7
    assert cache.admit(4, a + [300], 11, cacheable=11) == 10
    cache.check_invariants()


def test_sliding_window_kv_is_anchored_before_junctions_and_speculative_elsewhere():
    cache = _cache(GEMMA, 300)
    a = list(range(10))
    cache.admit(1, a, 10, cacheable=10)
    cache.grow(1, [1000, 1001, 1002])  # decode past the prompt
    cache.finish(1)
    assert max(node.depth for node in cache.nodes()) == 10  # the decode tail no junction needs
    anchored = sorted(n.depth for n in cache.nodes() if n.window_kv and not n.speculative)
    speculative = sorted(n.depth for n in cache.nodes() if n.speculative)
    assert anchored == [9, 10]  # the window before the prompt's end
    assert speculative == list(range(1, 9))  # computed, kept while room allows
    # a request leaving A's path at 6 is served there by the speculative window ...
    assert cache.admit(2, [*a[:6], 50, 51], 8, cacheable=8) == 6
    cache.finish(2)
    # ... and 6 is now a junction: its window is anchored
    assert {n.depth for n in cache.nodes() if n.record is not None} == {6, 8, 10}
    assert not any(n.speculative for n in cache.nodes() if n.depth in (5, 6) and n.unit < 50)
    cache.check_invariants()


def test_speculative_windows_go_before_junctions_under_lru():
    cache = _cache(GEMMA, 70)
    a = list(range(10))
    cache.admit(1, a, 10, cacheable=10)
    cache.finish(1)  # 10 KV + 10 windows of 5 pages: 60 of 70 pages
    assert cache.admit(2, [500, 501], 2, cacheable=2) == 0  # needs 12 pages: 2 go
    cache.finish(2)
    assert cache.metrics.windows_evicted >= 1 and cache.metrics.retired == 0
    assert cache.hits(a, 10).junction == 10  # A's junction is whole
    cache.check_invariants()


def test_eviction_removes_a_whole_junction_and_what_only_it_needed():
    cache = _cache(NEMOTRON, 60)
    one, two = list(range(10)), list(range(100, 110))
    for req, prompt in ((1, one), (2, two)):
        cache.admit(req, prompt, 10, cacheable=10)
        cache.finish(req)
    # a checkpoint of the 6 Mamba groups is ~6 KV units, so each prompt holds ~16 pages;
    # 25 KV units, a checkpoint and the live state need room for one prompt to go
    three = list(range(200, 225))
    assert cache.admit(3, three, 25, cacheable=25) == 0
    cache.check_invariants()
    depths = sorted(node.depth for node in cache.nodes() if node.parent is cache.root)
    assert len(depths) == 2  # one of the first two prompts is gone, whole; three remains
    survivors = {node.unit for node in cache.nodes() if node.parent is cache.root}
    assert survivors & {0, 100} and 200 in survivors
    assert cache.metrics.retired == 1


def test_a_refused_admission_changes_nothing():
    cache = _cache(GEMMA, 12)
    assert cache.admit(1, list(range(100)), 100, cacheable=100) is None
    assert cache.used == 0 and not cache.requests
    cache.check_invariants()


def test_unknown_hybrid_policy_names_the_accepted():
    with pytest.raises(UnknownPolicyError, match="accepted: lru, cost, belady"):
        _cache(GEMMA, 10, policy="lfu")
    with pytest.raises(UnknownPolicyError, match="vllm-kvplug"):
        check_hybrid_arms(["nope"])
    with pytest.raises(UnknownPolicyError, match="belady needs the future"):
        check_hybrid_arms(["vllm-kvplug:belady"])


def test_belady_in_the_hybrid_cache_ranks_each_record_by_its_nodes_next_pass():
    """The offline reference: a record's rank is minus the index of the next request
    whose prompt passes its node, read from the replay's jobs, on the replay's clock."""
    trace = synthetic_trace("multi-turn", seed=3)
    jobs = make_jobs(trace, GEMMA)
    capacity = capacity_bytes_for(GEMMA, trace, 0.1)
    arm = build_hybrid_arm("belady", GEMMA, capacity, trace.block_tokens, jobs)
    policy = arm.cache.policy
    reaching = hybrid_requests_reaching([job.prompt[: cacheable_units(job.prompt)] for job in jobs])
    replay(arm, jobs, trace.block_tokens, on_admit=replay_clock(arm))
    assert policy.now == jobs[-1].index
    arm.cache.check_invariants()
    for node in arm.cache.nodes():
        uses = reaching[node.key]
        later = [i for i in uses if i > policy.now]
        assert policy.rank(SimpleNamespace(key=node.key)) == -(later[0] if later else float("inf"))
    with pytest.raises(KVPlugError, match="needs the future"):
        build_hybrid_arm("belady", GEMMA, capacity, trace.block_tokens)


def test_cost_ghost_history_is_sized_in_ranked_records(monkeypatch):
    """Evicted junctions are remembered for `ghost_ratio` times the records ranked, not
    for a multiple of the blocks the bytes would buy, and a return still credits."""
    import kvplug.hybrid.audit
    import kvplug.hybrid.policy

    for module in (kvplug.hybrid.policy, kvplug.hybrid.audit):
        monkeypatch.setattr(module, "GHOST_FLOOR", 1)
    cache = _cache(GEMMA, 120, policy="cost")
    policy = cache.policy
    for req in range(60):  # distinct 4-unit prompts: each leaves one junction
        cache.admit(req, [req * 10 + i for i in range(4)], 4, cacheable=4)
        cache.finish(req)
        cache.check_invariants()
    ranked = len(policy._rank)
    assert 0 < len(policy._ghosts) <= policy.ghost_ratio * (ranked + 1)
    assert len(policy._ghosts) < 60 - ranked  # the oldest evictions are forgotten
    keys = {}  # a prompt's junction key, as the tree makes it
    for req in range(60):
        key = 0
        for unit in (req * 10 + i for i in range(4)):
            key = hash((key, unit))
        keys[key] = req
    newest = keys[next(reversed(policy._ghosts))]  # the latest eviction
    reused = sum(policy._reused)
    cache.admit(99, [newest * 10 + i for i in range(4)], 4, cacheable=4)
    assert sum(policy._reused) == reused + 1  # its trial closed as reused


_OPS = st.lists(
    st.tuples(
        st.sampled_from(["admit", "grow", "finish"]),
        st.integers(0, 3),  # prefix family
        st.integers(1, 9),  # length
        st.integers(0, 9),  # where the prompt diverges from its family
    ),
    max_size=40,
)


@pytest.mark.parametrize(
    "spec", [GEMMA, NEMOTRON, GEMMA.full_attention_equivalent()], ids=lambda s: s.name
)
@pytest.mark.parametrize("policy", ["lru", "cost"])
@settings(max_examples=150, deadline=None)
@given(ops=_OPS, pages=st.integers(8, 60))
def test_hybrid_cache_invariants(spec, policy, ops, pages):
    cache = _cache(spec, pages, policy)
    running: list[int] = []
    fresh = 10_000
    for index, (op, family, length, diverge) in enumerate(ops):
        if op == "admit" or not running:
            prompt = [family * 100 + i for i in range(length)]
            if diverge < length:
                prompt[diverge:] = range(fresh, fresh + length - diverge)
                fresh += length
            hits = cache.hits(prompt, len(prompt) - 1)
            served = cache.admit(index, prompt, len(prompt), cacheable=len(prompt))
            if served is not None:
                assert served == hits.junction
                assert all(served <= units for units in hits.by_kind.values())
                running.append(index)
        elif op == "grow":
            fresh += 1
            cache.grow(running[family % len(running)], [fresh])
        else:
            cache.finish(running.pop(family % len(running)))
        cache.check_invariants()
    for req in running:
        cache.finish(req)
    cache.check_invariants()
    assert cache.pinned == 0


# ---------------------------------------------------------------- the hybrid replay


def test_hybrid_replay_reports_the_junction_and_each_kind():
    trace = synthetic_trace("multi-turn", seed=3)
    rows = run_hybrid_replay(
        trace, NEMOTRON, ["lru", "cost", "vllm-stock"], [0.1], full_attention_arms=["cost"]
    )
    by_arm = {(row.model, row.policy): row for row in rows}
    for policy in ("lru", "cost"):
        row = by_arm[("nemotron-h-like", policy)]
        assert row.requests == len(trace.requests)
        assert 0 < row.junction_hit_ratio <= min(row.kind_hit_ratio.values()) + 1e-12
        assert set(row.held_gib) == {"full_attention", "mamba"}
    reference = by_arm[("nemotron-h-like (all full attention)", "cost")]
    assert set(reference.kind_hit_ratio) == {"full_attention"}
    assert reference.junction_hit_ratio == pytest.approx(reference.kind_hit_ratio["full_attention"])


def test_hybrid_arm_reads_the_prompt_end_before_a_partial_block():
    arm = HybridKVPlugArm(NEMOTRON, 100 * NEMOTRON.page_bytes(BT), BT, "lru")
    partial = 1 << 41  # a fresh id, as the replay gives a partial last block
    assert arm.admit(1, [1, 2, 3, partial], 4) == 0
    arm.finish(1)
    assert {node.depth for node in arm.cache.nodes() if node.checkpoint} == {3}
    assert arm.admit(2, [1, 2, 3, 4, 5], 5) == 3


def test_hybrid_replay_command(tmp_path):
    result = CliRunner().invoke(
        main,
        [
            "replay-hybrid",
            "synthetic:agent-loop",
            "--model",
            "gemma3-like",
            "--policy",
            "lru,cost",
            "--capacity-fractions",
            "0.1",
            "--quiet",
        ],
    )
    assert result.exit_code == 0, result.output
    assert "junction" in result.output and "sliding_window" in result.output
    bad = CliRunner().invoke(main, ["replay-hybrid", "synthetic:agent-loop", "--policy", "x"])
    assert bad.exit_code != 0 and "unknown hybrid arm 'x'" in bad.output
