"""The options and argument parsing the replay commands share."""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any

import click

from kvplug.core.model_spec import DEFAULT_MODEL
from kvplug.replay.loop import Timing
from kvplug.replay.report import FORMATS
from kvplug.replay.sources import capacities_for
from kvplug.replay.trace import Trace

DEFAULT_FRACTIONS = "0.02,0.05,0.1,0.25"


def numbers(text: str, kind: type, what: str) -> list:
    """Comma-separated positive numbers of type `kind`, for option `what`."""
    try:
        values = [kind(part) for part in text.split(",") if part.strip()]
    except ValueError:
        raise click.BadParameter(
            f"{what}: expected comma-separated numbers, got {text!r}"
        ) from None
    if not values or min(values) <= 0:
        raise click.BadParameter(f"{what}: expected positive numbers, got {text!r}")
    return values


def names(text: str) -> list[str]:
    """Comma-separated names, blanks dropped."""
    return [part.strip() for part in text.split(",") if part.strip()]


def json_object(text: str, flag: str) -> dict[str, Any]:
    try:
        value = json.loads(text)
    except json.JSONDecodeError as exc:
        raise click.BadParameter(f"{flag}: not JSON ({exc}): {text!r}") from None
    if not isinstance(value, dict):
        raise click.BadParameter(f"{flag}: expected a JSON object of parameters, got {text!r}")
    return value


def timings_for(prefill_tps: str, decode_tps: str) -> list[Timing]:
    """Every pairing of the comma-separated prefill and decode speeds."""
    return [
        Timing(prefill, decode)
        for decode in numbers(decode_tps, float, "--decode-tps")
        for prefill in numbers(prefill_tps, float, "--prefill-tps")
    ]


def capacities(trace: Trace, blocks: str | None, fractions: str) -> list[int]:
    """``--capacity-blocks`` if given, else ``--capacity-fractions`` of `trace`."""
    if blocks:
        return numbers(blocks, int, "--capacity-blocks")
    return capacities_for(trace, numbers(fractions, float, "--capacity-fractions"))


def progress_printer(quiet: bool) -> Callable[[str], None] | None:
    return None if quiet else (lambda msg: click.echo(f"  {msg}", err=True))


def given(ctx: click.Context, name: str) -> bool:
    """Whether option `name` was given on the command line (not left at its default)."""
    return ctx.get_parameter_source(name) is not click.core.ParameterSource.DEFAULT


def flag_of(ctx: click.Context, name: str) -> str:
    return next(p.opts[0] for p in ctx.command.params if p.name == name)


REPLAY_OPTIONS = [
    click.option(
        "--model",
        default=DEFAULT_MODEL,
        show_default=True,
        help="Cost model: a preset or a Hugging Face config.json (or its directory).",
    ),
    click.option(
        "--sequential",
        is_flag=True,
        help="One request at a time, no decode; a fully cached prompt is a full hit.",
    ),
    click.option("--capacity-blocks", default=None, help="Cache sizes in blocks, comma-separated."),
    click.option(
        "--capacity-fractions",
        default=DEFAULT_FRACTIONS,
        show_default=True,
        help="Cache sizes as fractions of the trace's distinct blocks.",
    ),
    click.option("--format", "fmt", type=click.Choice(FORMATS), default="table", show_default=True),
    click.option(
        "--prefill-tps",
        default=f"{Timing.prefill_tps:g}",
        show_default=True,
        help="Realistic mode: prefill tokens per second. The fleet replay takes several "
        "(comma-separated) and runs every pairing with --decode-tps, reporting the spread.",
    ),
    click.option(
        "--decode-tps",
        default=f"{Timing.decode_tps:g}",
        show_default=True,
        help="Realistic mode: decode tokens per second per request (the fleet replay: "
        "several, as --prefill-tps).",
    ),
    click.option("--quiet", is_flag=True, help="No progress lines on stderr."),
]


def with_replay_options(fn):
    for option in reversed(REPLAY_OPTIONS):
        fn = option(fn)
    return fn
