"""Start, probe and stop a real vLLM OpenAI API server for tests (no test code here).

A server runs in its own process group (``start_new_session=True``) with its stdout and
stderr in one log file, so a test can read what vLLM and kvplug logged, and can stop the
API server together with the engine-core and worker processes it spawned.
"""

from __future__ import annotations

import contextlib
import json
import os
import random
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import psutil
from prometheus_client.parser import text_string_to_metric_families

BLOCK_SIZE = 32
MAX_MODEL_LEN = 1024
KVPLUG_SCHEDULER = "kvplug.vllm.Scheduler"


def _ephemeral_range() -> tuple[int, int]:
    try:
        low, high = Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()
        return int(low), int(high)
    except (OSError, ValueError):
        return 32768, 60999


def free_port(span: int = 1) -> int:
    """The first of ``span`` consecutive TCP ports nobody listens on right now.

    The ports come from below the kernel's ephemeral range: a port the kernel hands out for
    ``bind(0)`` (as vLLM does for its own internal sockets) could be handed out again to a
    server process before the test's server binds it, and a data-parallel server binds
    ``port + rank`` for its KV-event publishers, a port nobody checked.
    """
    low, _ = _ephemeral_range()
    rng = random.Random()
    for _ in range(1000):
        first = rng.randrange(10000, max(10001, low - span))
        if all(_port_is_free(first + offset) for offset in range(span)):
            return first
    raise RuntimeError(f"no {span} consecutive free TCP ports below {low}")


def _port_is_free(port: int) -> bool:
    with socket.socket() as sock:
        try:
            sock.bind(("0.0.0.0", port))
        except OSError:
            return False
        return True


@dataclass
class Completion:
    """What the test sent and what the server said about it."""

    prompt: str
    tenant: str | None
    prompt_tokens: int
    cached_tokens: int
    text: str


@dataclass
class Server:
    """A vLLM API server process group and every completion sent to it through `complete`."""

    process: subprocess.Popen[bytes]
    port: int
    model: str
    log_path: Path
    metrics_dir: Path  # $KVPLUG_METRICS_DIR: where kvplug's engine core writes snapshots
    sent: list[Completion] = field(default_factory=list)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def pgid(self) -> int:
        return self.process.pid  # the leader of its own session and process group

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def complete(
        self,
        prompt: str,
        max_tokens: int = 4,
        tenant: str | None = None,
        xargs: dict[str, Any] | None = None,
        user: str | None = None,
    ) -> Completion:
        """One greedy /v1/completions request, recorded in `sent`; `xargs`: more
        ``vllm_xargs`` (kvplug's per-request arguments); `user`: the OpenAI user field."""
        body: dict[str, Any] = {
            "model": self.model,
            "prompt": prompt,
            "max_tokens": max_tokens,
            "temperature": 0,
            "ignore_eos": True,
        }
        if user is not None:
            body["user"] = user
        if tenant is not None or xargs:
            body["vllm_xargs"] = {**({"kvplug_tenant": tenant} if tenant else {}), **(xargs or {})}
        response = httpx.post(f"{self.url}/v1/completions", json=body, timeout=120)
        response.raise_for_status()
        data = response.json()
        usage = data["usage"]
        details = usage.get("prompt_tokens_details") or {}
        completion = Completion(
            prompt=prompt,
            tenant=tenant,
            prompt_tokens=int(usage["prompt_tokens"]),
            cached_tokens=int(details.get("cached_tokens") or 0),
            text=data["choices"][0]["text"],
        )
        self.sent.append(completion)
        return completion

    def tokenize(self, prompt: str) -> list[int]:
        """The prompt's token ids as /v1/completions sees them (special tokens included)."""
        body = {"model": self.model, "prompt": prompt}
        response = httpx.post(f"{self.url}/tokenize", json=body, timeout=60)
        response.raise_for_status()
        return [int(t) for t in response.json()["tokens"]]

    def metrics_text(self) -> str:
        response = httpx.get(f"{self.url}/metrics", timeout=30)
        response.raise_for_status()
        return response.text

    def metrics(self) -> dict[str, float]:
        """Every sample of /metrics by sample name, summed over label sets."""
        return parse_metrics(self.metrics_text())


def parse_metrics(text: str) -> dict[str, float]:
    """Sample name (``vllm:prefix_cache_hits_total``, ``kvplug_bytes_held``) -> value,
    summed over label sets (these tests run one engine)."""
    values: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            values[sample.name] = values.get(sample.name, 0.0) + float(sample.value)
    return values


SERVE_CLI = str(Path(__file__).with_name("vllm_serve_cli.py"))


def server_command(
    model: str,
    port: int,
    num_blocks: int,
    extra: Sequence[str] = (),
    kvplug: Any = None,
    serve_cli: bool = False,
) -> list[str]:
    """The API server command line; `kvplug` (a dict) enables kvplug with that config.
    `serve_cli`: ``vllm serve`` (needed for data parallelism and several API servers)
    instead of the single API server module."""
    entry = [SERVE_CLI] if serve_cli else ["-m", "vllm.entrypoints.openai.api_server"]
    command = [
        sys.executable, *entry,
        "--model", model,
        "--host", "127.0.0.1",
        "--port", str(port),
        "--enforce-eager",
        "--block-size", str(BLOCK_SIZE),
        "--num-gpu-blocks-override", str(num_blocks),
        "--max-model-len", str(MAX_MODEL_LEN),
        "--gpu-memory-utilization", "0.25",
        "--dtype", "bfloat16",
        "--enable-prompt-tokens-details",
        "--seed", "0",
    ]  # fmt: skip
    if kvplug is not None:
        command += ["--scheduler-cls", KVPLUG_SCHEDULER]
        command += ["--additional-config", json.dumps({"kvplug": kvplug})]
    return command + list(extra)


def launch(
    model: str,
    log_path: Path,
    num_blocks: int,
    extra: Sequence[str] = (),
    kvplug: Any = None,
    serve_cli: bool = False,
) -> Server:
    """Start a server in its own process group; returns at once (see `wait_healthy`)."""
    port = free_port()
    env = dict(os.environ)
    # kvplug's snapshot folder, named here rather than /tmp/kvplug-metrics-<API server pid>
    # (the plugin's default), which outlives the server and could be a dead one's.
    metrics_dir = log_path.parent / "kvplug-metrics"
    env["KVPLUG_METRICS_DIR"] = str(metrics_dir)
    env["PYTHONUNBUFFERED"] = "1"
    if serve_cli:  # a script puts its own folder on sys.path; `-m` would put the checkout's
        repo = str(Path(__file__).resolve().parents[2])
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [repo, env.get("PYTHONPATH")]))
    with log_path.open("wb") as log:
        process = subprocess.Popen(
            server_command(model, port, num_blocks, extra, kvplug, serve_cli),
            stdin=subprocess.DEVNULL,
            stdout=log,
            stderr=subprocess.STDOUT,
            env=env,
            start_new_session=True,
        )
    return Server(process, port, model, log_path, metrics_dir)


def wait_healthy(server: Server, timeout_s: float = 300.0) -> None:
    """Poll GET /health until it answers 200; fail early if the server exits."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if server.process.poll() is not None:
            raise RuntimeError(
                f"vLLM server exited with {server.process.returncode} before it was healthy:\n"
                + tail(server.log())
            )
        try:
            if httpx.get(f"{server.url}/health", timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    raise TimeoutError(f"vLLM server not healthy after {timeout_s:.0f} s:\n" + tail(server.log()))


def wait_exit(server: Server, timeout_s: float) -> int | None:
    """The server's exit status once it exits on its own, or None after `timeout_s`."""
    try:
        return server.process.wait(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        return None


def group_members(pgid: int) -> list[psutil.Process]:
    """Live (not zombie) processes of process group `pgid`."""
    members = []
    for process in psutil.process_iter(["status"]):
        try:
            if os.getpgid(process.pid) == pgid and process.info["status"] != psutil.STATUS_ZOMBIE:
                members.append(process)
        except (ProcessLookupError, psutil.Error):
            continue
    return members


def wait_group_gone(pgid: int, timeout_s: float) -> list[psutil.Process]:
    """Wait until no live process of the group is left; returns those still alive."""
    deadline = time.monotonic() + timeout_s
    while True:
        members = group_members(pgid)
        if not members or time.monotonic() >= deadline:
            return members
        time.sleep(0.2)


def stop(server: Server, grace_s: float = 20.0) -> None:
    """SIGTERM the whole process group, then SIGKILL whatever is left after `grace_s`."""
    pgid = server.pgid
    with contextlib.suppress(ProcessLookupError):
        os.killpg(pgid, signal.SIGTERM)
    if wait_exit(server, grace_s) is None or wait_group_gone(pgid, 5.0):
        with contextlib.suppress(ProcessLookupError):
            os.killpg(pgid, signal.SIGKILL)
        server.process.wait(timeout=30)
        wait_group_gone(pgid, 10.0)


def tail(text: str, lines: int = 60) -> str:
    return "\n".join(text.splitlines()[-lines:])
