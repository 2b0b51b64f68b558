"""SGLang's real OpenAI server on the CPU, stock and with kvplug (``--radix-cache-backend kvplug``).

Every server is ``python -m sglang.launch_server`` on 127.0.0.1 with a tiny random-weight
Llama (`kvplug.tools.tiny_model`), ``SGLANG_USE_CPU_ENGINE=1 --device cpu
--attention-backend torch_native``, a KV budget of `MAX_TOTAL_TOKENS` tokens, each in its
own process group. SGLang's compiled ``sgl_kernel`` has no CPU build on any registry: the
servers get the test fixture integration_tests/sgl_kernel_cpu_stub on their PYTHONPATH
(only theirs). A server start costs a minute or two of CPU, so the module starts all its
servers at once, the first time a test needs one, and shares them:

- ``stock``: SGLang's own radix cache (its ``lru`` policy);
- ``no-cache``: ``--disable-radix-cache``, the reference for greedy outputs;
- ``kvplug-lru``, ``kvplug-cost``: ``--radix-cache-backend kvplug --radix-eviction-policy
  kvplug-<policy>``;
- ``bad-policy`` (``kvplug-nope``) and ``bad-config`` (a misspelt kvplug key in
  ``--radix-eviction-policy-config``), which must refuse to start.

What they prove:

- each server answers the same scripted session of greedy ``/v1/completions``: prompts
  with a long shared prefix, exact repeats, then distinct long prompts that overflow the
  KV budget (evictions), then the first prompts again;
- ``usage.prompt_tokens_details.cached_tokens`` (``--enable-cache-report``) is exactly
  SGLang's rule while nothing was evicted: the longest run of prompt tokens shared with
  an earlier prompt (the server's warm-up prompt included), at most ``prompt_tokens - 1``;
  ``no-cache`` reports 0 throughout;
- SGLang's own counters on ``/metrics`` (``--enable-metrics``) agree with the responses:
  ``sglang:prompt_tokens_total`` and ``sglang:cached_tokens_total`` grew by the sums over
  the session;
- greedy outputs are the same token for token on all four servers: cached prefixes,
  kvplug's eviction order and evictions change no output;
- with kvplug the log says ``kvplug is active: policy=<policy>`` once, kvplug's
  ``kvplug_*`` families are on ``/metrics`` and count the session; without it neither;
- a bad kvplug policy or config stops the server at start-up with an error naming the
  problem, and nothing of its process group is left running.
"""

from __future__ import annotations

import importlib.util
import os
import random
import sys
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

import pytest

NEEDED = ("sglang", "fastapi", "uvicorn", "uvloop", "prometheus_client", "xgrammar",
          "soundfile", "einops", "jsonschema", "httpx", "psutil")  # fmt: skip
MISSING = [name for name in NEEDED if importlib.util.find_spec(name) is None]
if MISSING:
    pytest.skip(
        f"SGLang's server needs {', '.join(MISSING)}: install requirements/sglang-replay.txt "
        "and requirements/sglang-server.txt (scripts/envs.sh ensure_sglang_env)",
        allow_module_level=True,
    )

import httpx  # noqa: E402
import psutil  # noqa: E402

from kvplug.serving.engines import sglang_command, sglang_kvplug_args  # noqa: E402
from kvplug.serving.metrics import Metrics, parse_metrics  # noqa: E402
from kvplug.serving.server import Server, ServerError, start_on_free_port  # noqa: E402
from kvplug.tools.tiny_model import build_tiny_model  # noqa: E402

pytestmark = pytest.mark.sglang_server

STUB = Path(__file__).resolve().parents[2] / "integration_tests" / "sgl_kernel_cpu_stub"
MAX_TOTAL_TOKENS = 1024  # the KV budget: the session's distinct prompts overflow it
CONTEXT_LENGTH = 512
MAX_TOKENS = 6
WARMUP_PROMPT = "The capital city of France is"  # what SGLang sends itself once it is up
START_TIMEOUT_S = 540.0
WORDS = (
    "one two three four five six seven eight nine ten cache block token prefix model "
    "layer window memory request page pool hash evict river house city road light night"
)
VOCABULARY = WORDS.split()
GOOD = {
    "stock": (),
    "no-cache": ("--disable-radix-cache",),
    "kvplug-lru": sglang_kvplug_args({"policy": "lru"}),
    "kvplug-cost": sglang_kvplug_args({"policy": "cost"}),
}
BAD = {
    "bad-policy": ("--radix-cache-backend", "kvplug", "--radix-eviction-policy", "kvplug-nope"),
    "bad-config": sglang_kvplug_args({"policy": "cost", "polciy_config": {}}),
}


def text(seed: int, words: int) -> str:
    rng = random.Random(seed)
    return " ".join(rng.choice(VOCABULARY) for _ in range(words))


SHARED = text(1, 90)
SESSION = [
    SHARED + " " + text(2, 20),
    SHARED + " " + text(3, 20),  # shares SHARED with the first
    SHARED + " " + text(2, 20),  # a repeat of the first
    *(text(10 + i, 200) for i in range(6)),  # distinct, about 1,200 tokens: evictions
    SHARED + " " + text(3, 20),
    SHARED + " " + text(4, 20),
]
EXACT = 3  # the prompts sent before the KV budget can run out


@dataclass
class Reply:
    prompt: str
    prompt_tokens: int
    cached_tokens: int
    text: str


@dataclass
class Run:
    """One server of the module: its `Server`, or why it did not start, and what it said."""

    name: str
    server: Server
    error: str = ""
    replies: list[Reply] = field(default_factory=list)
    before: Metrics | None = None
    after: Metrics | None = None

    def log(self) -> str:
        return self.server.log_path.read_text(errors="replace")


def complete(server: Server, model: str, prompt: str) -> Reply:
    body = {"model": model, "prompt": prompt, "max_tokens": MAX_TOKENS, "temperature": 0}
    response = httpx.post(f"{server.base_url}/v1/completions", json=body, timeout=300)
    response.raise_for_status()
    data = response.json()
    usage = data["usage"]
    details = usage.get("prompt_tokens_details") or {}
    return Reply(prompt, int(usage["prompt_tokens"]), int(details.get("cached_tokens") or 0),
                 data["choices"][0]["text"])  # fmt: skip


def scrape(server: Server) -> Metrics:
    status, body = server.get("/metrics", timeout=30)
    assert status == 200, body[:300]
    return parse_metrics(body)


def start(name: str, extra: tuple[str, ...], model: Path, logs: Path) -> Run:
    env = {
        "SGLANG_USE_CPU_ENGINE": "1",
        "PYTHONPATH": os.pathsep.join(filter(None, [str(STUB), os.environ.get("PYTHONPATH")])),
        "OMP_NUM_THREADS": "1",
    }
    made: list[Server] = []

    def make(port: int) -> Server:
        command = sglang_command(model, port, max_total_tokens=MAX_TOTAL_TOKENS,
                                 context_length=CONTEXT_LENGTH, extra_args=extra,
                                 python=sys.executable, cpu=True)  # fmt: skip
        made.append(Server(command, port, logs / f"{name}.log", env=env,
                           startup_timeout_s=START_TIMEOUT_S))  # fmt: skip
        return made[-1]

    try:
        return Run(name, start_on_free_port(make))
    except ServerError as exc:
        return Run(name, made[-1], error=str(exc))


def drive(run: Run, model: str) -> None:
    """The scripted session, with /metrics read before and after."""
    if run.error:
        return
    run.before = scrape(run.server)
    run.replies = [complete(run.server, model, prompt) for prompt in SESSION]
    run.after = scrape(run.server)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_tiny_model(tmp_path_factory.mktemp("models") / "llama", arch="llama")


@pytest.fixture(scope="module")
def runs(model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Run]]:
    """Every server of the module, started at once; the good ones driven through the
    session one after another; all stopped at the end."""
    logs = tmp_path_factory.mktemp("sglang-logs")
    every = {**GOOD, **BAD}
    with ThreadPoolExecutor(len(every)) as pool:
        futures = {name: pool.submit(start, name, extra, model_dir, logs)
                   for name, extra in every.items()}  # fmt: skip
        started = {name: future.result() for name, future in futures.items()}
    try:
        for name in GOOD:
            drive(started[name], str(model_dir))
        yield started
    finally:
        for run in started.values():
            run.server.stop()


def kvplug_settled(run: Run, timeout_s: float = 20.0) -> Metrics:
    """/metrics once kvplug's counters show the whole session: the scheduler publishes
    them after the responses have gone out, so the last request may show a moment later."""
    deadline = time.monotonic() + timeout_s
    while True:
        now = scrape(run.server)
        if now.since(run.before).get("kvplug_requests") == len(SESSION):
            return now
        if time.monotonic() > deadline:
            return now
        time.sleep(0.5)


def good(runs: dict[str, Run], name: str) -> Run:
    run = runs[name]
    assert not run.error, f"{name} did not start: {run.error}"
    return run


# -- SGLang's prefix-cache rule, from token ids ----------------------------------------------


def tokenizer(model_dir: Path):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(model_dir))


def expected_hits(model_dir: Path, prompts: list[str]) -> list[int]:
    """Cached tokens SGLang reports while nothing was evicted (page size 1): the longest
    prefix shared with an earlier prompt or the warm-up prompt, leaving one token."""
    tok = tokenizer(model_dir)
    seen = [tok(WARMUP_PROMPT)["input_ids"]]
    hits = []
    for prompt in prompts:
        ids = tok(prompt)["input_ids"]
        shared = max(len(os.path.commonprefix([ids, other])) for other in seen)
        hits.append(min(shared, len(ids) - 1))
        seen.append(ids)
    return hits


# -- the tests --------------------------------------------------------------------------------


@pytest.mark.parametrize("name", ["stock", "kvplug-lru", "kvplug-cost"])
def test_cached_tokens_follow_the_radix_rule(runs, model_dir, name) -> None:
    run = good(runs, name)
    hits = expected_hits(model_dir, SESSION[:EXACT])
    assert [r.cached_tokens for r in run.replies[:EXACT]] == hits
    assert hits[2] == run.replies[2].prompt_tokens - 1  # the repeat: all but the last token
    assert hits[1] > 90  # the shared prefix
    for reply in run.replies:
        assert 0 <= reply.cached_tokens < reply.prompt_tokens
    assert run.replies[-2].cached_tokens > 0  # the shared prefix came back after evictions


def test_no_cache_server_reports_no_cached_tokens(runs) -> None:
    run = good(runs, "no-cache")
    assert [r.cached_tokens for r in run.replies] == [0] * len(SESSION)


@pytest.mark.parametrize("name", ["stock", "no-cache", "kvplug-lru", "kvplug-cost"])
def test_sglang_counters_agree_with_the_responses(runs, name) -> None:
    run = good(runs, name)
    grown = run.after.since(run.before)
    assert grown.get("sglang:prompt_tokens") == sum(r.prompt_tokens for r in run.replies)
    assert (grown.get("sglang:cached_tokens") or 0) == sum(r.cached_tokens for r in run.replies)
    assert (grown.get("sglang:num_requests") or 0) == len(SESSION)
    assert 0 <= (run.after.get("sglang:cache_hit_rate") or 0) <= 1


def test_the_session_overflows_the_kv_budget(runs, model_dir) -> None:
    tok = tokenizer(model_dir)
    distinct = {prompt: len(tok(prompt)["input_ids"]) for prompt in SESSION}
    assert sum(distinct.values()) > 1.5 * MAX_TOTAL_TOKENS


@pytest.mark.parametrize("name", ["stock", "kvplug-lru", "kvplug-cost"])
def test_greedy_outputs_equal_those_without_a_cache(runs, name) -> None:
    reference = [r.text for r in good(runs, "no-cache").replies]
    assert len(set(reference)) > 1  # the model does not just repeat one answer
    assert [r.text for r in good(runs, name).replies] == reference


@pytest.mark.parametrize("policy", ["lru", "cost"])
def test_kvplug_is_active_and_exports_its_metrics(runs, policy) -> None:
    run = good(runs, f"kvplug-{policy}")
    log = run.log()
    active = [line for line in log.splitlines() if "kvplug is active" in line]
    assert len(active) == 1, active
    assert f"policy={policy}" in active[0] and f"{MAX_TOTAL_TOKENS} pages of 1 tokens" in active[0]
    assert run.after.kvplug(), "no kvplug_* sample on /metrics"
    grown = kvplug_settled(run).since(run.before)
    assert grown.get("kvplug_requests") == len(SESSION)
    assert grown.get("kvplug_prompt_tokens") == sum(r.prompt_tokens for r in run.replies)
    # kvplug counts the cached tokens SGLang reports, request for request
    assert grown.get("kvplug_matched_tokens") == sum(r.cached_tokens for r in run.replies)
    assert grown.get("kvplug_evictions") > 0  # the session overflowed the KV budget


def test_stock_server_shows_no_kvplug(runs) -> None:
    run = good(runs, "stock")
    assert not run.after.kvplug()
    assert "kvplug is active" not in run.log()


@pytest.mark.parametrize(
    ("name", "words"),
    [
        ("bad-policy", ["kvplug-nope", "kvplug-cost", "kvplug-lru"]),
        ("bad-config", ["polciy_config"]),
    ],
)
def test_bad_kvplug_input_stops_the_server_at_start_up(runs, name, words) -> None:
    run = runs[name]
    assert run.error, f"{name} started"
    assert "exited with status" in run.error and "during start-up" in run.error
    log = run.log()
    for word in words:
        assert word in log, f"{word!r} not in the log:\n{log[-3000:]}"
    assert not _group_alive(run.server)


def _group_alive(server: Server) -> list[int]:
    """Live processes still in the server's process group (Server.stop ran on failure)."""
    alive = []
    for process in psutil.process_iter(["status"]):
        try:
            if os.getpgid(process.pid) == server.pgid and process.info["status"] != "zombie":
                alive.append(process.pid)
        except (ProcessLookupError, psutil.Error):
            continue
    return alive
