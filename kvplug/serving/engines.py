"""What differs between engines in the server A/B: command line, arms and counter names.

An `Engine` is data plus one function: how to start its OpenAI-compatible server with a
fixed KV budget (`ABConfig.num_blocks` x `ABConfig.block_size` tokens), what makes its
kvplug arm, and which Prometheus counters are its prefix-cache queries and hits. The
rest of the A/B (workload, client, summary, report) is the same for every engine.

- vLLM: ``--num-gpu-blocks-override`` blocks of ``--block-size`` tokens; kvplug is
  ``--scheduler-cls kvplug.vllm.Scheduler`` (``--additional-config`` for its settings);
  counters ``vllm:prefix_cache_queries`` / ``vllm:prefix_cache_hits``.
- SGLang: ``--max-total-tokens`` (the same number of tokens; SGLang's radix cache pages
  one token at a time by default); kvplug is ``--radix-cache-backend kvplug
  --radix-eviction-policy kvplug-<policy>`` (``--radix-eviction-policy-config`` for its
  settings); counters ``sglang:prompt_tokens`` / ``sglang:cached_tokens`` (per finished
  request, from the tokenizer manager). With ``SGLANG_USE_CPU_ENGINE=1`` in the
  environment the server runs on the CPU (``--device cpu --attention-backend
  torch_native``).
"""

from __future__ import annotations

import json
import os
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

from kvplug.serving.metrics import SGLANG_COUNTERS, VLLM_COUNTERS, PrefixCounters
from kvplug.serving.server import HOST, vllm_command

KVPLUG = "kvplug"
KVPLUG_SCHEDULER = "kvplug.vllm.Scheduler"
SGLANG_BACKEND = "kvplug"  # --radix-cache-backend
SGLANG_POLICY_PREFIX = "kvplug-"  # --radix-eviction-policy kvplug-<kvplug policy>
DEFAULT_POLICY = "cost"


@dataclass(frozen=True)
class Arm:
    """A server configuration: `extra_args` are added to the engine's common command
    line, `env` to its environment; `requires` names a module that must be importable
    for the arm to run."""

    name: str
    extra_args: tuple[str, ...] = ()
    requires: str | None = None
    env: tuple[tuple[str, str], ...] = ()

    def missing(self) -> str | None:
        """Why the arm cannot run here, or None."""
        import importlib.util

        if self.requires is None:
            return None
        try:
            found = importlib.util.find_spec(self.requires) is not None
        except (ImportError, ValueError):
            found = False
        return None if found else f"{self.requires} is not importable"


@dataclass(frozen=True)
class ServerBudget:
    """What every arm's server gets: the model, the KV budget and the seed."""

    model: Path
    port: int
    num_blocks: int
    block_size: int
    max_model_len: int
    seed: int = 0


@dataclass(frozen=True)
class Engine:
    """One serving engine as the A/B sees it."""

    name: str  # "vllm", "sglang": the --engine value and the module to import
    stock: str  # the stock arm's name
    command: Callable[[ServerBudget, Sequence[str]], list[str]]
    kvplug_args: Callable[[dict | None], tuple[str, ...]]  # the kvplug arm's extra args
    kvplug_module: str  # must be importable for the kvplug arm
    counters: PrefixCounters  # its /metrics names for prefix lookups, hits, preemptions
    budget_note: str  # how the KV budget reaches the server, for the report header

    def stock_arm(self) -> Arm:
        return Arm(self.stock)

    def kvplug_arm(self, config: dict | None = None) -> Arm:
        return Arm(KVPLUG, self.kvplug_args(config), requires=self.kvplug_module)


# ---------------------------------------------------------------------------- vLLM


def _vllm_command(budget: ServerBudget, extra_args: Sequence[str]) -> list[str]:
    return vllm_command(
        budget.model,
        budget.port,
        num_blocks=budget.num_blocks,
        max_model_len=budget.max_model_len,
        block_size=budget.block_size,
        seed=budget.seed,
        extra_args=extra_args,
    )


def vllm_kvplug_args(
    config: dict | None = None, scheduler_cls: str = KVPLUG_SCHEDULER
) -> tuple[str, ...]:
    """``--scheduler-cls`` and, with `config`, ``--additional-config {"kvplug": config}``."""
    args: tuple[str, ...] = ("--scheduler-cls", scheduler_cls)
    if config:
        args += ("--additional-config", json.dumps({"kvplug": config}))
    return args


VLLM = Engine(
    name="vllm",
    stock="vllm-stock",
    command=_vllm_command,
    kvplug_args=vllm_kvplug_args,
    kvplug_module="kvplug.vllm",
    counters=VLLM_COUNTERS,
    budget_note="KV blocks",
)


# ---------------------------------------------------------------------------- SGLang


def sglang_command(
    model: str | Path,
    port: int,
    *,
    max_total_tokens: int,
    context_length: int,
    seed: int = 0,
    extra_args: Sequence[str] = (),
    python: str = sys.executable,
    cpu: bool | None = None,
) -> list[str]:
    """The command line of an SGLang server holding at most `max_total_tokens` of KV.

    `cpu` (default: ``$SGLANG_USE_CPU_ENGINE`` is ``1``) adds SGLang's CPU device, its
    pure-PyTorch attention backend, and no CUDA graphs. ``--enable-cache-report`` puts
    ``prompt_tokens_details.cached_tokens`` in each response's usage.
    """
    if cpu is None:
        cpu = os.environ.get("SGLANG_USE_CPU_ENGINE") == "1"
    command = [
        python, "-m", "sglang.launch_server",
        "--model-path", str(model),
        "--host", HOST,
        "--port", str(port),
        "--max-total-tokens", str(max_total_tokens),
        "--context-length", str(context_length),
        "--random-seed", str(seed),
        "--enable-metrics",
        "--enable-cache-report",
    ]  # fmt: skip
    if cpu:
        command += ["--device", "cpu", "--attention-backend", "torch_native",
                    "--disable-cuda-graph"]  # fmt: skip
    return command + list(extra_args)


def _sglang_command(budget: ServerBudget, extra_args: Sequence[str]) -> list[str]:
    return sglang_command(
        budget.model,
        budget.port,
        max_total_tokens=budget.num_blocks * budget.block_size,
        context_length=budget.max_model_len,
        seed=budget.seed,
        extra_args=extra_args,
    )


def sglang_kvplug_args(config: dict | None = None) -> tuple[str, ...]:
    """``--radix-cache-backend kvplug --radix-eviction-policy kvplug-<policy>``, and the
    rest of `config` as ``--radix-eviction-policy-config``."""
    config = dict(config or {})
    policy = config.pop("policy", DEFAULT_POLICY)
    args: tuple[str, ...] = (
        "--radix-cache-backend", SGLANG_BACKEND,
        "--radix-eviction-policy", SGLANG_POLICY_PREFIX + policy,
    )  # fmt: skip
    if config:
        args += ("--radix-eviction-policy-config", json.dumps(config))
    return args


SGLANG_PYTHON_CORE = Arm(
    "sglang-stock-pycore", env=(("SGLANG_UNIFIED_RADIX_TREE_CORE_BACKEND", "python"),)
)
"""SGLang's own cache and lru on its pure-Python tree core, the core kvplug runs on for
hybrid models and HiCache: separates the core's cost from the policy's."""

SGLANG = Engine(
    name="sglang",
    stock="sglang-stock",
    command=_sglang_command,
    kvplug_args=sglang_kvplug_args,
    kvplug_module="kvplug.sglang",
    counters=SGLANG_COUNTERS,
    budget_note="KV tokens (--max-total-tokens)",
)

ENGINES = {engine.name: engine for engine in (VLLM, SGLANG)}
