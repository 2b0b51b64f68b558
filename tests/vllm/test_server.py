"""kvplug in a real vLLM OpenAI API server (``--scheduler-cls kvplug.vllm.Scheduler``).

Every test starts real servers (``python -m vllm.entrypoints.openai.api_server``) on a tiny
random-weight Llama (`kvplug.tools.tiny_model`), one at a time, each in its own process group.
What they prove:

- ``TestKVPlugServer`` (one server, policy ``cost``, 48 blocks of 32 tokens):
  - the start-up log says "kvplug is active" exactly once;
  - repeated prompts with a long shared prefix are served from the prefix cache: each
    request's ``usage.prompt_tokens_details.cached_tokens`` is exactly what vLLM's rule
    gives over the token ids (/tokenize) of the earlier requests: the longest shared run of
    full 32-token blocks, at most ``prompt_tokens - 1``;
  - tenants (``vllm_xargs: {"kvplug_tenant": ...}``) do not share cache: the same prompt is
    a miss for tenant "b" after tenant "a" sent it, and a hit for "a" (and "b") again;
  - prompts larger than the pool force evictions;
  - vLLM's own counters agree with the responses: ``vllm:prefix_cache_queries_total`` is
    the sum of ``prompt_tokens`` and ``vllm:prefix_cache_hits_total`` the sum of
    ``cached_tokens`` (requests were sent one at a time and none was preempted, so each
    prompt was looked up exactly once, at admission);
  - kvplug's ``kvplug_*`` families are on /metrics and agree with what was sent, as of
    the snapshot they show (written by the engine core at most every 0.25 s): after its
    first ``kvplug_requests_total`` = k requests, ``kvplug_prompt_tokens_total`` and
    ``kvplug_matched_tokens_total`` are the sums over those k responses,
    ``kvplug_{prompt,saved}_flops_total`` kvplug's FLOPs model over them,
    ``kvplug_bytes_held`` is ``kvplug_cached_blocks`` times the bytes of one block,
    evictions plus cached blocks cover every distinct prompt block, churn <= evictions;
  - once the engine is idle, /metrics shows every request, with exact totals (hit blocks
    times 32 = matched tokens, evictions > 0, nothing deferred), even for a two-step
    request sent after a pause: its first step writes a snapshot, and its last step
    comes within the 0.25 s throttle (kvplug before 071bede never wrote that one).
- a bad kvplug config refuses to start: an unknown policy, a misspelt key, a block_size
  other than ``--block-size``, the offline-only policy ``belady``. The server exits non-zero
  on its own, kvplug's error names the problem and what is accepted, and no process of its
  group is left running.
- without ``--scheduler-cls`` an installed kvplug changes nothing visible: /metrics has no
  ``kvplug_`` line, the log does not mention kvplug being active, and no kvplug snapshot
  is written (vLLM's own prefix cache still hits).
"""

from __future__ import annotations

import json
import random
import re
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest

pytest.importorskip("vllm", reason="vLLM is not installed (pip install 'kvplug[vllm]')")

from vllm_server_util import (  # noqa: E402
    BLOCK_SIZE,
    Completion,
    Server,
    launch,
    stop,
    tail,
    wait_exit,
    wait_group_gone,
    wait_healthy,
)

from kvplug.core.model_spec import ModelSpec  # noqa: E402
from kvplug.policies import available_policies, online_policies  # noqa: E402
from kvplug.tools.tiny_model import build_tiny_model  # noqa: E402

pytestmark = pytest.mark.vllm_server

NUM_BLOCKS = 48  # 47 usable (1,504 tokens): three ~780-token prompts must evict
BF16_BYTES = 2  # the server runs with --dtype bfloat16 (and an "auto" KV cache dtype)
WORDS = [
    "the", "a", "of", "to", "and", "in", "is", "for", "on", "that", "with", "cache",
    "block", "token", "prefix", "model", "layer", "window", "memory", "request", "page",
    "pool", "hash", "evict", "small", "large", "first", "last", "next", "same", "new",
    "old", "long", "cat", "dog", "bird", "tree", "river", "house", "city", "road", "light",
    "night", "day", "time", "year", "world", "people",
]  # fmt: skip
POLICY_NAMES = ", ".join(available_policies())  # every registered policy, sorted
ONLINE_POLICY_NAMES = ", ".join(name for name in online_policies())
EXIT_TIMEOUT_S = 300.0  # a refused start still loads the model first (the scheduler comes last)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_tiny_model(tmp_path_factory.mktemp("models") / "llama", arch="llama")


def words(seed: int, n: int) -> str:
    rng = random.Random(seed)
    return " ".join(rng.choice(WORDS) for _ in range(n))


@contextmanager
def running_server(
    model_dir: Path, log_path: Path, kvplug: dict | None, num_blocks: int = NUM_BLOCKS
) -> Iterator[Server]:
    """A healthy server for the duration of the block; its whole group stopped after."""
    server = launch(str(model_dir), log_path, num_blocks, kvplug=kvplug)
    try:
        wait_healthy(server)
        yield server
    finally:
        stop(server)
        assert not wait_group_gone(server.pgid, 10.0), "server processes left running"


# -- vLLM's prefix-cache rule, from token ids ----------------------------------------------


def common_prefix(a: list[int], b: list[int]) -> int:
    n = 0
    for x, y in zip(a, b, strict=False):
        if x != y:
            break
        n += 1
    return n


def expected_hit(tokens: list[int], earlier: list[list[int]]) -> int:
    """Cached tokens vLLM reports when nothing was evicted: the longest prefix of full
    blocks shared with an earlier prompt, leaving at least the last token to compute."""
    shared = max((common_prefix(tokens, other) for other in earlier), default=0)
    usable = min(shared, len(tokens) - 1)
    return usable - usable % BLOCK_SIZE


def prompt_blocks(tokens: list[int], namespace: str) -> set[tuple[str, tuple[int, ...]]]:
    """The full blocks a prompt caches, keyed as vLLM does: by the whole prefix (and the
    kvplug namespace, which is salted into the first block's hash)."""
    full = len(tokens) // BLOCK_SIZE
    return {(namespace, tuple(tokens[: (i + 1) * BLOCK_SIZE])) for i in range(full)}


# -- /metrics --------------------------------------------------------------------------------


def poll_metrics(
    server: Server, until: Callable[[dict[str, float]], bool], timeout_s: float = 10.0
) -> dict[str, float]:
    """/metrics samples once `until(samples)` holds, or the last scrape after `timeout_s`."""
    deadline = time.monotonic() + timeout_s
    while True:
        samples = server.metrics()
        if until(samples) or time.monotonic() >= deadline:
            return samples
        time.sleep(0.25)


def model_spec(model_dir: Path) -> ModelSpec:
    return ModelSpec.from_hf_config(json.loads((model_dir / "config.json").read_text()))


def bytes_per_block(model_dir: Path) -> int:
    """K and V of every layer for one block, in bfloat16."""
    config = json.loads((model_dir / "config.json").read_text())
    per_token = 2 * config["num_hidden_layers"] * config["num_key_value_heads"] * config["head_dim"]
    return per_token * BLOCK_SIZE * BF16_BYTES


KVPLUG_SAMPLES = (
    "kvplug_requests_total",
    "kvplug_prompt_tokens_total",
    "kvplug_matched_tokens_total",
    "kvplug_prompt_flops_total",
    "kvplug_saved_flops_total",
    "kvplug_block_hits_total",
    "kvplug_evictions_total",
    "kvplug_churn_total",
    "kvplug_retired_total",
    "kvplug_cached_blocks",
    "kvplug_bytes_held",
    "kvplug_deferred_blocks",
    "kvplug_deferred_age_steps",
)


def check_kvplug_snapshot(
    samples: dict[str, float], sent: list[Completion], model_dir: Path, tokens: dict[str, list[int]]
) -> int:
    """Assert that kvplug's samples describe the first k requests of `sent` (k is their
    request count, since requests were sent one at a time); returns k."""
    missing = [name for name in KVPLUG_SAMPLES if name not in samples]
    assert not missing, f"kvplug families missing from /metrics: {missing}"
    k = int(samples["kvplug_requests_total"])
    assert 1 <= k <= len(sent), f"kvplug counted {k} requests, {len(sent)} were sent"
    done = sent[:k]
    spec = model_spec(model_dir)
    assert samples["kvplug_prompt_tokens_total"] == sum(c.prompt_tokens for c in done)
    assert samples["kvplug_matched_tokens_total"] == sum(c.cached_tokens for c in done)
    prompt_flops = sum(spec.prefill_flops(0, c.prompt_tokens) for c in done)
    saved_flops = sum(spec.prefill_flops(0, c.cached_tokens) for c in done)
    assert samples["kvplug_prompt_flops_total"] == pytest.approx(prompt_flops, rel=1e-9)
    assert samples["kvplug_saved_flops_total"] == pytest.approx(saved_flops, rel=1e-9)
    assert samples["kvplug_saved_flops_total"] < samples["kvplug_prompt_flops_total"]
    # Hits are counted when a request is admitted, matched tokens when it finishes.
    assert samples["kvplug_block_hits_total"] * BLOCK_SIZE >= samples["kvplug_matched_tokens_total"]

    cached_blocks = samples["kvplug_cached_blocks"]
    assert 0 < cached_blocks <= NUM_BLOCKS - 1  # the null block never holds a prefix
    assert samples["kvplug_bytes_held"] == cached_blocks * bytes_per_block(model_dir)
    evictions = samples["kvplug_evictions_total"]
    assert 0 <= samples["kvplug_churn_total"] <= evictions
    # Every full prompt block was cached once; it is still cached or was evicted since.
    distinct = set().union(*(prompt_blocks(tokens[c.prompt], c.tenant or "") for c in done))
    assert evictions + cached_blocks >= len(distinct)
    assert samples["kvplug_deferred_blocks"] >= 0
    assert samples["kvplug_deferred_age_steps"] >= 0
    if samples["kvplug_deferred_blocks"] == 0:
        assert samples["kvplug_deferred_age_steps"] == 0
    return k


# -- one kvplug server, several checks ---------------------------------------------------------


@pytest.fixture(scope="class")
def server(model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    """The kvplug server of `TestKVPlugServer`, stopped after the class."""
    log_path = tmp_path_factory.mktemp("kvplug-server") / "server.log"
    with running_server(model_dir, log_path, kvplug={"policy": "cost"}) as server:
        yield server


@pytest.fixture(scope="class")
def tokens() -> dict[str, list[int]]:
    """Token ids of each prompt sent to `server`, filled in by `send`."""
    return {}


def send(
    server: Server,
    tokens: dict[str, list[int]],
    prompt: str,
    tenant: str | None = None,
    max_tokens: int = 4,
    xargs: dict | None = None,
    user: str | None = None,
) -> Completion:
    """A completion request, with the prompt's token ids noted in `tokens`."""
    if prompt not in tokens:
        tokens[prompt] = server.tokenize(prompt)
    completion = server.complete(
        prompt, max_tokens=max_tokens, tenant=tenant, xargs=xargs, user=user
    )
    assert completion.prompt_tokens == len(tokens[prompt])
    return completion


def earlier_tokens(
    server: Server, tokens: dict[str, list[int]], tenant: str | None
) -> list[list[int]]:
    """Token ids of the requests sent so far (before the last one) in `tenant`."""
    return [tokens[c.prompt] for c in server.sent[:-1] if c.tenant == tenant]


class TestKVPlugServer:
    """Run in this order: the later checks read the metrics of the earlier requests."""

    def test_startup_log_says_kvplug_is_active_once(self, server: Server) -> None:
        log = server.log()
        assert log.count("kvplug is active") == 1, tail(log)
        active = r"kvplug is active \(engine 0\): policy=cost .*48 blocks of 32 tokens"
        assert re.search(active, log)

    def test_shared_prefix_hits_prefix_cache(
        self, server: Server, tokens: dict[str, list[int]]
    ) -> None:
        prefix = words(seed=1, n=420)
        hits = []
        for i in range(4):
            completion = send(server, tokens, f"{prefix} question {i}: {words(10 + i, 20)}")
            expected = expected_hit(tokens[completion.prompt], earlier_tokens(server, tokens, None))
            assert completion.cached_tokens == expected, (i, completion)
            hits.append(completion.cached_tokens)
        assert hits[0] == 0
        assert all(hit > 0 and hit % BLOCK_SIZE == 0 for hit in hits[1:]), hits
        assert min(hits[1:]) >= 10 * BLOCK_SIZE, hits  # the shared prefix is long

    def test_tenants_do_not_share_cache(self, server: Server, tokens: dict[str, list[int]]) -> None:
        prompt = words(seed=2, n=200)
        first_a = send(server, tokens, prompt, tenant="a")
        first_b = send(server, tokens, prompt, tenant="b")
        again_a = send(server, tokens, prompt, tenant="a")
        again_b = send(server, tokens, prompt, tenant="b")
        full_hit = expected_hit(tokens[prompt], [tokens[prompt]])
        assert full_hit > 0
        assert (first_a.cached_tokens, first_b.cached_tokens) == (0, 0)
        assert (again_a.cached_tokens, again_b.cached_tokens) == (full_hit, full_hit)

    def test_prompts_larger_than_the_pool_are_served(
        self, server: Server, tokens: dict[str, list[int]]
    ) -> None:
        big = [words(seed=100 + i, n=780) for i in range(3)]
        for prompt in big:
            completion = send(server, tokens, prompt)
            assert completion.cached_tokens == 0
            assert completion.prompt_tokens > 24 * BLOCK_SIZE  # three overflow the pool
        # The shared prefix may have been evicted or kept (the policy decides); either way
        # the answer is a whole number of blocks, at most what a full hit would be.
        prompt = server.sent[1].prompt
        completion = send(server, tokens, prompt)
        assert completion.cached_tokens % BLOCK_SIZE == 0
        assert completion.cached_tokens <= expected_hit(tokens[prompt], [tokens[prompt]])

    def test_vllm_prefix_cache_counters_match_responses(self, server: Server) -> None:
        queries = sum(c.prompt_tokens for c in server.sent)
        hits = sum(c.cached_tokens for c in server.sent)
        samples = poll_metrics(
            server, lambda s: s.get("vllm:prefix_cache_queries_total") == queries
        )
        assert samples["vllm:prefix_cache_queries_total"] == queries
        assert samples["vllm:prefix_cache_hits_total"] == hits
        assert hits > 0

    def test_kvplug_metrics_agree_with_requests(
        self, server: Server, model_dir: Path, tokens: dict[str, list[int]]
    ) -> None:
        assert (server.metrics_dir / "engine-0.json").is_file()  # the engine core's snapshot
        text = server.metrics_text()
        assert "# TYPE kvplug_requests_total counter" in text
        assert "# TYPE kvplug_bytes_held gauge" in text
        assert re.search(r'^kvplug_requests_total\{engine="0",policy="cost"\} ', text, re.M)
        samples = poll_metrics(
            server, lambda s: s.get("kvplug_requests_total") == len(server.sent), timeout_s=3.0
        )
        check_kvplug_snapshot(samples, server.sent, model_dir, tokens)

    def test_kvplug_metrics_catch_up_when_idle(
        self, server: Server, model_dir: Path, tokens: dict[str, list[int]]
    ) -> None:
        # After a pause, a two-step request: its first step writes a snapshot (the last one
        # is older than 0.25 s), its second step finishes it a few milliseconds later, when
        # the throttle would skip the write; the engine then goes idle.
        time.sleep(0.5)
        send(server, tokens, server.sent[1].prompt, max_tokens=2)
        sent = len(server.sent)
        samples = poll_metrics(
            server, lambda s: s.get("kvplug_requests_total") == sent, timeout_s=5.0
        )
        assert samples["kvplug_requests_total"] == sent
        check_kvplug_snapshot(samples, server.sent, model_dir, tokens)
        assert samples["kvplug_matched_tokens_total"] == sum(c.cached_tokens for c in server.sent)
        # One KV cache group and no preemption: every hit block is a matched block.
        assert (
            samples["kvplug_block_hits_total"] * BLOCK_SIZE
            == samples["kvplug_matched_tokens_total"]
        )
        assert samples["kvplug_evictions_total"] > 0  # the three big prompts overflow the pool
        assert samples["kvplug_deferred_blocks"] == samples["kvplug_deferred_age_steps"] == 0

    def test_a_request_names_its_session_by_the_user_field_or_by_argument(
        self, server: Server, tokens: dict[str, list[int]]
    ) -> None:
        """The OpenAI ``user`` field reaches the scheduler (kvplug's plugin carries it
        in the API server) as ``vllm_xargs: {"kvplug_session": ...}`` does; a bad value
        names none and is counted."""
        before = server.metrics()
        named = before.get("kvplug_session_requests_total", 0)
        refused = before.get("kvplug_sessions_refused_total", 0)
        send(server, tokens, words(seed=31, n=40), user="alice")
        send(server, tokens, words(seed=32, n=40), xargs={"kvplug_session": "chat-1"})
        send(server, tokens, words(seed=33, n=40), xargs={"kvplug_session": ""})
        send(server, tokens, words(seed=34, n=40))
        sent = len(server.sent)
        samples = poll_metrics(server, lambda s: s.get("kvplug_requests_total") == sent)
        assert samples["kvplug_session_requests_total"] == named + 2
        assert samples["kvplug_sessions_refused_total"] == refused + 1

    def test_a_prefix_kept_on_request_outlives_a_flood(
        self, server: Server, model_dir: Path, tokens: dict[str, list[int]]
    ) -> None:
        """Last: its retention holds blocks for the rest of the server's life.
        ``vllm_xargs: {"kvplug_retain_s": 600}`` keeps the prompt's cached blocks (within
        the default tenant's quarter of the 48-block pool), /metrics shows them, and the
        prompt is a full hit again after prompts that overflow the pool."""
        prompt = words(seed=7, n=150)
        send(server, tokens, prompt, xargs={"kvplug_retain_s": 600})
        full_hit = expected_hit(tokens[prompt], [tokens[prompt]])
        assert 0 < full_hit <= 12 * BLOCK_SIZE
        samples = poll_metrics(server, lambda s: s.get("kvplug_retentions_total") == 1)
        assert samples["kvplug_retentions_total"] == 1
        assert samples["kvplug_retained_blocks"] == full_hit // BLOCK_SIZE
        text = server.metrics_text()
        kept = re.search(r'^kvplug_retained_bytes\{[^}]*tenant=""[^}]*\} (\S+)', text, re.M)
        assert kept is not None and float(kept.group(1)) == (
            full_hit // BLOCK_SIZE * bytes_per_block(model_dir)
        ), text
        for seed in range(200, 203):  # each nearly fills what the retention leaves
            assert send(server, tokens, words(seed=seed, n=600)).cached_tokens == 0
        assert send(server, tokens, prompt).cached_tokens == full_hit


# -- bad kvplug configs refuse to start --------------------------------------------------------

BAD_CONFIGS = [
    pytest.param(
        {"policy": "nope"},
        [
            r"'policy' = 'nope' is not accepted: must be one of: " + POLICY_NAMES,
            r"\(from --additional-config\)",
        ],
        id="unknown-policy",
    ),
    pytest.param(
        {"polcy": "cost"},
        [
            r"unknown key 'polcy' \(accepted keys: block_size, enable_prefix_caching, "
            r"hash_algo, namespace, policy, policy_config, queue_protection, retention, "
            r"strict_version\)",
            r"did you mean 'policy'\?",
            r"\(from --additional-config\)",
        ],
        id="misspelt-key",
    ),
    pytest.param(
        {"block_size": 48},
        [
            r"block_size 48 cannot be served: vLLM allocated its KV cache in blocks of 32 tokens",
            r"start vLLM with --block-size 48 or drop kvplug's block_size",
        ],
        id="block-size-mismatch",
    ),
    pytest.param(
        {"policy": "belady"},
        [
            r"policy 'belady' cannot run in a server: it needs every request in advance",
            r"use it in kvplug replay\); accepted here: " + ONLINE_POLICY_NAMES,
        ],
        id="offline-policy",
    ),
]


@pytest.mark.parametrize(("config", "expected"), BAD_CONFIGS)
def test_bad_config_refuses_to_start(
    model_dir: Path, tmp_path: Path, config: dict, expected: list[str]
) -> None:
    server = launch(str(model_dir), tmp_path / "server.log", NUM_BLOCKS, kvplug=config)
    try:
        status = wait_exit(server, EXIT_TIMEOUT_S)
        log = server.log()
        assert status is not None, f"still running after {EXIT_TIMEOUT_S:.0f} s:\n{tail(log)}"
        assert status != 0
        assert "kvplug.errors.ConfigError: kvplug config: " in log, tail(log)
        for pattern in expected:
            assert re.search(pattern, log), f"{pattern!r} not in the log:\n{tail(log)}"
        assert "kvplug is active" not in log
        left = wait_group_gone(server.pgid, 15.0)
        assert not left, f"left running: {[p.pid for p in left]}"
    finally:
        stop(server, grace_s=5.0)


# -- without the flag ----------------------------------------------------------------------------


def test_stock_server_shows_no_kvplug(model_dir: Path, tmp_path: Path) -> None:
    with running_server(model_dir, tmp_path / "server.log", kvplug=None) as server:
        prompt = words(seed=3, n=200)
        server.complete(prompt)
        assert server.complete(prompt).cached_tokens > 0  # vLLM's own prefix cache works
        queries = sum(c.prompt_tokens for c in server.sent)
        samples = poll_metrics(
            server, lambda s: s.get("vllm:prefix_cache_queries_total") == queries
        )
        assert samples["vllm:prefix_cache_hits_total"] > 0
        time.sleep(0.5)  # a kvplug snapshot, if one were written, would be visible by now
        text = server.metrics_text()
        assert not [line for line in text.splitlines() if "kvplug" in line]
        assert "kvplug is active" not in server.log()
        assert not list(server.metrics_dir.glob("*")), "a kvplug snapshot was written"
