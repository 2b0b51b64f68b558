"""The server A/B harness (`kvplug.serving`): workloads, stream parsing, metrics text,
statistics, reports, the server process and the CLI; and, marked ``vllm_server``, a run of
the stock arm against a real vLLM server with a tiny model."""

from __future__ import annotations

import importlib.util
import json
import math
import os
import sys
import textwrap
import time
from pathlib import Path

import pytest
from click.testing import CliRunner

from kvplug.cli import main
from kvplug.core.model_spec import ModelSpec
from kvplug.errors import ConfigError
from kvplug.serving.ab import (
    ABConfig,
    ABResult,
    Arm,
    kvplug_arm,
    model_max_positions,
    run_ab,
    stock_arm,
)
from kvplug.serving.client import SKIPPED, RequestResult, StreamState, request_body
from kvplug.serving.engines import SGLANG, VLLM, ServerBudget, sglang_command, sglang_kvplug_args
from kvplug.serving.metrics import parse_metrics
from kvplug.serving.report import ROWS, plot, render, table
from kvplug.serving.server import (
    PortTakenError,
    Server,
    ServerError,
    free_port,
    start_on_free_port,
    vllm_command,
)
from kvplug.serving.stats import (
    ArmSummary,
    combine,
    percentile,
    request_compute_saved,
    slowest_requests,
    spread,
    summarize,
)
from kvplug.serving.vllm_bench import (
    BenchClientError,
    PrefixRepetition,
    bench_command,
    parse_bench_args,
    run_bench,
    summarize_bench,
)
from kvplug.serving.workload import (
    ASSISTANT_LABEL,
    MESSAGE_TOKENS,
    QUESTION_TOKENS,
    SYSTEM_PROMPTS,
    SYSTEM_TOKENS,
    TURNS,
    WORKLOADS,
    build_workload,
    whitespace_tokens,
)

SPEC = ModelSpec("tiny", layers=2, hidden_size=64, q_heads=2, kv_heads=1, head_dim=32,
                 intermediate_size=128, vocab_size=512, dtype="float32")  # fmt: skip


def installed(module: str) -> bool:
    return importlib.util.find_spec(module) is not None


def _model_dir(tmp_path: Path) -> Path:
    model = tmp_path / "model"
    model.mkdir()
    config = {"hidden_size": 64, "num_attention_heads": 2, "num_key_value_heads": 1,
              "num_hidden_layers": 2, "head_dim": 32, "intermediate_size": 128,
              "vocab_size": 512, "max_position_embeddings": 4096}  # fmt: skip
    (model / "config.json").write_text(json.dumps(config))
    return model


# ---------------------------------------------------------------- workloads


@pytest.mark.parametrize("name", WORKLOADS)
@pytest.mark.parametrize("requests", [1, 2, 7, 160])
def test_workloads_are_seeded_and_exact_in_size(name: str, requests: int) -> None:
    workload = build_workload(name, requests, seed=3)
    assert workload == build_workload(name, requests, seed=3)
    assert workload.requests == requests
    assert all(1 <= len(c.messages) <= TURNS for c in workload.conversations)
    if requests >= 7:
        assert workload != build_workload(name, requests, seed=4)


def test_system_prompts_share_a_few_long_prefixes() -> None:
    workload = build_workload("system-prompts", 200)
    prefixes = [c.prefix for c in workload.conversations]
    assert all(len(c.messages) == 1 for c in workload.conversations)
    assert 1 < len(set(prefixes)) <= SYSTEM_PROMPTS
    for prefix in set(prefixes):
        assert SYSTEM_TOKENS <= whitespace_tokens(prefix) <= SYSTEM_TOKENS + 2
    questions = [c.messages[0] for c in workload.conversations]
    assert len(set(questions)) == len(questions)
    low, high = QUESTION_TOKENS
    assert all(low <= whitespace_tokens(q) <= high for q in questions)
    # Zipf popularity: the most popular prompt is well ahead of the least
    counts = sorted((prefixes.count(p) for p in set(prefixes)), reverse=True)
    assert counts[0] > 2 * counts[-1]


def test_multi_turn_prompts_grow_by_history() -> None:
    workload = build_workload("multi-turn", 14)
    assert [len(c.messages) for c in workload.conversations] == [TURNS, TURNS, 2]
    chat = workload.conversations[0]
    assert chat.prefix == ""
    low, high = MESSAGE_TOKENS
    assert all(low <= whitespace_tokens(m) <= high for m in chat.messages[1:])
    answers = [f" answer {i}" for i in range(TURNS)]
    previous = chat.prompt(0, [])
    assert previous.endswith(ASSISTANT_LABEL) and chat.messages[0] in previous
    for turn in range(1, TURNS):
        prompt = chat.prompt(turn, answers[:turn])
        assert prompt.startswith(previous + answers[turn - 1])
        assert prompt.endswith(chat.messages[turn] + "\n" + ASSISTANT_LABEL)
        previous = prompt
    with pytest.raises(ValueError, match="needs 2 earlier answers"):
        chat.prompt(2, ["only one"])
    # estimates bound the real lengths (whitespace counter, answers of max_tokens words)
    full = chat.prompt(TURNS - 1, [" x" * chat.max_tokens] * TURNS)
    assert whitespace_tokens(full) <= chat.prompt_tokens


@pytest.mark.parametrize("output_tokens", [1, 64])
def test_output_tokens_bound_every_answer_and_the_estimates_follow(output_tokens: int) -> None:
    own = build_workload("mixed", 60, seed=2)
    workload = build_workload("mixed", 60, seed=2, output_tokens=output_tokens)
    assert {c.max_tokens for c in workload.conversations} == {output_tokens}
    for before, after in zip(own.conversations, workload.conversations, strict=True):
        assert (before.prefix, before.messages) == (after.prefix, after.messages)
        turns = len(after.messages)  # answers at the new length still fit the estimate
        longest = after.prompt(turns - 1, [" x" * output_tokens] * turns)
        assert whitespace_tokens(longest) <= after.prompt_tokens
    with pytest.raises(ConfigError, match="output tokens must be at least 1, got 0"):
        build_workload("mixed", 60, output_tokens=0)


def test_mixed_interleaves_both_kinds() -> None:
    workload = build_workload("mixed", 60)
    kinds = [c.kind for c in workload.conversations]
    assert set(kinds) == {"system-prompts", "multi-turn"}
    assert sum(len(c.messages) for c in workload.conversations if c.kind == "multi-turn") == 30
    assert kinds != sorted(kinds)  # not one block after the other
    assert "30 behind" in workload.describe() and "chats" in workload.describe()


def test_workload_lengths_follow_the_token_counter() -> None:
    def two_per_word(text: str) -> int:
        return 2 * len(text.split())

    workload = build_workload("system-prompts", 20, count=two_per_word)
    prefix = workload.conversations[0].prefix
    assert SYSTEM_TOKENS <= two_per_word(prefix) <= SYSTEM_TOKENS + 4
    assert whitespace_tokens(prefix) < SYSTEM_TOKENS * 0.6


def test_unknown_workload_names_the_accepted_ones() -> None:
    with pytest.raises(ConfigError, match="unknown workload 'chat'.*system-prompts, multi-turn"):
        build_workload("chat", 10)
    with pytest.raises(ConfigError, match="at least 1 request"):
        build_workload("mixed", 0)


# ---------------------------------------------------------------- statistics


def test_percentile_interpolates_like_numpy() -> None:
    values = [float(v) for v in range(10, 0, -1)]  # unsorted on purpose
    assert percentile(values, 50) == pytest.approx(5.5)
    assert percentile(values, 99) == pytest.approx(9.91)
    assert percentile(values, 0) == 1.0 and percentile(values, 100) == 10.0
    assert percentile([7.0], 99) == 7.0
    assert math.isnan(percentile([], 50))
    with pytest.raises(ValueError):
        percentile(values, 101)


def _result(conv: int, prompt: int, cached: int, ttft: float, ok: bool = True) -> RequestResult:
    return RequestResult(conv, 0, ok=ok, error="" if ok else "HTTP 500: x",
                         prompt_tokens=prompt, cached_tokens=cached,
                         completion_tokens=10, ttft_s=ttft)  # fmt: skip


def test_summary_names_the_slowest_requests() -> None:
    """The JSON keeps what a TTFT p99 is made of: the slowest requests, slowest first, with
    when each was sent (after the first) and how much of it was cached; failures never."""
    results = [_result(i, 100, 32 * (i % 2), 0.01 * (i + 1)) for i in range(10)]
    for i, result in enumerate(results):
        result.sent_at = 50.0 + i
    results.append(_result(10, 100, 0, 9.0, ok=False))
    slowest = summarize("arm", results, 2.0, SPEC).slowest
    assert [row["conversation"] for row in slowest] == [9, 8, 7, 6, 5, 4, 3, 2]
    assert slowest[0] == {"conversation": 9, "turn": 0, "sent_s": 9.0, "ttft_ms": 100.0,
                          "prompt_tokens": 100, "cached_tokens": 32}  # fmt: skip
    assert slowest_requests([]) == []


def test_summary_ratios_and_saved_compute() -> None:
    results = [_result(0, 100, 0, 0.01), _result(1, 100, 64, 0.02), _result(2, 200, 96, 0.03),
               _result(3, 50, 0, 0.0, ok=False)]  # fmt: skip
    summary = summarize("arm", results, 2.0, SPEC)
    assert (summary.requests, summary.succeeded, summary.failed) == (4, 3, 1)
    assert summary.errors == ["HTTP 500: x"]
    assert summary.prompt_tokens == 400 and summary.cached_tokens == 160
    assert summary.cached_token_ratio == pytest.approx(0.4)
    assert summary.request_throughput == pytest.approx(1.5)
    assert summary.output_throughput == pytest.approx(15.0)
    assert summary.ttft_p50_ms == pytest.approx(20.0)
    saved = SPEC.prefill_flops(0, 64) + SPEC.prefill_flops(0, 96)
    total = 2 * SPEC.prefill_flops(0, 100) + SPEC.prefill_flops(0, 200)
    assert summary.prefill_compute_saved == pytest.approx(saved / total)
    per_request = [0, request_compute_saved(SPEC, 100, 64), request_compute_saved(SPEC, 200, 96)]
    assert summary.mean_request_compute_saved == pytest.approx(sum(per_request) / 3)
    # deeper tokens cost more, so a cached prefix saves less than its share of tokens
    assert 0 < request_compute_saved(SPEC, 100, 64) < 0.64
    assert request_compute_saved(SPEC, 100, 100) == 1.0
    assert request_compute_saved(SPEC, 0, 0) == 0.0
    assert summary.server_prefix_cache_queries is None  # no metrics given


# ---------------------------------------------------------------- metrics text

METRICS_TEXT = textwrap.dedent("""\
    # HELP vllm:prefix_cache_queries_total Prefix cache queries, in tokens.
    # TYPE vllm:prefix_cache_queries_total counter
    vllm:prefix_cache_queries_total{engine="0",model_name="/m"} 1000.0
    vllm:prefix_cache_queries_total{engine="1",model_name="/m"} 24.0
    # TYPE vllm:prefix_cache_queries_created gauge
    vllm:prefix_cache_queries_created{engine="0",model_name="/m"} 1.79e+09
    # TYPE vllm:prefix_cache_hits_total counter
    vllm:prefix_cache_hits_total{engine="0",model_name="/m {x} \\" y"} 512.0
    # TYPE vllm:num_preemptions_total counter
    vllm:num_preemptions_total{engine="0"} 3.0
    # TYPE vllm:kv_cache_usage_perc gauge
    vllm:kv_cache_usage_perc{engine="0"} 0.25
    # TYPE kvplug_evictions counter
    kvplug_evictions_total{policy="cost"} 40
    # TYPE kvplug_cached_blocks gauge
    kvplug_cached_blocks{policy="cost"} 90
    # TYPE kvplug_victim_rank histogram
    kvplug_victim_rank_bucket{le="1.0"} 4
    kvplug_victim_rank_sum 12.5
    kvplug_victim_rank_count 4
    kvplug_victim_rank_created 1.79e+09
    process_start_time_seconds 1.7e+09
    broken_line{unclosed="x" 3
    no_value
    """)


def test_metrics_text_is_parsed_and_summed_over_labels() -> None:
    metrics = parse_metrics(METRICS_TEXT)
    assert metrics.get("vllm:prefix_cache_queries") == 1024.0
    assert metrics.get("vllm:prefix_cache_hits") == 512.0
    assert metrics.get("vllm:num_preemptions") == 3.0
    assert metrics.get("vllm:kv_cache_usage_perc") == 0.25
    assert metrics.get("vllm:no_such_metric") is None
    assert "broken_line" not in metrics.values and "no_value" not in metrics.values
    assert metrics.kvplug() == {"kvplug_cached_blocks": 90.0, "kvplug_evictions_total": 40.0,
                                "kvplug_victim_rank_count": 4.0,
                                "kvplug_victim_rank_sum": 12.5}  # fmt: skip


def test_metrics_since_subtracts_counters_only() -> None:
    before = parse_metrics(METRICS_TEXT)
    after = parse_metrics(
        METRICS_TEXT.replace("} 1000.0", "} 1500.0")
        .replace('kvplug_cached_blocks{policy="cost"} 90', "kvplug_cached_blocks 70")
        .replace("kvplug_victim_rank_count 4", "kvplug_victim_rank_count 9")
    )
    delta = after.since(before)
    assert delta.get("vllm:prefix_cache_queries") == 500.0
    assert delta.get("vllm:prefix_cache_hits") == 0.0
    assert delta.get("vllm:kv_cache_usage_perc") == 0.25  # a gauge: the value now
    assert delta.kvplug()["kvplug_cached_blocks"] == 70.0
    assert delta.kvplug()["kvplug_victim_rank_count"] == 5.0
    assert not any(name.endswith("_created") for name in delta.values)


# ---------------------------------------------------------------- the event stream


def _events(*chunks: dict | str) -> list[bytes]:
    return [(f"data: {c if isinstance(c, str) else json.dumps(c)}\n").encode() for c in chunks] + [
        b"\n"
    ]


def test_stream_state_times_the_first_token_and_reads_usage() -> None:
    usage = {"prompt_tokens": 700, "completion_tokens": 3,
             "prompt_tokens_details": {"cached_tokens": 672}}  # fmt: skip
    lines = [b": keep-alive\n"] + _events(
        {"choices": [{"index": 0, "text": "a"}]},
        {"choices": [{"index": 0, "text": ""}]},  # a partial UTF-8 token is still a token
        {"choices": [{"index": 0, "text": "b", "finish_reason": "length"}]},
        {"choices": [], "usage": usage},
        "[DONE]",
    )
    state = StreamState(started=10.0)
    for i, line in enumerate(lines):
        state.feed(line, now=10.0 + 0.1 * i)
    assert state.done
    result = state.result(conversation=2, turn=1, now=11.0)
    assert result.ok and result.error == ""
    assert result.ttft_s == pytest.approx(0.1)
    assert result.latency_s == pytest.approx(1.0)
    assert (result.prompt_tokens, result.cached_tokens, result.completion_tokens) == (700, 672, 3)
    assert result.text == "ab"


def test_stream_state_reports_what_went_wrong() -> None:
    state = StreamState(0.0)
    for line in _events({"choices": [{"text": "x"}]}, "[DONE]"):
        state.feed(line, 1.0)
    assert state.result(0, 0, 1.0).error == "the stream ended without usage"
    state = StreamState(0.0)
    state.feed(b'data: {"error": {"message": "too long", "code": 400}}\n', 1.0)
    result = state.result(0, 0, 1.0)
    assert not result.ok and "too long" in result.error
    state = StreamState(0.0)
    state.feed("data: {not json\n", 1.0)
    assert "bad event" in state.result(0, 0, 1.0).error
    state = StreamState(0.0)
    state.feed(b'data: {"choices": [], "usage": {"prompt_tokens": 5}}\n', 1.0)
    assert state.result(0, 0, 1.0).error == "the stream carried no token"


def test_request_body_asks_for_usage_and_fixed_lengths() -> None:
    body = request_body("m", "hello", 16, seed=1)
    assert body["stream"] is True and body["stream_options"] == {"include_usage": True}
    assert body["ignore_eos"] is True and body["max_tokens"] == 16 and body["prompt"] == "hello"


# ---------------------------------------------------------------- arms and commands


def test_vllm_command_and_arms() -> None:
    argv = vllm_command("/models/tiny", 1234, num_blocks=64, max_model_len=2016)
    assert argv[:3] == [sys.executable, "-m", "vllm.entrypoints.openai.api_server"]
    text = " ".join(argv)
    for part in ("--model /models/tiny", "--host 127.0.0.1", "--port 1234", "--enforce-eager",
                 "--block-size 32", "--num-gpu-blocks-override 64", "--max-model-len 2016",
                 "--seed 0", "--enable-prompt-tokens-details"):  # fmt: skip
        assert part in text
    assert stock_arm().extra_args == () and stock_arm().missing() is None
    arm = kvplug_arm({"policy": "lru"})
    assert arm.extra_args[:2] == ("--scheduler-cls", "kvplug.vllm.Scheduler")
    assert json.loads(arm.extra_args[3]) == {"kvplug": {"policy": "lru"}}
    assert kvplug_arm().extra_args == ("--scheduler-cls", "kvplug.vllm.Scheduler")
    missing = kvplug_arm(scheduler_cls="kvplug_no_such_pkg.Scheduler")
    assert missing.missing() == "kvplug_no_such_pkg is not importable"
    extra = vllm_command("/m", 1, num_blocks=2, max_model_len=32, extra_args=arm.extra_args)
    assert extra[-4:] == list(arm.extra_args)


def test_sglang_command_and_arms() -> None:
    argv = sglang_command("/models/tiny", 1234, max_total_tokens=2048, context_length=1024,
                          cpu=True)  # fmt: skip
    assert argv[:3] == [sys.executable, "-m", "sglang.launch_server"]
    text = " ".join(argv)
    for part in ("--model-path /models/tiny", "--host 127.0.0.1", "--port 1234",
                 "--max-total-tokens 2048", "--context-length 1024", "--random-seed 0",
                 "--enable-metrics", "--enable-cache-report", "--device cpu",
                 "--attention-backend torch_native"):  # fmt: skip
        assert part in text
    assert "--device" not in sglang_command("/m", 1, max_total_tokens=64, context_length=32,
                                            cpu=False)  # fmt: skip
    budget = ServerBudget(Path("/m"), 7, num_blocks=64, block_size=32, max_model_len=2016)
    assert "--max-total-tokens 2048" in " ".join(SGLANG.command(budget, ()))
    assert "--num-gpu-blocks-override 64" in " ".join(VLLM.command(budget, ()))
    assert SGLANG.stock_arm().name == "sglang-stock" and SGLANG.stock_arm().extra_args == ()
    arm = SGLANG.kvplug_arm({"policy": "lru", "policy_config": {"x": 1}})
    assert arm.name == "kvplug" and arm.requires == "kvplug.sglang"
    assert arm.extra_args[:4] == ("--radix-cache-backend", "kvplug",
                                  "--radix-eviction-policy", "kvplug-lru")  # fmt: skip
    assert json.loads(arm.extra_args[5]) == {"policy_config": {"x": 1}}
    assert sglang_kvplug_args() == ("--radix-cache-backend", "kvplug",
                                    "--radix-eviction-policy", "kvplug-cost")  # fmt: skip
    assert VLLM.kvplug_arm({"policy": "lru"}).extra_args == kvplug_arm({"policy": "lru"}).extra_args


def test_repeated_runs_combine_to_medians_with_their_spread() -> None:
    figures = ((10, 0.03, 1.0), (30, 0.01, 3.0), (20, 0.02, 2.0))  # cached, TTFT, wall
    runs = [summarize("kvplug", [_result(0, 100, c, t)], w, SPEC) for c, t, w in figures]
    runs.append(ArmSummary("kvplug", available=False, note="the server died"))
    out = combine(runs)
    assert out.available and out.runs == runs
    assert out.cached_tokens == 20 and isinstance(out.cached_tokens, int)
    assert out.ttft_p50_ms == pytest.approx(20.0) and out.duration_s == 2.0
    assert spread(out, lambda a: a.cached_token_ratio) == (0.1, 0.3)
    assert out.note == "1 of 4 runs failed: the server died"
    none_ran = combine([ArmSummary("x", available=False, note="n")] * 2)
    assert not none_ran.available and none_ran.note == "n"


def test_max_model_len_follows_blocks_and_model(tmp_path) -> None:
    model = _model_dir(tmp_path)
    assert model_max_positions(model) == 4096
    assert ABConfig(model, num_blocks=64).resolved_max_model_len() == 63 * 32
    assert ABConfig(model, num_blocks=1000).resolved_max_model_len() == 4096
    assert ABConfig(model, max_model_len=100).resolved_max_model_len() == 100


# ---------------------------------------------------------------- reports


def _ab_result(tmp_path: Path) -> ABResult:
    stock = summarize("vllm-stock", [_result(0, 100, 32, 0.02), _result(1, 100, 0, 0.04)], 1.0,
                      SPEC, parse_metrics(METRICS_TEXT))  # fmt: skip
    kvplug = summarize("kvplug", [_result(0, 100, 64, 0.01), _result(1, 100, 64, 0.02)], 0.5,
                       SPEC, parse_metrics(METRICS_TEXT))  # fmt: skip
    config = ABConfig(_model_dir(tmp_path), workload="mixed", requests=2)
    return ABResult(config, "mixed: 2 requests", "tokenizer.json", SPEC, 4064, [stock, kvplug])


def test_table_puts_arms_side_by_side(tmp_path) -> None:
    text = table(_ab_result(tmp_path))
    lines = text.splitlines()
    header = next(line for line in lines if line.startswith("metric"))
    assert "vllm-stock" in header and "kvplug" in header and "kvplug vs vllm-stock" in header
    rows = {line[:24].strip(): line[24:].split() for line in lines if line[:24].strip()}
    assert rows["requests sent"] == ["2", "2"]
    assert rows["cached-token ratio"] == ["0.1600", "0.6400", "+48.00", "pt"]
    assert rows["requests/s"] == ["2.00", "4.00", "2.000x"]
    assert rows["TTFT p50 (ms)"][:2] == ["30.0", "15.0"]
    assert rows["server prefix queries"] == ["1,024", "1,024"]
    assert "kvplug metrics" in text and "kvplug_evictions_total" in text
    assert len([r for r in ROWS if r.plotted]) == 6


def test_unavailable_arm_and_other_formats(tmp_path) -> None:
    result = _ab_result(tmp_path)
    result.arms[1] = ArmSummary("kvplug", available=False, note="kvplug.vllm is not importable")
    text = table(result)
    assert "unavailable" in text and "kvplug.vllm is not importable" in text
    assert " vs " not in text.splitlines()[2]
    data = json.loads(render(result, "json"))
    assert data["arms"][0]["arm"] == "vllm-stock" and data["arms"][1]["available"] is False
    assert data["cost_model"]["name"] == "tiny" and data["max_model_len"] == 4064
    assert data["arms"][0]["server_prefix_hit_ratio"] == pytest.approx(0.5)
    csv_lines = render(result, "csv").splitlines()
    assert csv_lines[0].startswith("arm,available") and len(csv_lines) == 3


@pytest.mark.skipif(not installed("matplotlib"), reason="needs matplotlib")
def test_plot_writes_a_png(tmp_path) -> None:
    path = plot(_ab_result(tmp_path), tmp_path / "ab.png")
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and path.stat().st_size > 5000


# ---------------------------------------------------------------- the server process

# A stand-in OpenAI server: /health, /metrics, and streamed /v1/completions whose usage
# says half the prompt's words were cached. It starts a child process too, to check that
# stopping ends the whole process group (the child's pid goes to a file).
FAKE_SERVER = textwrap.dedent("""\
    import json, subprocess, sys, time
    from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

    port, pid_file = int(sys.argv[1]), sys.argv[2]
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
    open(pid_file, "w").write(str(child.pid))
    print("fake server starting", flush=True)
    queries = 0

    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.0"

        def log_message(self, *args):
            pass

        def _send(self, code, body, kind="text/plain"):
            self.send_response(code)
            self.send_header("Content-Type", kind)
            self.end_headers()
            self.wfile.write(body.encode())

        def do_GET(self):
            if self.path == "/health":
                self._send(200, "")
            elif self.path == "/metrics":
                self._send(200, "# TYPE vllm:prefix_cache_queries_total counter\\n"
                           f"vllm:prefix_cache_queries_total{{engine=\\"0\\"}} {queries}\\n")
            else:
                self._send(404, "no")

        def do_POST(self):
            global queries
            body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
            words = len(body["prompt"].split())
            queries += words
            self.send_response(200)
            self.send_header("Content-Type", "text/event-stream")
            self.end_headers()
            for i in range(body["max_tokens"]):
                chunk = {"choices": [{"index": 0, "text": f" w{i}"}]}
                self.wfile.write(f"data: {json.dumps(chunk)}\\n\\n".encode())
                self.wfile.flush()
            usage = {"prompt_tokens": words, "completion_tokens": body["max_tokens"],
                     "prompt_tokens_details": {"cached_tokens": words // 2}}
            self.wfile.write(f"data: {json.dumps({'choices': [], 'usage': usage})}\\n\\n".encode())
            self.wfile.write(b"data: [DONE]\\n\\n")

    time.sleep(0.3)
    ThreadingHTTPServer(("127.0.0.1", port), Handler).serve_forever()
    """)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    # a zombie still answers kill(0); its state in /proc says so
    stat = Path(f"/proc/{pid}/stat")
    return not (stat.exists() and stat.read_text().split(")")[-1].split()[0] == "Z")


def _fake_server(tmp_path: Path) -> Path:
    script = tmp_path / "fake_server.py"
    script.write_text(FAKE_SERVER)
    return script


def test_server_starts_scrapes_and_stops_its_process_group(tmp_path) -> None:
    script, pid_file = _fake_server(tmp_path), tmp_path / "child.pid"
    port = free_port()
    server = Server([sys.executable, str(script), str(port), str(pid_file)], port,
                    tmp_path / "logs" / "fake.log", startup_timeout_s=30)  # fmt: skip
    with server:
        assert server.alive() and server.startup_s > 0
        status, text = server.get("/metrics")
        assert status == 200 and "prefix_cache_queries" in text
        child = int(pid_file.read_text())
        assert _alive(child)
    assert server.process is None
    deadline = time.monotonic() + 10
    while _alive(child) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not _alive(child), "the server's child process outlived it"
    assert "fake server starting" in (tmp_path / "logs" / "fake.log").read_text()
    server.stop()  # idempotent


def test_server_that_dies_or_hangs_raises_with_its_log_tail(tmp_path) -> None:
    code = "import sys; print('loading the model'); print('ValueError: boom'); sys.exit(3)"
    server = Server([sys.executable, "-c", code], free_port(), tmp_path / "dead.log")
    with pytest.raises(ServerError, match="exited with status 3") as failure:
        server.start()
    assert "ValueError: boom" in str(failure.value) and "dead.log" in str(failure.value)
    hang = Server([sys.executable, "-c", "import time; time.sleep(60)"], free_port(),
                  tmp_path / "hang.log", startup_timeout_s=1)  # fmt: skip
    started = time.monotonic()
    with pytest.raises(ServerError, match="not healthy after 1 s"):
        hang.start()
    assert time.monotonic() - started < 30 and hang.process is None


def test_a_server_whose_port_was_taken_starts_again_on_another(tmp_path) -> None:
    """The first server finds its port taken (its log says so, and it hangs on, as a
    server whose HTTP bind failed does); it is stopped at once and the next starts on a
    new port."""
    script, ports = _fake_server(tmp_path), []
    taken = "import time; print('[Errno 98] address already in use', flush=True); time.sleep(60)"

    def make(port: int) -> Server:
        ports.append(port)
        command = [sys.executable, "-c", taken] if len(ports) == 1 else [
            sys.executable, str(script), str(port), str(tmp_path / "child.pid")
        ]  # fmt: skip
        return Server(command, port, tmp_path / f"try{len(ports)}.log", startup_timeout_s=30)

    started = time.monotonic()
    with start_on_free_port(make) as server:
        assert server.alive() and server.port == ports[-1] and len(ports) == 2
    assert time.monotonic() - started < 25
    with pytest.raises(PortTakenError, match="was taken meanwhile"):
        start_on_free_port(
            lambda port: Server([sys.executable, "-c", taken], port, tmp_path / "t.log"),
            attempts=2,
        )


@pytest.mark.skipif(not installed("aiohttp"), reason="needs aiohttp (the vllm extra)")
def test_run_ab_against_a_fake_server(tmp_path) -> None:
    script = _fake_server(tmp_path)

    def command(config: ABConfig, arm: Arm, port: int, max_model_len: int) -> list[str]:
        if arm.name == "broken":
            return [sys.executable, "-c", "import sys; print('no such scheduler'); sys.exit(1)"]
        return [sys.executable, str(script), str(port), str(tmp_path / f"{arm.name}.pid")]

    config = ABConfig(_model_dir(tmp_path), workload="mixed", requests=20, concurrency=4,
                      num_blocks=64, log_dir=tmp_path / "logs")  # fmt: skip
    messages: list[str] = []
    arms = [stock_arm(), Arm("broken"), Arm("absent", requires="kvplug_no_such_pkg")]
    result = run_ab(config, arms, progress=messages.append, command=command)
    stock, broken, absent = result.arms
    assert stock.available and stock.succeeded == stock.requests == 20 and stock.failed == 0
    assert 0.4 < stock.cached_token_ratio <= 0.5  # the fake caches half of each prompt
    assert 0 < stock.prefill_compute_saved < stock.cached_token_ratio
    assert stock.ttft_p50_ms > 0 and stock.ttft_p99_ms >= stock.ttft_p50_ms
    assert stock.server_prefix_cache_queries == stock.prompt_tokens  # counted after warm-up
    assert stock.log_path.endswith("vllm-stock.log")
    assert not broken.available and "exited with status 1" in broken.note
    assert any("no such scheduler" in m for m in messages)  # the log tail is shown
    assert not absent.available and absent.note == "kvplug_no_such_pkg is not importable"
    assert "unavailable" in table(result)


@pytest.mark.skipif(not installed("aiohttp"), reason="needs aiohttp (the vllm extra)")
def test_run_ab_repeats_each_arm_interleaved(tmp_path) -> None:
    script = _fake_server(tmp_path)
    order: list[str] = []

    def command(config: ABConfig, arm: Arm, port: int, max_model_len: int) -> list[str]:
        order.append(arm.name)
        return [sys.executable, str(script), str(port), str(tmp_path / f"{arm.name}.pid")]

    config = ABConfig(_model_dir(tmp_path), workload="mixed", requests=6, concurrency=2,
                      num_blocks=64, log_dir=tmp_path / "logs", repeat=3)  # fmt: skip
    result = run_ab(config, [stock_arm(), Arm("other")], command=command)
    assert order == ["vllm-stock", "other"] * 3
    stock, other = result.arms
    assert len(stock.runs) == len(other.runs) == 3 and stock.succeeded == 6
    assert (tmp_path / "logs" / "vllm-stock#3.log").exists()
    text = table(result)
    assert "each arm run 3 times, interleaved: median [min-max]" in text
    assert result.as_dict()["repeat"] == 3 and len(result.as_dict()["arms"][0]["runs"]) == 3
    plot(result, tmp_path / "ab.png")
    assert (tmp_path / "ab.png").stat().st_size > 0


def test_run_ab_refuses_a_workload_that_does_not_fit(tmp_path) -> None:
    config = ABConfig(_model_dir(tmp_path), workload="system-prompts", requests=4, num_blocks=4)
    with pytest.raises(ConfigError, match="raise --num-blocks"):
        run_ab(config, [stock_arm()])


def test_skipped_turns_after_a_failure_count_as_failed() -> None:
    results = [_result(0, 10, 0, 0.01, ok=False), RequestResult(0, 1, error=SKIPPED)]
    summary = summarize("arm", results, 1.0, SPEC)
    assert summary.failed == 2 and SKIPPED in summary.errors


# ---------------------------------------------------------------- the command line


def _ab(*args: str):
    return CliRunner().invoke(main, ["bench", "serve", *args])


def test_ab_vllm_needs_a_model_directory(tmp_path) -> None:
    result = _ab("--engine", "vllm")
    assert result.exit_code == 2 and "Missing option '--model'" in result.output
    result = _ab("--engine", "vllm", "--model", str(tmp_path / "nope"))
    assert result.exit_code == 2 and "no such directory" in result.output
    assert "--model" in result.output
    result = _ab("--engine", "vllm", "--model", str(tmp_path))
    assert result.exit_code == 2 and "holds no config.json" in result.output


def test_ab_vllm_rejects_bad_options(tmp_path) -> None:
    model = str(_model_dir(tmp_path))
    result = _ab("--engine", "vllm", "--model", model, "--workload", "chat")
    assert result.exit_code == 2
    assert "'chat' is not one of 'system-prompts', 'multi-turn', 'mixed'" in result.output
    result = _ab("--engine", "vllm", "--model", model, "--kvplug-config", "{policy: cost}")
    assert result.exit_code == 2 and "not valid JSON" in result.output
    result = _ab("--engine", "vllm", "--model", model, "--kvplug-config", "[1]")
    assert result.exit_code == 2 and "expected a JSON object" in result.output
    result = _ab("--engine", "vllm", "--model", model, "--trace", "synthetic:mixed")
    assert result.exit_code == 2 and "No such option '--trace'" in result.output
    result = _ab("--engine", "vllm", "--model", model, "--num-blocks", "1")
    assert result.exit_code == 2 and "--num-blocks" in result.output and ">=2" in result.output
    result = _ab("--engine", "gpu")
    assert result.exit_code == 2 and "'gpu' is not one of 'sglang', 'vllm'" in result.output
    result = _ab("--engine", "sglang")
    assert result.exit_code == 2 and "Missing option '--model'" in result.output
    # the replay A/B takes none of the server options
    for option, value in (("--repeat", "3"), ("--workload", "mixed")):
        result = CliRunner().invoke(main, ["ab", option, value])
        assert result.exit_code == 2 and f"No such option '{option}'" in result.output


@pytest.mark.skipif(installed("vllm"), reason="checks the message shown without vllm")
def test_ab_vllm_without_vllm_says_where_to_run_it(tmp_path) -> None:
    result = _ab("--engine", "vllm", "--model", str(_model_dir(tmp_path)))
    assert result.exit_code == 1 and "vllm is not installed" in result.output
    assert ".venv-vllm/bin/kvplug" in result.output


# ---------------------------------------------------------------- a real vLLM server


@pytest.mark.vllm_server
@pytest.mark.skipif(not installed("vllm"), reason="needs vllm (.venv-vllm)")
@pytest.mark.skipif(not installed("aiohttp"), reason="needs aiohttp (the vllm extra)")
@pytest.mark.skipif(
    not installed("kvplug.tools.tiny_model"), reason="needs kvplug.tools.tiny_model"
)
def test_stock_arm_against_a_real_vllm_server(tmp_path) -> None:
    from kvplug.tools.tiny_model import build_tiny_model

    model = build_tiny_model(tmp_path / "tiny-llama", arch="llama")
    config = ABConfig(model, workload="mixed", requests=12, concurrency=4, num_blocks=64,
                      log_dir=tmp_path / "logs")  # fmt: skip
    result = run_ab(config, [stock_arm()], progress=print)
    (stock,) = result.arms
    assert stock.available, stock.note
    assert stock.succeeded == stock.requests == 12 and stock.failed == 0, stock.errors
    assert stock.ttft_p50_ms > 0 and stock.ttft_p99_ms >= stock.ttft_p50_ms
    assert stock.request_throughput > 0 and stock.output_throughput > 0
    assert 0 <= stock.cached_token_ratio <= 1 and 0 <= stock.prefill_compute_saved <= 1
    assert stock.cached_tokens > 0  # shared system prompts and chat histories hit
    # the server's own counters agree with the per-request usage (a preempted request is
    # looked up again when it resumes)
    assert 0 <= stock.server_prefix_hit_ratio <= 1
    if stock.server_preemptions == 0:
        assert stock.server_prefix_cache_queries == stock.prompt_tokens
        assert stock.server_prefix_cache_hits == stock.cached_tokens
    assert "vllm-stock" in table(result)


# ---------------------------------------------------------------- vLLM's own client


def test_prefix_repetition_fills_twice_the_budget_and_fits_the_model() -> None:
    dataset = PrefixRepetition.for_budget(kv_tokens=1536, max_model_len=1504, requests=400)
    assert dataset.num_prefixes * dataset.prefix_len >= 2 * 1536
    assert dataset.request_tokens <= 1504
    small = PrefixRepetition.for_budget(kv_tokens=64, max_model_len=96, requests=400)
    assert small.request_tokens <= 96 and small.num_prefixes >= 2
    few = PrefixRepetition.for_budget(kv_tokens=1536, max_model_len=1504, requests=8)
    assert few.num_prefixes == 4  # two requests a prefix: vLLM refuses more prefixes
    assert PrefixRepetition.for_budget(1536, 1504, requests=1).num_prefixes == 1


@pytest.mark.skipif(not installed("vllm"), reason="needs vllm (.venv-vllm)")
def test_bench_command_is_accepted_by_vllms_own_parser(tmp_path) -> None:
    from vllm.benchmarks.serve import add_cli_args
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    dataset = PrefixRepetition.for_budget(1536, 1504, requests=9)
    command = bench_command(
        "http://127.0.0.1:1", tmp_path, requests=9, concurrency=3, seed=5, dataset=dataset,
        result_dir=tmp_path, result_file="r.json",
        extra_args=parse_bench_args("--prefix-repetition-num-prefixes 4"),
    )  # fmt: skip
    assert command[:2] == [sys.executable, "-c"]
    parser = FlexibleArgumentParser()
    add_cli_args(parser)
    args = parser.parse_args(command[3:])
    assert args.dataset_name == "prefix_repetition" and args.num_prompts == 9
    assert args.max_concurrency == 3 and args.seed == 5 and args.save_result
    assert args.prefix_repetition_num_prefixes == 4  # the user's flag wins
    assert "ttft" in args.percentile_metrics and args.metric_percentiles == "50,99"


def test_bench_result_is_summarized_with_the_servers_hit_ratio() -> None:
    result = {
        "duration": 4.0, "completed": 7, "failed": 1, "total_input_tokens": 2000,
        "total_output_tokens": 112, "request_throughput": 1.75, "output_throughput": 28.0,
        "p50_ttft_ms": 120.0, "p99_ttft_ms": 300.0, "errors": ["", "boom", ""],
    }  # fmt: skip
    metrics = parse_metrics(
        "vllm:prefix_cache_queries_total 2000\nvllm:prefix_cache_hits_total 500\n"
        "vllm:num_preemptions_total 0\n"
    )
    arm = summarize_bench("kvplug", result, metrics, VLLM.counters)
    assert (arm.requests, arm.succeeded, arm.failed) == (8, 7, 1)
    assert (arm.ttft_p50_ms, arm.ttft_p99_ms) == (120.0, 300.0)
    assert arm.request_throughput == 1.75 and arm.output_throughput == 28.0
    assert arm.cached_tokens == 500 and arm.cached_token_ratio == 0.25
    assert arm.server_prefix_hit_ratio == 0.25 and arm.errors == ["boom"]
    assert math.isnan(arm.prefill_compute_saved)  # not measured by vLLM's client


def test_a_failing_bench_client_names_its_log(tmp_path) -> None:
    command = [sys.executable, "-c", "import sys; print('no server'); sys.exit(3)",
               "--result-dir", str(tmp_path), "--result-filename", "r.json"]  # fmt: skip
    with pytest.raises(BenchClientError, match="exited with 3.*client.log") as caught:
        run_bench(command, tmp_path / "client.log", timeout_s=60)
    assert "no server" in str(caught.value)


def test_vllm_bench_client_is_refused_for_other_engines_and_options(tmp_path) -> None:
    (tmp_path / "config.json").write_text("{}")
    runner = CliRunner()
    result = runner.invoke(main, ["bench", "serve", "--engine", "sglang", "--model", str(tmp_path),
                                  "--client", "vllm-bench"])  # fmt: skip
    assert result.exit_code == 2 and "drives vLLM servers only" in result.output
    result = runner.invoke(main, ["bench", "serve", "--engine", "vllm", "--model", str(tmp_path),
                                  "--bench-args", "--num-prompts 3"])  # fmt: skip
    assert result.exit_code == 2 and "--client vllm-bench only" in result.output
    result = runner.invoke(main, ["ab", "--client", "vllm-bench"])
    assert result.exit_code == 2 and "No such option" in result.output  # a server option
    with pytest.raises(ConfigError, match="cannot drive engine 'sglang'"):
        run_ab(ABConfig(tmp_path, engine="sglang", client="vllm-bench"), [])


@pytest.mark.vllm_server
@pytest.mark.skipif(not installed("vllm"), reason="needs vllm (.venv-vllm)")
@pytest.mark.skipif(
    not installed("kvplug.tools.tiny_model"), reason="needs kvplug.tools.tiny_model"
)
def test_vllms_own_client_drives_a_real_server(tmp_path) -> None:
    from kvplug.tools.tiny_model import build_tiny_model

    model = build_tiny_model(tmp_path / "tiny-llama", arch="llama")
    config = ABConfig(model, requests=8, concurrency=4, num_blocks=48, client="vllm-bench",
                      log_dir=tmp_path / "logs")  # fmt: skip
    result = run_ab(config, [stock_arm()], progress=print)
    (stock,) = result.arms
    assert stock.available, stock.note
    assert stock.succeeded == stock.requests == 8 and stock.failed == 0, stock.errors
    assert stock.ttft_p99_ms >= stock.ttft_p50_ms > 0 and stock.request_throughput > 0
    # 8 requests over 4 prefixes of 256 tokens: each prefix is reused, and vLLM's
    # counters (the hit ratio's source) saw every prompt token
    assert stock.server_prefix_cache_queries == stock.prompt_tokens
    assert 0 < stock.cached_token_ratio < 1
    assert "prefix_repetition" in result.workload and "vllm-stock" in table(result)


def test_python_core_arm_sets_sglangs_core_and_is_sglang_only(tmp_path) -> None:
    from kvplug.serving.engines import SGLANG_PYTHON_CORE

    assert dict(SGLANG_PYTHON_CORE.env) == {"SGLANG_UNIFIED_RADIX_TREE_CORE_BACKEND": "python"}
    assert SGLANG_PYTHON_CORE.extra_args == ()  # SGLang's own policy and cache
    server = Server(["true"], 1, tmp_path / "log", env=dict(SGLANG_PYTHON_CORE.env))
    assert server.env["SGLANG_UNIFIED_RADIX_TREE_CORE_BACKEND"] == "python"
    (tmp_path / "config.json").write_text("{}")
    result = CliRunner().invoke(
        main, ["bench", "serve", "--engine", "vllm", "--model", str(tmp_path), "--python-core-arm"]
    )
    assert result.exit_code == 2 and "--engine sglang only" in result.output


def test_output_tokens_are_checked_and_refused_beside_vllms_client(tmp_path) -> None:
    (tmp_path / "config.json").write_text("{}")
    base = ["bench", "serve", "--engine", "vllm", "--model", str(tmp_path)]
    result = CliRunner().invoke(main, [*base, "--output-tokens", "0"])
    assert result.exit_code == 2 and "--output-tokens" in result.output
    result = CliRunner().invoke(main, [*base, "--output-tokens", "1", "--client", "vllm-bench"])
    assert result.exit_code == 2 and "--client kvplug only" in result.output
