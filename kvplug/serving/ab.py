"""The server A/B: each arm's server in turn, same model, KV budget and workload.

An `Arm` is a name and the extra server arguments that make it what it is: none for the
stock engine; the engine's kvplug switch for kvplug (`kvplug.serving.engines`). `run_ab`
builds the seeded workload once, then, `repeat` times over, for each arm in turn (so the
arms' runs interleave) starts a server on a free port, sends one warm-up request, drives
the workload, scrapes ``/metrics`` before and after, stops the server, and summarizes.
Each arm's runs are then combined: the median of each figure, with every run kept for the
spread. An arm whose module is not importable, or whose server fails, is reported as
unavailable with the reason; it never aborts the other arms.
"""

from __future__ import annotations

import contextlib
import json
import signal
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

from kvplug.core.model_spec import ModelSpec, load_model
from kvplug.errors import ConfigError
from kvplug.serving.client import run_workload, warm_up
from kvplug.serving.engines import (
    ENGINES,
    KVPLUG,
    KVPLUG_SCHEDULER,
    VLLM,
    Arm,
    Engine,
    ServerBudget,
    vllm_kvplug_args,
)
from kvplug.serving.metrics import Metrics, PrefixCounters, parse_metrics, sum_metrics
from kvplug.serving.routers import (
    ROUTERS,
    check_policy,
    find_router,
    router_named,
    router_view,
)
from kvplug.serving.server import (
    HOST,
    Server,
    ServerError,
    free_port,
    http_get,
    start_on_free_port,
)
from kvplug.serving.stats import ArmSummary, combine, summarize
from kvplug.serving.tokens import load_token_counter
from kvplug.serving.vllm_bench import (
    CLIENTS,
    BenchClientError,
    PrefixRepetition,
    bench_command,
    run_bench,
    summarize_bench,
)
from kvplug.serving.workload import Workload, build_workload

__all__ = ["KVPLUG", "Arm", "ABConfig", "ABResult", "run_ab", "stock_arm", "kvplug_arm"]

DEFAULT_MAX_MODEL_LEN = 4096  # when config.json names no max_position_embeddings

Progress = Callable[[str], None]


def stock_arm(engine: Engine = VLLM) -> Arm:
    return engine.stock_arm()


def kvplug_arm(config: dict | None = None, scheduler_cls: str = KVPLUG_SCHEDULER) -> Arm:
    """vLLM with kvplug's scheduler; `config` goes to ``--additional-config`` as
    ``{"kvplug": config}`` (e.g. ``{"policy": "cost"}``). Other engines:
    `Engine.kvplug_arm`."""
    args = vllm_kvplug_args(config, scheduler_cls)
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
    engine: str = VLLM.name  # a key of `kvplug.serving.engines.ENGINES`
    repeat: int = 1  # runs per arm, interleaved across arms
    client: str = "kvplug"  # or "vllm-bench": vLLM's own client (`kvplug.serving.vllm_bench`)
    bench_args: tuple[str, ...] = ()  # extra flags for vLLM's client
    output_tokens: int | None = None  # each answer's most tokens; None: the workload's own
    # a fleet: `servers` servers per arm behind `router` (`kvplug.serving.routers`), which
    # routes by `router_policy`; None: one server, no router
    servers: int = 1
    router: str | None = None
    router_policy: str = "cache_aware"
    router_bin: str | None = None  # the router's executable; None: found on PATH

    @property
    def server_engine(self) -> Engine:
        try:
            return ENGINES[self.engine]
        except KeyError:
            raise ConfigError(
                f"unknown engine {self.engine!r}; expected one of {', '.join(ENGINES)}"
            ) from None

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
            "output_tokens": self.config.output_tokens,
            "num_blocks": self.config.num_blocks,
            "block_size": self.config.block_size,
            "max_model_len": self.max_model_len,
            "seed": self.config.seed,
            "engine": self.config.engine,
            "repeat": self.config.repeat,
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


def engine_arm_command(config: ABConfig, arm: Arm, port: int, max_model_len: int) -> list[str]:
    """The server command line of `arm` under `config`, for `config`'s engine."""
    budget = ServerBudget(
        config.model, port, config.num_blocks, config.block_size, max_model_len, config.seed
    )
    return config.server_engine.command(budget, arm.extra_args)


def run_ab(
    config: ABConfig,
    arms: Sequence[Arm],
    *,
    progress: Progress | None = None,
    command: CommandFactory = engine_arm_command,
) -> ABResult:
    """Run every arm in turn (one server at a time), `config.repeat` rounds, and
    summarize each arm over its runs (`combine`)."""
    say = progress or (lambda message: None)
    started = time.monotonic()
    if config.num_blocks < 2 or min(config.requests, config.concurrency, config.repeat) < 1:
        raise ConfigError("num_blocks must be >= 2, requests, concurrency and repeat >= 1")
    check_fleet(config)
    if config.client not in CLIENTS or (config.client != "kvplug" and config.engine != VLLM.name):
        raise ConfigError(
            f"client {config.client!r} cannot drive engine {config.engine!r}; expected "
            f"{CLIENTS[0]!r} (any engine) or {CLIENTS[1]!r} (engine vllm)"
        )
    counters = config.server_engine.counters
    spec = load_model(config.model)
    max_model_len = config.resolved_max_model_len()
    workload: Workload | PrefixRepetition
    if config.client == "kvplug":
        count, tokenizer = load_token_counter(config.model)
        workload = build_workload(
            config.workload, config.requests, config.seed, count, config.output_tokens
        )
        longest, described = workload.max_request_tokens, workload.describe()
    else:
        kv_tokens = config.num_blocks * config.block_size
        workload = PrefixRepetition.for_budget(kv_tokens, max_model_len, config.requests)
        longest, tokenizer = workload.request_tokens, "vLLM's client"
        described = f"vLLM's benchmark client, {workload.describe(config.requests)}"
    if longest > max_model_len:
        raise ConfigError(
            f"the workload's longest request needs about {longest} tokens "
            f"but the server allows {max_model_len} (num-blocks {config.num_blocks} x "
            f"block-size {config.block_size}, less one block); raise --num-blocks"
        )
    log_dir = Path(config.log_dir or tempfile.mkdtemp(prefix="kvplug-ab-"))
    result = ABResult(config, described, tokenizer, spec, max_model_len)
    say(f"{described}; tokenizer: {tokenizer}; logs in {log_dir}")
    runs: dict[str, list[ArmSummary]] = {arm.name: [] for arm in arms}
    with _sigterm_as_exit():
        for round_index in range(config.repeat):
            for arm in arms:
                name = arm.name if config.repeat == 1 else f"{arm.name}#{round_index + 1}"
                runs[arm.name].append(
                    _run_or_note(
                        config,
                        arm,
                        name,
                        workload,
                        spec,
                        log_dir,
                        max_model_len,
                        say,
                        command,
                        counters,
                    )  # fmt: skip
                )
    if config.repeat == 1:
        result.arms = [runs[arm.name][0] for arm in arms]
    else:
        result.arms = [combine(runs[arm.name]) for arm in arms]
    result.seconds = time.monotonic() - started
    return result


def _run_or_note(
    config: ABConfig,
    arm: Arm,
    run_name: str,
    workload: Workload | PrefixRepetition,
    spec: ModelSpec,
    log_dir: Path,
    max_model_len: int,
    say: Progress,
    command: CommandFactory,
    counters: PrefixCounters,
) -> ArmSummary:
    """One run of `arm` (its log named `run_name`), or an unavailable summary saying why."""
    why = arm.missing()
    if why:
        say(f"{run_name}: unavailable ({why})")
        return ArmSummary(arm.name, available=False, note=why)
    log_path = log_dir / f"{run_name}.log"
    try:
        if config.router is not None:
            assert isinstance(workload, Workload)  # (`check_fleet`: kvplug's client)
            return run_fleet_arm(config, arm, workload, spec, log_path, max_model_len, say,
                                 command, counters, run_name)  # fmt: skip
        return run_arm(config, arm, workload, spec, log_path, max_model_len, say, command,
                       counters, run_name)  # fmt: skip
    except (ServerError, BenchClientError) as exc:
        say(f"{run_name}: failed: {exc}")
        first_line = str(exc).splitlines()[0].split("; command:")[0]
        return ArmSummary(arm.name, available=False, note=first_line, log_path=str(log_path))


def check_fleet(config: ABConfig) -> None:
    """Raise `ConfigError` unless `config`'s fleet can run: several servers need a
    router, which must be installed and know the policy; vLLM's own client drives one
    server."""
    if config.servers < 1:
        raise ConfigError(f"servers must be >= 1, got {config.servers}")
    if config.router is None:
        if config.servers > 1:
            raise ConfigError(
                f"{config.servers} servers need a router in front (--router {' or '.join(ROUTERS)})"
            )
        return
    router = router_named(config.router)
    check_policy(router, config.router_policy)
    find_router(router, config.router_bin)
    if config.client != "kvplug":
        raise ConfigError("a fleet is driven by kvplug's client only (--client kvplug)")


def run_arm(
    config: ABConfig,
    arm: Arm,
    workload: Workload | PrefixRepetition,
    spec: ModelSpec,
    log_path: Path,
    max_model_len: int,
    say: Progress,
    command: CommandFactory = engine_arm_command,
    counters: PrefixCounters | None = None,
    run_name: str | None = None,
) -> ArmSummary:
    """Start `arm`'s server, drive `workload` against it (kvplug's client, or vLLM's for
    a `PrefixRepetition`), stop it, summarize."""
    name = run_name or arm.name

    def make(port: int) -> Server:
        say(f"{name}: starting the server on port {port} (log: {log_path})")
        argv = command(config, arm, port, max_model_len)
        return Server(
            argv, port, log_path, env=dict(arm.env), startup_timeout_s=config.startup_timeout_s
        )

    server = start_on_free_port(make)
    with server:
        say(f"{name}: ready after {server.startup_s:.1f} s; sending {config.requests} "
            f"requests, {config.concurrency} at a time")  # fmt: skip
        model = str(config.model)
        warm = warm_up(server.base_url, model, timeout_s=config.request_timeout_s)
        if not warm.ok:
            server.check_alive()
            raise server.error(f"the warm-up request failed: {warm.error}")
        before = _scrape(server)
        if isinstance(workload, PrefixRepetition):
            result_dir = log_path.parent
            bench = bench_command(
                server.base_url, config.model, requests=config.requests,
                concurrency=config.concurrency, seed=config.seed, dataset=workload,
                result_dir=result_dir, result_file=f"{log_path.stem}.vllm-bench.json",
                extra_args=config.bench_args,
            )  # fmt: skip
            timeout = config.request_timeout_s * max(config.requests, 1)
            bench_result = run_bench(bench, log_path.with_suffix(".client.log"), timeout)
        else:
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
    counters = counters or config.server_engine.counters
    if isinstance(workload, PrefixRepetition):
        summary = summarize_bench(arm.name, bench_result, after.since(before), counters)
    else:
        summary = summarize(arm.name, run.results, run.wall_s, spec, after.since(before), counters)
    return _ran(summary, arm, log_path, server.startup_s, say, f"{name}: ", "server stopped")


def run_fleet_arm(
    config: ABConfig,
    arm: Arm,
    workload: Workload,
    spec: ModelSpec,
    log_path: Path,
    max_model_len: int,
    say: Progress,
    command: CommandFactory,
    counters: PrefixCounters,
    run_name: str,
) -> ArmSummary:
    """Start `config.servers` servers of `arm` (at once) and the router in front of them,
    warm each server up, drive `workload` through the router, stop them all, summarize:
    the servers' counters summed, each server's prefix lookups and hits, and the router's
    own per-worker counters."""
    router = router_named(config.router or "")
    binary = find_router(router, config.router_bin)
    servers: list[Server] = []
    front: Server | None = None
    try:
        with ThreadPoolExecutor(config.servers) as pool:
            starts = [
                pool.submit(_start_server, config, arm, log_path, i, max_model_len, say, command)
                for i in range(config.servers)
            ]
            failures = []
            for start in starts:  # each started is kept, to be stopped, if another failed
                try:
                    servers.append(start.result())
                except Exception as exc:  # noqa: BLE001 (re-raised below, once all are in)
                    failures.append(exc)
        if failures:
            raise failures[0]
        workers = [server.base_url for server in servers]
        metrics_port = free_port()

        def make_router(port: int) -> Server:
            argv = router.command(binary, port, metrics_port, workers, config.router_policy)
            return Server(argv, port, log_path.with_suffix(".router.log"),
                          startup_timeout_s=120.0, health_path=router.ready_path)  # fmt: skip

        front = start_on_free_port(make_router)
        say(f"{run_name}: {router.name} ({config.router_policy}) on port {front.port} in "
            f"front of {', '.join(workers)}; sending {config.requests} requests, "
            f"{config.concurrency} at a time")  # fmt: skip
        model = str(config.model)
        for server in servers:
            warm = warm_up(server.base_url, model, timeout_s=config.request_timeout_s)
            if not warm.ok:
                server.check_alive()
                raise server.error(f"the warm-up request failed: {warm.error}")
        before = [_scrape(server) for server in servers]
        run = run_workload(
            front.base_url,
            model,
            workload,
            concurrency=config.concurrency,
            request_timeout_s=config.request_timeout_s,
            seed=config.seed,
        )
        for server in [*servers, front]:
            server.check_alive()
        deltas = [_scrape(server).since(b) for server, b in zip(servers, before, strict=True)]
        view = router_view(router, http_get(f"http://{HOST}:{metrics_port}/metrics")[1])
        for i, url in enumerate(workers):  # each run's ports differ: name the servers
            view = {name.replace(url, f"server {i + 1}"): value for name, value in view.items()}
    finally:
        for server in [front, *servers]:
            if server is not None:
                server.stop()
    summary = summarize(arm.name, run.results, run.wall_s, spec, sum_metrics(deltas), counters)
    summary.server_queries = [delta.get(counters.queries) or 0.0 for delta in deltas]
    summary.server_hits = [delta.get(counters.hits) or 0.0 for delta in deltas]
    summary.router_view = view
    startup = max(server.startup_s for server in servers)
    return _ran(summary, arm, log_path, startup, say, f"{run_name}: ", "servers stopped")


def _ran(
    summary: ArmSummary,
    arm: Arm,
    log_path: Path,
    startup_s: float,
    say: Progress,
    prefix: str,
    stopped: str,
) -> ArmSummary:
    """`summary` of a run of `arm` that ended, with its start-up time, log and server
    arguments; said in one progress line."""
    summary.startup_s = startup_s
    summary.log_path = str(log_path)
    summary.server_args = list(arm.extra_args)
    say(f"{prefix}{summary.succeeded}/{summary.requests} requests succeeded in "
        f"{summary.duration_s:.1f} s; {stopped}")  # fmt: skip
    return summary


def _start_server(
    config: ABConfig,
    arm: Arm,
    log_path: Path,
    index: int,
    max_model_len: int,
    say: Progress,
    command: CommandFactory,
) -> Server:
    """Server `index` of a fleet arm, started (its log beside `log_path`)."""
    path = log_path.with_name(f"{log_path.stem}.server{index + 1}.log")

    def make(port: int) -> Server:
        say(f"{log_path.stem}: starting server {index + 1} on port {port} (log: {path})")
        argv = command(config, arm, port, max_model_len)
        argv += router_named(config.router or "").args_for(config.engine)
        return Server(argv, port, path, env=dict(arm.env),
                      startup_timeout_s=config.startup_timeout_s)  # fmt: skip

    return start_on_free_port(make)


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
