"""The load balancers a fleet A/B puts in front of its servers: ``vllm-router`` and
``sglang-router``, the Rust routers on PyPI, each started from its own console script.

Both take the workers' URLs, a routing policy (``cache_aware`` by default: a request goes
to the worker whose routed prefixes it shares most, unless the load is out of balance,
then to the least loaded) and a port for their own Prometheus metrics. ``vllm-router``
opens its port once every worker answers ``/health`` and, under ``cache_aware``, asks a
worker to tokenize each prompt (vLLM's ``/tokenize``); ``sglang-router`` answers
``/health`` at once and ``/readiness`` once its workers are registered. vLLM renders
prompts for ``vllm-router`` only when started with ``--enable-scale-out``
(`Router.args_for`). What each router
counts per worker (`ROUTER_SAMPLES`) is its own view of the fleet.
"""

from __future__ import annotations

import shutil
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from kvplug.errors import ConfigError


@dataclass(frozen=True)
class Router:
    """One router as a fleet A/B starts it."""

    name: str  # its console script, and the --router value
    launch: tuple[str, ...]  # arguments before the options (sglang-router: "launch")
    policies: tuple[str, ...]
    ready_path: str  # answers 200 once the workers are registered
    samples: tuple[str, ...]  # its metric families that count per worker
    # what each engine's servers must be started with for it, by engine name
    worker_args: tuple[tuple[str, tuple[str, ...]], ...] = ()

    def args_for(self, engine: str) -> tuple[str, ...]:
        """The extra server arguments `engine`'s workers need behind this router."""
        return dict(self.worker_args).get(engine, ())

    def command(
        self,
        binary: str,
        port: int,
        metrics_port: int,
        workers: Sequence[str],
        policy: str,
        host: str = "127.0.0.1",
    ) -> list[str]:
        """The command line of this router on `port` in front of `workers` (URLs)."""
        check_policy(self, policy)
        command = [binary, *self.launch, "--host", host, "--port", str(port)]
        command += ["--worker-urls", *workers, "--policy", policy]
        command += ["--prometheus-host", host, "--prometheus-port", str(metrics_port)]
        if self.name == "vllm-router":  # else it waits 30 s to look again at a slow worker
            command += ["--worker-startup-check-interval", "1"]
        return command


ROUTERS = {
    "vllm-router": Router(
        "vllm-router",
        (),
        (
            "cache_aware",
            "round_robin",
            "random",
            "power_of_two",
            "consistent_hash",
            "kv_aware",
            "sticky_least_loaded",
        ),
        "/health",
        (
            "vllm_router_processed_requests_total",
            "vllm_router_prefix_routing_decisions_total",
        ),
        # cache_aware tokenizes each prompt through vLLM's render endpoint, which vLLM
        # answers only with it (else 403, and the router routes by load alone)
        (("vllm", ("--enable-scale-out",)),),
    ),
    "sglang-router": Router(
        "sglang-router",
        ("launch",),
        ("cache_aware", "round_robin", "random", "power_of_two"),
        "/readiness",
        ("smg_worker_cb_outcomes_total",),
    ),
}
# the router an engine's fleet uses unless told otherwise
DEFAULT_ROUTER = {"vllm": "vllm-router", "sglang": "sglang-router"}


def router_named(name: str) -> Router:
    """The router `name`, or a `ConfigError` naming the accepted ones."""
    try:
        return ROUTERS[name]
    except KeyError:
        raise ConfigError(f"unknown router {name!r}; accepted: {', '.join(ROUTERS)}") from None


def check_policy(router: Router, policy: str) -> None:
    if policy not in router.policies:
        raise ConfigError(
            f"{router.name} has no routing policy {policy!r}; accepted: "
            f"{', '.join(router.policies)}"
        )


def find_router(router: Router, binary: str | None = None) -> str:
    """The router's executable: `binary` if given, else its console script on ``PATH`` or
    beside this Python's; a `ConfigError` saying how to install it otherwise."""
    if binary is not None:
        if not Path(binary).is_file():
            raise ConfigError(f"router executable {binary!r} does not exist")
        return binary
    found = shutil.which(router.name)
    if found:
        return found
    beside = Path(sys.executable).parent / router.name
    if beside.is_file():
        return str(beside)
    raise ConfigError(
        f"{router.name} is not installed here: pip install {router.name} (in any "
        f"environment; pass its path with --router-bin), or run a single server"
    )


def router_view(router: Router, text: str) -> dict[str, float]:
    """The router's per-worker samples (`Router.samples`) from its Prometheus text, by
    sample line (``name{labels}``), for the report."""
    view: dict[str, float] = {}
    for line in text.splitlines():
        if line.startswith(router.samples):
            sample, _, value = line.rpartition(" ")
            try:
                view[sample] = view.get(sample, 0.0) + float(value)
            except ValueError:
                continue
    return view
