"""``kvplug ab --engine vllm``: check the options, run the server A/B, print and plot."""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path

import click

from kvplug.serving.ab import ABConfig, kvplug_arm, run_ab, stock_arm
from kvplug.serving.report import plot, render

DEFAULT_PLOT = "kvplug-ab-vllm.png"


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


def check_model_dir(model: str) -> Path:
    path = Path(model)
    if not path.is_dir():
        raise click.BadParameter(
            f"no such directory {model!r}; --engine vllm needs a Hugging Face model "
            "directory (config.json, weights, tokenizer)",
            param_hint="--model",
        )
    if not (path / "config.json").is_file():
        raise click.BadParameter(
            f"{model!r} holds no config.json; --engine vllm needs a Hugging Face model "
            "directory (config.json, weights, tokenizer)",
            param_hint="--model",
        )
    return path


def vllm_ab(
    *,
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
) -> None:
    """Run the stock and kvplug vLLM servers in turn; print the table, write the files."""
    path = check_model_dir(model)
    extra = parse_kvplug_config(kvplug_config)
    if importlib.util.find_spec("vllm") is None:
        raise click.ClickException(
            f"vllm is not installed for {sys.executable}; run the kvplug of the "
            "environment that has it, e.g. .venv-vllm/bin/kvplug ab --engine vllm ..."
        )
    config = ABConfig(
        model=path,
        workload=workload,
        requests=requests,
        concurrency=concurrency,
        num_blocks=num_blocks,
    )
    progress = None if quiet else (lambda message: click.echo(f"  {message}", err=True))
    result = run_ab(config, [stock_arm(), kvplug_arm(extra)], progress=progress)
    if not any(arm.available for arm in result.arms):
        notes = "; ".join(f"{arm.arm}: {arm.note}" for arm in result.arms)
        raise click.ClickException(f"no arm ran ({notes})")
    click.echo(render(result, fmt))
    if json_path:
        Path(json_path).write_text(json.dumps(result.as_dict(), indent=2) + "\n")
        click.echo(f"\njson: {json_path}", err=fmt != "table")
    try:
        written = plot(result, plot_path or DEFAULT_PLOT)
    except ImportError as exc:  # matplotlib missing from this environment
        click.echo(f"plot: skipped ({exc})", err=True)
    else:
        click.echo(f"plot: {written}", err=fmt != "table")
    if fmt == "table":
        click.echo(f"took {result.seconds:.0f} s")
