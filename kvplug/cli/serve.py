"""``kvplug bench serve --engine vllm|sglang``: check the options, run the server A/B, print,
plot."""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path

import click

from kvplug.errors import ConfigError
from kvplug.serving.ab import ABConfig, check_fleet, run_ab
from kvplug.serving.engines import ENGINES, SGLANG, SGLANG_PYTHON_CORE, VLLM
from kvplug.serving.report import plot, render
from kvplug.serving.routers import DEFAULT_ROUTER, ROUTERS
from kvplug.serving.vllm_bench import parse_bench_args
from kvplug.serving.workload import WORKLOADS


def default_plot(engine: str) -> str:
    return f"kvplug-ab-{engine}.png"


def parse_kvplug_config(text: str | None) -> dict | None:
    """``--kvplug-config``: a JSON object, passed as ``{"kvplug": {...}}``."""
    if not text:
        return None
    try:
        value = json.loads(text)
    except json.JSONDecodeError as exc:
        raise click.BadParameter(
            f"not valid JSON ({exc.msg} at column {exc.colno}): {text!r}; expected an "
            'object such as \'{"policy": "cost"}\'',
            param_hint="--kvplug-config",
        ) from None
    if not isinstance(value, dict):
        raise click.BadParameter(
            f'expected a JSON object such as \'{{"policy": "cost"}}\', got {text!r}',
            param_hint="--kvplug-config",
        )
    return value


def check_model_dir(model: str, engine: str = VLLM.name) -> Path:
    path = Path(model)
    needs = (
        f"--engine {engine} needs a Hugging Face model directory (config.json, weights, tokenizer)"
    )
    if not path.is_dir():
        raise click.BadParameter(f"no such directory {model!r}; {needs}", param_hint="--model")
    if not (path / "config.json").is_file():
        raise click.BadParameter(f"{model!r} holds no config.json; {needs}", param_hint="--model")
    return path


def server_ab(
    *,
    engine: str = VLLM.name,
    model: str,
    workload: str,
    num_blocks: int,
    requests: int,
    concurrency: int,
    kvplug_config: str | None,
    plot_path: str | None,
    json_path: str | None,
    fmt: str,
    quiet: bool,
    repeat: int = 1,
    client: str = "kvplug",
    bench_args: str | None = None,
    python_core_arm: bool = False,
    output_tokens: int | None = None,
    servers: int = 1,
    router: str | None = None,
    router_policy: str = "cache_aware",
    router_bin: str | None = None,
) -> None:
    """Run the stock and kvplug servers of `engine` in turn (`repeat` rounds); print the
    table, write the files."""
    server = ENGINES[engine]
    if client != "kvplug" and engine != VLLM.name:
        raise click.BadParameter(
            f"--client {client} drives vLLM servers only; use --client kvplug with "
            f"--engine {engine}",
            param_hint="--client",
        )
    if python_core_arm and engine != SGLANG.name:
        raise click.BadParameter("applies to --engine sglang only", param_hint="--python-core-arm")
    if bench_args and client != "vllm-bench":
        raise click.BadParameter("applies to --client vllm-bench only", param_hint="--bench-args")
    if output_tokens is not None and client != "kvplug":
        raise click.BadParameter(
            "applies to --client kvplug only (vLLM's client: --bench-args)",
            param_hint="--output-tokens",
        )
    if servers > 1 and router is None:
        router = DEFAULT_ROUTER[engine]
    path = check_model_dir(model, engine)
    extra = parse_kvplug_config(kvplug_config)
    if importlib.util.find_spec(engine) is None:
        raise click.ClickException(
            f"{engine} is not installed for {sys.executable}; run the kvplug of the "
            f"environment that has it, e.g. .venv-{engine}/bin/kvplug bench serve --engine "
            f"{engine} ..."
        )
    config = ABConfig(
        model=path,
        workload=workload,
        requests=requests,
        concurrency=concurrency,
        num_blocks=num_blocks,
        engine=engine,
        repeat=repeat,
        client=client,
        bench_args=parse_bench_args(bench_args),
        output_tokens=output_tokens,
        servers=servers,
        router=router,
        router_policy=router_policy,
        router_bin=router_bin,
    )
    try:
        check_fleet(config)
    except ConfigError as exc:
        raise click.UsageError(str(exc)) from None
    progress = None if quiet else (lambda message: click.echo(f"  {message}", err=True))
    arms = [server.stock_arm(), server.kvplug_arm(extra)]
    if python_core_arm:
        arms.insert(1, SGLANG_PYTHON_CORE)
    result = run_ab(config, arms, progress=progress)
    if not any(arm.available for arm in result.arms):
        notes = "; ".join(f"{arm.arm}: {arm.note}" for arm in result.arms)
        raise click.ClickException(f"no arm ran ({notes})")
    click.echo(render(result, fmt))
    if json_path:
        Path(json_path).write_text(json.dumps(result.as_dict(), indent=2) + "\n")
        click.echo(f"\njson: {json_path}", err=fmt != "table")
    try:
        written = plot(result, plot_path or default_plot(engine))
    except ImportError as exc:  # matplotlib missing from this environment
        click.echo(f"plot: skipped ({exc})", err=True)
    else:
        click.echo(f"plot: {written}", err=fmt != "table")
    if fmt == "table":
        click.echo(f"took {result.seconds:.0f} s")


@click.command("serve")
@click.option("--engine", type=click.Choice(sorted(ENGINES)), required=True,
              help="The engine whose stock server runs against a kvplug one.")  # fmt: skip
@click.option("--model", required=True,
              help="A Hugging Face model directory (config.json, weights, tokenizer).")  # fmt: skip
@click.option("--workload", type=click.Choice(WORKLOADS), default="mixed", show_default=True,
              help="The requests sent.")  # fmt: skip
@click.option(
    "--num-blocks",
    type=click.IntRange(min=2),
    default=128,
    show_default=True,
    help="KV blocks of 32 tokens per server (sglang: --max-total-tokens of 32 tokens a block).",
)
@click.option("--requests", type=click.IntRange(min=1), default=400, show_default=True,
              help="Requests per arm.")  # fmt: skip
@click.option("--concurrency", type=click.IntRange(min=1), default=8, show_default=True,
              help="Most requests in flight (a chat keeps its slot between turns).")  # fmt: skip
@click.option(
    "--repeat",
    type=click.IntRange(min=1),
    default=1,
    show_default=True,
    help="Runs per arm, interleaved (stock, kvplug, stock, ...); the table shows the median "
    "and [min-max].",
)
@click.option(
    "--kvplug-config",
    default=None,
    help='The kvplug arm\'s settings, a JSON object such as \'{"policy": "cost"}\'.',
)
@click.option(
    "--client",
    type=click.Choice(["kvplug", "vllm-bench"]),
    default="kvplug",
    show_default=True,
    help="Who sends the requests. vllm-bench (--engine vllm): vLLM's own benchmark client "
    "(vllm.benchmarks.serve, prefix_repetition dataset sized to the KV budget) instead of "
    "--workload; vLLM's TTFT and throughput, hit ratio from /metrics.",
)
@click.option(
    "--python-core-arm",
    is_flag=True,
    help="--engine sglang: a third arm, SGLang's own lru on its pure-Python tree core (the "
    "core kvplug runs on for hybrid models and HiCache, or with "
    "KVPLUG_SGLANG_TREE_CORE=python), to tell the core's cost from the policy's.",
)
@click.option(
    "--bench-args",
    default=None,
    help="--client vllm-bench: extra 'vllm bench serve' flags, one quoted string; they win "
    "over kvplug's defaults (e.g. '--prefix-repetition-num-prefixes 4').",
)
@click.option(
    "--output-tokens",
    type=click.IntRange(min=1),
    default=None,
    help="Each answer's most tokens, for every request of --workload (default: the "
    "workload's own, 16-24); 1 makes each request a prefill, as scoring and short-answer "
    "traffic are.",
)
@click.option(
    "--servers",
    type=click.IntRange(min=1),
    default=1,
    show_default=True,
    help="Servers per arm. Above 1, a fleet: that many servers of each arm behind a router "
    "(--router), each with --num-blocks, all started at once.",
)
@click.option(
    "--router",
    type=click.Choice(sorted(ROUTERS)),
    default=None,
    help="The router in front of the servers (pip install it anywhere; default with "
    "--servers above 1: vllm-router for vLLM, sglang-router for SGLang).",
)
@click.option("--router-policy", default="cache_aware", show_default=True,
              help="The router's routing policy, the same for both arms.")  # fmt: skip
@click.option("--router-bin", default=None,
              help="The router's executable (default: found on PATH).")  # fmt: skip
@click.option("--json", "json_path", default=None, help="Also write the results here.")
@click.option("--plot", "plot_path", default=None, help="Default: kvplug-ab-ENGINE.png.")
@click.option("--format", "fmt", type=click.Choice(["table", "json", "csv"]), default="table",
              show_default=True)  # fmt: skip
@click.option("--quiet", is_flag=True, help="No progress lines on stderr.")
def serve(**options: object) -> None:
    """A stock server of ENGINE, then a kvplug one (vLLM: --scheduler-cls
    kvplug.vllm.Scheduler; SGLang: --radix-cache-backend kvplug), on the same model, KV
    budget and workload; TTFT, throughput, cached tokens and saved prefill compute side by
    side."""
    server_ab(**options)  # type: ignore[arg-type]
