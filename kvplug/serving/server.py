"""One OpenAI-compatible server as a subprocess: start, wait for health, scrape, stop.

The server runs in its own process group (session) with its output in a log file, so
stopping it ends every process it spawned (vLLM's engine core and workers too), and a
Ctrl-C in the terminal reaches only the harness, which then stops the server itself.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Sequence
from pathlib import Path
from types import TracebackType

from kvplug.errors import KVPlugError

HOST = "127.0.0.1"
# vLLM CPU sizes its KV cache from this (GiB) and would otherwise claim most of the RAM;
# `--num-gpu-blocks-override` then caps the blocks actually used.
DEFAULT_ENV = {"VLLM_CPU_KVCACHE_SPACE": "1", "PYTHONUNBUFFERED": "1"}


class ServerError(KVPlugError):
    """The server did not come up, or died; the message ends with its log's tail."""


class PortTakenError(ServerError):
    """Another process took the server's port between `free_port` and the server's bind:
    start it again on a new port (`start_on_free_port`)."""


PORT_TAKEN = "address already in use"  # the bind error in a server's log


def free_port(host: str = HOST) -> int:
    """A TCP port nobody listens on right now (the OS picks it)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind((host, 0))
        return sock.getsockname()[1]


def vllm_command(
    model: str | Path,
    port: int,
    *,
    num_blocks: int,
    max_model_len: int,
    block_size: int = 32,
    seed: int = 0,
    extra_args: Sequence[str] = (),
    python: str = sys.executable,
) -> list[str]:
    """The command line of a vLLM OpenAI server with a fixed KV budget of `num_blocks`."""
    return [
        python,
        "-m",
        "vllm.entrypoints.openai.api_server",
        "--model",
        str(model),
        "--host",
        HOST,
        "--port",
        str(port),
        "--enforce-eager",
        "--block-size",
        str(block_size),
        "--num-gpu-blocks-override",
        str(num_blocks),
        "--max-model-len",
        str(max_model_len),
        "--seed",
        str(seed),
        "--enable-prefix-caching",
        "--enable-prompt-tokens-details",
        *extra_args,
    ]


def http_get(url: str, timeout: float = 10.0) -> tuple[int, str]:
    """Status and body of a GET; status 0 when nothing answered."""
    try:
        with urllib.request.urlopen(url, timeout=timeout) as response:
            return response.status, response.read().decode("utf-8", "replace")
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read().decode("utf-8", "replace")
    except (urllib.error.URLError, OSError):
        return 0, ""


def tail(path: Path, lines: int = 40) -> str:
    """The last `lines` lines of a text file ("" if it does not exist)."""
    try:
        text = path.read_text(errors="replace")
    except OSError:
        return ""
    return "\n".join(text.splitlines()[-lines:])


class Server:
    """A server process started from `command` (which must listen on `port`).

    Use as a context manager: entering starts it (unless it runs) and waits until
    ``GET /health`` answers 200; leaving stops the whole process group, whatever happened
    inside.
    """

    def __init__(
        self,
        command: Sequence[str],
        port: int,
        log_path: str | Path,
        *,
        env: dict[str, str] | None = None,
        startup_timeout_s: float = 300.0,
        stop_timeout_s: float = 30.0,
        health_path: str = "/health",
    ) -> None:
        """`health_path`: what answers 200 once the server is ready."""
        self.command = list(command)
        self.health_path = health_path
        self.port = port
        self.log_path = Path(log_path)
        self.env = {**DEFAULT_ENV, **os.environ, **(env or {})}
        self.startup_timeout_s = startup_timeout_s
        self.stop_timeout_s = stop_timeout_s
        self.process: subprocess.Popen | None = None
        self.pgid: int | None = None  # its process group, kept after it is stopped
        self.startup_s = 0.0

    @property
    def base_url(self) -> str:
        return f"http://{HOST}:{self.port}"

    def start(self) -> None:
        """Start the process and wait until it is healthy; on failure stop it and raise."""
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        started = time.monotonic()
        with open(self.log_path, "wb") as log:
            self.process = subprocess.Popen(
                self.command,
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT,
                env=self.env,
                start_new_session=True,
            )
        self.pgid = self.process.pid  # its own session: the group id is its pid
        try:
            self._wait_healthy(started)
        except BaseException:
            self.stop()
            raise
        self.startup_s = time.monotonic() - started

    def _wait_healthy(self, started: float) -> None:
        deadline = started + self.startup_timeout_s
        while True:
            code = self.process.poll()
            if code is not None:
                raise self.error(f"the server exited with status {code} during start-up")
            if http_get(f"{self.base_url}{self.health_path}", timeout=2.0)[0] == 200:
                return
            if PORT_TAKEN in tail(self.log_path, 20):
                raise PortTakenError(str(self.error(f"port {self.port} was taken meanwhile")))
            if time.monotonic() > deadline:
                raise self.error(f"the server was not healthy after {self.startup_timeout_s:.0f} s")
            time.sleep(0.5)

    def alive(self) -> bool:
        return self.process is not None and self.process.poll() is None

    def check_alive(self) -> None:
        """Raise `ServerError` if the server process has exited."""
        if self.process is not None and not self.alive():
            raise self.error(f"the server died (exit status {self.process.returncode})")

    def error(self, message: str) -> ServerError:
        return ServerError(
            f"{message}; command: {' '.join(self.command)}\n"
            f"last lines of {self.log_path}:\n{tail(self.log_path)}"
        )

    def get(self, path: str, timeout: float = 10.0) -> tuple[int, str]:
        return http_get(f"{self.base_url}{path}", timeout)

    def stop(self) -> None:
        """SIGTERM the process group, wait, then SIGKILL whatever is left. Idempotent."""
        if self.process is None:
            return
        pgid = self.process.pid  # its own session: the group id is its pid
        _signal_group(pgid, signal.SIGTERM)
        try:
            self.process.wait(timeout=self.stop_timeout_s)
        except subprocess.TimeoutExpired:
            _signal_group(pgid, signal.SIGKILL)
            self.process.wait()
        # children (engine core, workers) may still be shutting down; give them a moment
        deadline = time.monotonic() + 10
        while _signal_group(pgid, 0) and time.monotonic() < deadline:
            time.sleep(0.2)
        _signal_group(pgid, signal.SIGKILL)
        self.process = None

    def __enter__(self) -> Server:
        if self.process is None:  # (`start_on_free_port` started it already)
            self.start()
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        traceback: TracebackType | None,
    ) -> None:
        self.stop()


def start_on_free_port(make: Callable[[int], Server], attempts: int = 3) -> Server:
    """`make(port)` started on a free port, on a new one each time another process takes
    the port first (`PortTakenError`), at most `attempts` times."""
    attempt = 1
    while True:
        server = make(free_port())
        try:
            server.start()
        except PortTakenError:
            if attempt >= attempts:
                raise
            attempt += 1
        else:
            return server


def _signal_group(pgid: int, sig: int) -> bool:
    """Send `sig` to process group `pgid`; False if the group no longer exists."""
    try:
        os.killpg(pgid, sig)
    except ProcessLookupError:
        return False
    except PermissionError:  # a zombie-only group on some systems
        return False
    return True
