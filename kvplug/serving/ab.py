"""The server A/B: each arm's server in turn, same model, KV budget and workload.

An `Arm` is a name and the extra server arguments that make it what it is: none for
stock vLLM; ``--scheduler-cls kvplug.vllm.Scheduler`` (and ``--additional-config``) for
kvplug. `run_ab` builds the seeded workload once, then for each arm starts a server on a
free port, sends one warm-up request, drives the workload, scrapes ``/metrics`` before and
after, stops the server, and summarizes. An arm whose module is not importable, or whose
server fails, is reported as unavailable with the reason; it never aborts the other arms.
"""

from __future__ import annotations

import contextlib
import importlib.util
import json
import signal
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from kvplug.core.model_spec import ModelSpec, load_model
from kvplug.errors import ConfigError
from kvplug.serving.client import run_workload, warm_up
from kvplug.serving.metrics import Metrics, parse_metrics
from kvplug.serving.server import Server, ServerError, free_port, vllm_command
from kvplug.serving.stats import ArmSummary, summarize
from kvplug.serving.tokens import load_token_counter
from kvplug.serving.workload import Workload, build_workload

STOCK = "vllm-stock"
KVPLUG = "kvplug"
KVPLUG_SCHEDULER = "kvplug.vllm.Scheduler"
DEFAULT_MAX_MODEL_LEN = 4096  # when config.json names no max_position_embeddings

Progress = Callable[[str], None]


@dataclass(frozen=True)
class Arm:
    """A server configuration: `extra_args` are added to the common vLLM command line;
    `requires` names a module that must be importable for the arm to run."""

    name: str
    extra_args: tuple[str, ...] = ()
    requires: str | None = None

    def missing(self) -> str | None:
        """Why the arm cannot run here, or None."""
        if self.requires is None:
            return None
        try:
            found = importlib.util.find_spec(self.requires) is not None
        except (ImportError, ValueError):
            found = False
        return None if found else f"{self.requires} is not importable"


def stock_arm() -> Arm:
    return Arm(STOCK)


def kvplug_arm(config: dict | None = None, scheduler_cls: str = KVPLUG_SCHEDULER) -> Arm:
    """vLLM with kvplug's scheduler; `config` goes to ``--additional-config`` as
    ``{"kvplug": config}`` (e.g. ``{"policy": "cost"}``)."""
    args: tuple[str, ...] = ("--scheduler-cls", scheduler_cls)
    if config:
        args += ("--additional-config", json.dumps({"kvplug": config}))
    return Arm(KVPLUG, args, requires=scheduler_cls.rpartition(".")[0])


@dataclass
class ABConfig:
    model: Path
    workload: str = "mixed"
    requests: int = 400
    concurrency: int = 8
    num_blocks: int = 128
    block_size: int = 32
    max_model_len: int | None = None  # default: what the blocks and the model allow
    seed: int = 0
    startup_timeout_s: float = 300.0
    request_timeout_s: float = 300.0
    log_dir: Path | None = None  # default: a new temporary directory

    def resolved_max_model_len(self) -> int:
        if self.max_model_len is not None:
            return self.max_model_len
        # vLLM keeps one block back (the null block) and wants one max-length request to fit
        return min(model_max_positions(self.model), (self.num_blocks - 1) * self.block_size)


@dataclass
class ABResult:
    config: ABConfig
    workload: str  # `Workload.describe()`
    tokenizer: str  # where the prompt token counts came from
    cost_model: ModelSpec
    max_model_len: int
    arms: list[ArmSummary] = field(default_factory=list)
    seconds: float = 0.0

    def as_dict(self) -> dict:
        return {
            "model": str(self.config.model),
            "workload": self.config.workload,
            "workload_description": self.workload,
            "requests": self.config.requests,
            "concurrency": self.config.concurrency,
            "num_blocks": self.config.num_blocks,
            "block_size": self.config.block_size,
            "max_model_len": self.max_model_len,
            "seed": self.config.seed,
            "tokenizer": self.tokenizer,
            "cost_model": self.cost_model.as_dict(),
            "seconds": self.seconds,
            "arms": [arm.as_dict() for arm in self.arms],
        }


def model_max_positions(model: Path) -> int:
    """``max_position_embeddings`` from the model's config.json (text_config followed)."""
    try:
        config = json.loads((Path(model) / "config.json").read_text())
    except (OSError, json.JSONDecodeError):
        return DEFAULT_MAX_MODEL_LEN
    config = config.get("text_config") or config
    return int(config.get("max_position_embeddings") or DEFAULT_MAX_MODEL_LEN)


CommandFactory = Callable[[ABConfig, Arm, int, int], list[str]]


def vllm_arm_command(config: ABConfig, arm: Arm, port: int, max_model_len: int) -> list[str]:
    """The vLLM server command line of `arm` under `config`."""
    return vllm_command(
        config.model,
        port,
        num_blocks=config.num_blocks,
        max_model_len=max_model_len,
        block_size=config.block_size,
        seed=config.seed,
        extra_args=arm.extra_args,
    )


def run_ab(
    config: ABConfig,
    arms: Sequence[Arm],
    *,
    progress: Progress | None = None,
    command: CommandFactory = vllm_arm_command,
) -> ABResult:
    """Run every arm in turn (one server at a time) and summarize each."""
    say = progress or (lambda message: None)
    started = time.monotonic()
    if config.num_blocks < 2 or config.requests < 1 or config.concurrency < 1:
        raise ConfigError("num_blocks must be >= 2, requests and concurrency >= 1")
    spec = load_model(config.model)
    count, tokenizer = load_token_counter(config.model)
    workload = build_workload(config.workload, config.requests, config.seed, count)
    max_model_len = config.resolved_max_model_len()
    if workload.max_request_tokens > max_model_len:
        raise ConfigError(
            f"the workload's longest request needs about {workload.max_request_tokens} tokens "
            f"but the server allows {max_model_len} (num-blocks {config.num_blocks} x "
            f"block-size {config.block_size}, less one block); raise --num-blocks"
        )
    log_dir = Path(config.log_dir or tempfile.mkdtemp(prefix="kvplug-ab-"))
    result = ABResult(config, workload.describe(), tokenizer, spec, max_model_len)
    say(f"{workload.describe()}; tokenizer: {tokenizer}; logs in {log_dir}")
    with _sigterm_as_exit():
        for arm in arms:
            why = arm.missing()
            if why:
                say(f"{arm.name}: unavailable ({why})")
                result.arms.append(ArmSummary(arm.name, available=False, note=why))
                continue
            log_path = log_dir / f"{arm.name}.log"
            try:
                summary = run_arm(
                    config, arm, workload, spec, log_path, max_model_len, say, command
                )
            except ServerError as exc:
                say(f"{arm.name}: failed: {exc}")
                first_line = str(exc).splitlines()[0].split("; command:")[0]
                summary = ArmSummary(
                    arm.name, available=False, note=first_line, log_path=str(log_path)
                )
            result.arms.append(summary)
    result.seconds = time.monotonic() - started
    return result


def run_arm(
    config: ABConfig,
    arm: Arm,
    workload: Workload,
    spec: ModelSpec,
    log_path: Path,
    max_model_len: int,
    say: Progress,
    command: CommandFactory = vllm_arm_command,
) -> ArmSummary:
    """Start `arm`'s server, drive `workload` against it, stop it, summarize."""
    port = free_port()
    argv = command(config, arm, port, max_model_len)
    say(f"{arm.name}: starting the server on port {port} (log: {log_path})")
    server = Server(argv, port, log_path, startup_timeout_s=config.startup_timeout_s)
    with server:
        say(f"{arm.name}: ready after {server.startup_s:.1f} s; sending {workload.requests} "
            f"requests, {config.concurrency} at a time")  # fmt: skip
        model = str(config.model)
        warm = warm_up(server.base_url, model, timeout_s=config.request_timeout_s)
        if not warm.ok:
            server.check_alive()
            raise server.error(f"the warm-up request failed: {warm.error}")
        before = _scrape(server)
        run = run_workload(
            server.base_url,
            model,
            workload,
            concurrency=config.concurrency,
            request_timeout_s=config.request_timeout_s,
            seed=config.seed,
        )
        server.check_alive()
        after = _scrape(server)
    summary = summarize(arm.name, run.results, run.wall_s, spec, after.since(before))
    summary.startup_s = server.startup_s
    summary.log_path = str(log_path)
    summary.server_args = list(arm.extra_args)
    say(f"{arm.name}: {summary.succeeded}/{summary.requests} requests succeeded in "
        f"{summary.duration_s:.1f} s; server stopped")  # fmt: skip
    return summary


def _scrape(server: Server) -> Metrics:
    status, text = server.get("/metrics")
    return parse_metrics(text) if status == 200 else Metrics()


@contextlib.contextmanager
def _sigterm_as_exit() -> Iterator[None]:
    """Turn SIGTERM into SystemExit while running, so servers are stopped on the way out
    (Ctrl-C already raises KeyboardInterrupt). Only possible in the main thread."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def handler(signum: int, frame: object) -> None:
        sys.exit(128 + signum)

    previous = signal.signal(signal.SIGTERM, handler)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)
