"""Traces, synthetic workloads, the replay loop, the runner, reports and the CLI."""

from __future__ import annotations

import json
from collections import Counter
from pathlib import Path

import click
import pytest
from click.testing import CliRunner

from kvplug.cli import main
from kvplug.core.model_spec import PRESETS, ModelSpec, kv_budget, load_model
from kvplug.errors import ConfigError, KVPlugError, UnknownPolicyError
from kvplug.policies import make_policy
from kvplug.replay.arms import FRESH_UNIT_BASE, KVPlugArm
from kvplug.replay.cli import bundled_trace_path, load_trace
from kvplug.replay.loop import Timing, make_jobs, replay
from kvplug.replay.runner import run_replay
from kvplug.replay.synthetic import SYNTHETIC_NAMES, synthetic_trace
from kvplug.replay.trace import Trace, TraceError, TraceRequest, read_trace, write_trace

MOONCAKE = (
    Path(__file__).resolve().parents[2] / "shared" / "traces" / "mooncake_synthetic_trace.jsonl"
)
MODEL = load_model(None)


def _write(tmp_path: Path, rows: list, name: str = "t.jsonl") -> Path:
    path = tmp_path / name
    path.write_text("\n".join(r if isinstance(r, str) else json.dumps(r) for r in rows) + "\n")
    return path


def _mc(ts: int, n: int, ids: list[int], out: int = 10) -> dict:
    return {"timestamp": ts, "input_length": n, "output_length": out, "hash_ids": ids}


# ---------------------------------------------------------------- traces


def test_reads_mooncake_lines(tmp_path) -> None:
    path = _write(tmp_path, [_mc(1000, 1024, [1, 2]), _mc(1500, 1100, [1, 2, 3])])
    trace = read_trace(path)
    assert trace.block_tokens == 512
    assert [r.arrival for r in trace.requests] == [0.0, 0.5]
    assert trace.distinct_blocks == 3 and trace.prompt_blocks == 5


def test_reads_bailian_lines(tmp_path) -> None:
    row = {
        "chat_id": 7, "parent_chat_id": -1, "timestamp": 2.5, "input_length": 40,
        "output_length": 5, "type": "text", "turn": 1, "hash_ids": [9, 8, 7],
    }  # fmt: skip
    trace = read_trace(_write(tmp_path, [row, {**row, "timestamp": 3.0, "chat_id": 8}]))
    assert trace.block_tokens == 16
    assert trace.requests[1].arrival == 0.5 and trace.requests[1].session == "8"


@pytest.mark.parametrize(
    ("rows", "message"),
    [
        (["{not json"], r"t.jsonl:1: invalid JSON"),
        ([_mc(0, 10, [1]), {"timestamp": 1, "input_length": 3, "hash_ids": [1]}],
         r"t.jsonl:2: missing field 'output_length'"),
        ([_mc(0, 1024, [1])], r"1 hash_ids for input_length 1024; .* 2 are needed"),
        ([_mc(0, 1024, [1, 2]), _mc(1, 1024, [3, 2])],
         r"t.jsonl:2: hash id 2 at block 1 follows id 3, but on line 1 it follows id 1"),
        ([_mc(5, 10, [1]), _mc(4, 10, [2])], r"t.jsonl:2: timestamp 4 is earlier"),
        ([_mc(0, 10, ["a"])], r"'hash_ids' must be a list of integers"),
        ([_mc(0, 0, [])], r"'input_length' must be an integer >= 1"),
        (["[1, 2]"], r"must be a JSON object"),
    ],
)  # fmt: skip
def test_malformed_traces_name_the_line_and_the_problem(tmp_path, rows, message) -> None:
    with pytest.raises(TraceError, match=message):
        read_trace(_write(tmp_path, rows))


def test_unknown_format_and_missing_file(tmp_path) -> None:
    with pytest.raises(TraceError, match="accepted: mooncake, bailian"):
        read_trace(_write(tmp_path, [_mc(0, 10, [1])]), fmt="csv")
    with pytest.raises(TraceError, match="cannot read trace"):
        read_trace(tmp_path / "nope.jsonl")


def test_write_then_read_round_trips(tmp_path) -> None:
    trace = synthetic_trace("multi-turn", duration=60)
    again = read_trace(write_trace(trace, tmp_path / "x.jsonl"))  # checks the prefix chain too
    assert [r.hash_ids for r in again.requests] == [r.hash_ids for r in trace.requests]
    assert [r.input_length for r in again.requests] == [r.input_length for r in trace.requests]


def test_bailian_conversations_follow_parent_chat_ids(tmp_path) -> None:
    row = {
        "chat_id": 1, "parent_chat_id": -1, "timestamp": 1.0, "input_length": 20,
        "output_length": 5, "type": "text", "turn": 1, "hash_ids": [1, 2],
    }  # fmt: skip
    rows = [row, {**row, "chat_id": 2}, {**row, "chat_id": 3, "parent_chat_id": 1, "turn": 2}]
    trace = read_trace(_write(tmp_path, rows))
    assert [(r.session, r.turn) for r in trace.requests] == [("1", 1), ("2", 1), ("1", 2)]


def test_write_bailian_splits_blocks_and_chains_turns(tmp_path) -> None:
    trace = synthetic_trace("conversations", duration=120)
    again = read_trace(write_trace(trace, tmp_path / "b.jsonl", fmt="bailian"))
    assert again.block_tokens == 16 and len(again.requests) == len(trace.requests)
    assert [r.turn for r in again.requests] == [r.turn for r in trace.requests]
    chats: dict[str, str] = {}  # the written conversations are the generated ones
    for old, new in zip(trace.requests, again.requests, strict=True):
        assert chats.setdefault(old.session, new.session) == new.session
        assert len(new.hash_ids) == -(-old.input_length // 16)
    assert len(set(chats.values())) == len(chats)


# ---------------------------------------------------------------- synthetic workloads


def test_multi_adapter_blocks_never_cross_adapters() -> None:
    trace = synthetic_trace("multi-adapter", duration=300)
    owner: dict[int, str] = {}
    for r in trace.requests:
        for h in r.hash_ids:
            assert owner.setdefault(h, r.session) == r.session
    popularity = Counter(r.session for r in trace.requests).most_common()
    assert len(popularity) > 10 and popularity[0][1] > 5 * popularity[-1][1]


def test_conversation_turns_extend_their_history() -> None:
    trace = synthetic_trace("conversations", duration=600)
    last: dict[str, TraceRequest] = {}
    gaps = []
    for r in trace.requests:
        before = last.get(r.session)
        assert r.turn == (before.turn + 1 if before else 1)
        if before:
            full = before.input_length // 512
            assert r.hash_ids[:full] == before.hash_ids[:full]
            gaps.append(r.arrival - before.arrival)
        last[r.session] = r
    gaps.sort()
    assert 10 < gaps[len(gaps) // 2] < 120 and gaps[-1] > 300  # think times, and long pauses


def test_synthetic_source_takes_a_seed() -> None:
    assert (
        load_trace("synthetic:agent-loop:5").requests
        == synthetic_trace("agent-loop", seed=5).requests
    )
    with pytest.raises(click.BadParameter):
        load_trace("synthetic:agent-loop:x")


@pytest.mark.parametrize("name", SYNTHETIC_NAMES)
def test_synthetic_workloads_are_seeded_and_prefix_chained(name, tmp_path) -> None:
    a, b = synthetic_trace(name, seed=3, duration=120), synthetic_trace(name, seed=3, duration=120)
    assert a.requests == b.requests and len(a.requests) > 20
    assert synthetic_trace(name, seed=4, duration=120).requests != a.requests
    assert a.distinct_blocks < a.prompt_blocks  # something is reused
    read_trace(write_trace(a, tmp_path / "s.jsonl"))


def test_unknown_synthetic_workload() -> None:
    with pytest.raises(KVPlugError, match="accepted: system-prompts, multi-turn, agent-loop"):
        synthetic_trace("chatbot")


def test_bundled_trace_is_the_seeded_generator_output() -> None:
    bundled = read_trace(bundled_trace_path())
    fresh = synthetic_trace("mixed", seed=7, duration=300, rate=4)
    assert [r.hash_ids for r in bundled.requests] == [r.hash_ids for r in fresh.requests]


# ---------------------------------------------------------------- the replay loop


def _tiny() -> Trace:
    r = TraceRequest
    return Trace(
        "tiny",
        512,
        [
            r(0.0, 1536, 10, (1, 2, 3)),  # three full blocks
            r(1.0, 1300, 10, (1, 2, 4)),  # two full blocks, then a partial one
            r(2.0, 1536, 10, (1, 2, 3)),  # fully cached in the sequential replay
            r(3.0, 600, 10, (9, 10)),
        ],
    )


def test_jobs_use_trace_ids_for_full_blocks_and_fresh_ids_otherwise() -> None:
    jobs = make_jobs(_tiny(), MODEL)
    assert jobs[0].prompt == [1, 2, 3]
    assert jobs[1].prompt[:2] == [1, 2] and jobs[1].prompt[2] >= FRESH_UNIT_BASE
    assert jobs[0].prefix_flops[3] == pytest.approx(MODEL.prefill_flops(0, 1536))
    assert jobs[3].decode == []  # 600 + 10 tokens stay within its two blocks


def test_sequential_replay_counts_a_fully_cached_prompt_as_a_full_hit() -> None:
    arm = KVPlugArm("lru", make_policy("lru"), 64)
    c = replay(arm, make_jobs(_tiny(), MODEL), 512, sequential=True)
    assert c.hit_tokens == 0 + 1024 + 1536 + 0
    assert c.prompt_tokens == 1536 + 1300 + 1536 + 600


def test_realistic_replay_leaves_the_last_token_to_compute() -> None:
    arm = KVPlugArm("lru", make_policy("lru"), 64)
    c = replay(arm, make_jobs(_tiny(), MODEL), 512)
    assert c.hit_tokens == 0 + 1024 + 1024 + 0
    arm.cache.check_invariants()
    assert not arm.cache.requests


def test_realistic_replay_waits_preempts_and_rejects() -> None:
    r = TraceRequest
    growing = [r(0.0, 2048, 2000, (i, i + 100, i + 200, i + 300)) for i in range(6)]
    oversized = r(0.1, 512 * 40, 1, tuple(range(1000, 1040)))
    trace = Trace("crowd", 512, [*growing, oversized])
    arm = KVPlugArm("lru", make_policy("lru"), 24)
    c = replay(arm, make_jobs(trace, MODEL), 512, timing=Timing(decode_tps=100.0))
    assert c.waited and c.preemptions and c.rejected == 1
    assert c.requests == 6  # every request but the oversized one ran
    arm.cache.check_invariants()


def test_runner_reports_every_arm_and_capacity() -> None:
    rows = run_replay(
        synthetic_trace("mixed", duration=120), ["lru", "cost", "belady"], [40, 400], MODEL
    )
    assert [(r.policy, r.capacity_blocks) for r in rows] == [
        ("lru", 40), ("cost", 40), ("belady", 40), ("lru", 400), ("cost", 400), ("belady", 400)
    ]  # fmt: skip
    for r in rows:
        assert 0 <= r.hit_ratio <= 1 and 0 <= r.saved_compute_ratio <= 1
        assert r.churn <= r.evictions and r.bytes_held > 0


def test_runner_rejects_unknown_arms_listing_the_accepted_ones() -> None:
    with pytest.raises(UnknownPolicyError, match="accepted: belady, cost, .* vllm-stock"):
        run_replay(_tiny(), ["lru", "fifo"], [10], MODEL)


def test_missing_engines_are_reported_unavailable_not_replaced() -> None:
    import importlib.util

    rows = run_replay(_tiny(), ["vllm-stock", "sglang-stock:lru"], [10], MODEL)
    for row, engine in zip(rows, ("vllm", "sglang"), strict=True):
        installed = importlib.util.find_spec(engine) is not None
        assert row.available == installed
        if not installed:
            assert engine in row.note.lower() and row.hit_ratio == 0


@pytest.mark.skipif(not MOONCAKE.exists(), reason="needs ../shared/traces (the Mooncake trace)")
@pytest.mark.parametrize("sequential", [True, False], ids=["sequential", "realistic"])
def test_cost_beats_lru_on_the_mooncake_trace(sequential: bool) -> None:
    """The issue's claims, checked: at 2, 5, 10 and 25% of the trace's distinct blocks,
    `cost` saves more prefill compute than `lru` and its hit ratio is never more than one
    point below. (Margins are printed by `kvplug replay`, not asserted here.)"""
    trace = read_trace(MOONCAKE)
    caps = [round(f * trace.distinct_blocks) for f in (0.02, 0.05, 0.1, 0.25)]
    rows = run_replay(trace, ["lru", "cost"], caps, MODEL, sequential=sequential)
    lru = {r.capacity_blocks: r for r in rows if r.policy == "lru"}
    for r in (r for r in rows if r.policy == "cost"):
        base = lru[r.capacity_blocks]
        assert r.saved_compute_ratio > base.saved_compute_ratio, r.capacity_blocks
        assert r.hit_ratio >= base.hit_ratio - 0.01, r.capacity_blocks


# ---------------------------------------------------------------- cost model and budget


def test_budget_worksheet_matches_the_reference_numbers() -> None:
    model = ModelSpec("ref", 80, 8192, 64, 8, 128, 28672)
    assert model.kv_bytes_per_token() == 320 * 1024
    b = kv_budget(model, 80, tp=4, weights_gib=140, overhead_gib=3, context_lengths=(4000, 32000))
    assert b.weights_per_rank_gib == 35 and b.kv_memory_per_rank_gib == 42
    assert 545_000 < b.max_kv_tokens < 555_000
    assert b.max_sequences == {4000: 137, 32000: 17}
    assert b.recommended_max_num_seqs == {4000: 116, 32000: 14}


def test_budget_computes_weights_from_the_config() -> None:
    b = kv_budget(PRESETS["llama-3.1-8b"], 80)
    assert 14 < b.weights_per_rank_gib < 16  # about 8B parameters in bf16
    with pytest.raises(ConfigError, match="no memory left for KV"):
        kv_budget(PRESETS["llama-3.1-70b"], 80)


def test_prefill_flops_grow_with_position() -> None:
    m = PRESETS["llama-3.1-8b"]
    assert m.prefill_flops(0, 512) < m.prefill_flops(16384, 16896)
    assert m.prefill_flops(0, 1024) == pytest.approx(
        m.prefill_flops(0, 512) + m.prefill_flops(512, 1024)
    )


def test_model_from_hf_config(tmp_path) -> None:
    cfg = {"hidden_size": 256, "num_attention_heads": 8, "num_key_value_heads": 2,
           "num_hidden_layers": 4, "intermediate_size": 512, "torch_dtype": "float16"}  # fmt: skip
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    m = load_model(tmp_path)
    assert (m.head_dim, m.kv_heads, m.dtype) == (32, 2, "float16")
    assert m.kv_bytes_per_token() == 2 * 4 * 2 * 32 * 2
    (tmp_path / "config.json").write_text(json.dumps({"hidden_size": 8}))
    with pytest.raises(ConfigError, match="lacks 'num_attention_heads'"):
        load_model(tmp_path)
    with pytest.raises(ConfigError, match="neither a preset"):
        load_model("gpt-17")


# ---------------------------------------------------------------- CLI


def test_replay_cli_json_and_plot(tmp_path) -> None:
    plot = tmp_path / "p.png"
    args = ["replay", "synthetic:system-prompts", "--policy", "lru,cost", "--capacity-blocks",
            "50,200", "--format", "json", "--plot", str(plot), "--quiet"]  # fmt: skip
    result = CliRunner().invoke(main, args)
    assert result.exit_code == 0, result.output
    rows = json.loads(result.stdout)
    assert {(r["policy"], r["capacity_blocks"]) for r in rows} == {
        ("lru", 50),
        ("cost", 50),
        ("lru", 200),
        ("cost", 200),
    }
    assert {"hit_ratio", "saved_compute_ratio", "saved_flops", "bytes_held", "evictions",
            "churn", "preemptions"} <= set(rows[0])  # fmt: skip
    assert plot.stat().st_size > 1000


def test_replay_cli_errors_are_clear(tmp_path) -> None:
    bad = _write(tmp_path, [_mc(0, 10, [1]), "oops"])
    result = CliRunner().invoke(main, ["replay", str(bad), "--policy", "lru"])
    assert result.exit_code == 2 and "t.jsonl:2: invalid JSON" in result.output
    result = CliRunner().invoke(main, ["replay", str(bad), "--policy", "mru"])
    assert result.exit_code == 2 and "unknown arm 'mru'" in result.output
    good = _write(tmp_path, [_mc(0, 10, [1])], "good.jsonl")
    result = CliRunner().invoke(main, ["replay", str(good), "--capacity-blocks", "0"])
    assert result.exit_code == 2 and "positive" in result.output


def test_ab_runs_on_the_bundled_trace(tmp_path) -> None:
    args = ["ab", "--capacity-blocks", "100,400", "--plot", str(tmp_path / "ab.png"), "--quiet"]
    result = CliRunner().invoke(main, args)
    assert result.exit_code == 0, result.output
    for arm in ("cost", "lru", "belady", "vllm-stock", "vllm-kvplug:cost", "sglang-stock:lru"):
        assert arm in result.output
    assert (tmp_path / "ab.png").exists()


def test_budget_cli() -> None:
    args = ["budget", "--model", "llama-3.1-70b", "--gpu-memory", "80", "--tp", "4",
            "--weights-gib", "140", "--overhead-gib", "3", "--context", "4000,32000"]  # fmt: skip
    result = CliRunner().invoke(main, args)
    assert result.exit_code == 0, result.output
    assert "550,502" in result.output and "116" in result.output and "14" in result.output
