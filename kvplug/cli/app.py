"""The ``kvplug`` command line.

Subcommands defined elsewhere are registered either eagerly with
``main.add_command(cmd)`` or lazily in `_LAZY_COMMANDS` below, which imports their
module only when the command is listed or run. A `KVPlugError` raised by any command is
printed as ``Error: <message>`` with exit status 2 instead of a traceback.
"""

from __future__ import annotations

import importlib
import importlib.util
import json
import platform
from dataclasses import asdict
from typing import Any

import click

from kvplug import __version__
from kvplug.errors import KVPlugError
from kvplug.tools.info import COMPONENT_NAMES, Component, probe


class KVPlugClickError(click.ClickException):
    """A kvplug error shown to the user as ``Error: <message>`` (exit status 2)."""

    exit_code = 2


class LazyGroup(click.Group):
    """A group that also offers commands named ``"module:attribute"`` in `lazy_commands`.

    A lazy command's module is imported only when the command is listed or invoked; a
    command whose module does not exist is not listed.
    """

    def __init__(self, *args: Any, lazy_commands: dict[str, str] | None = None, **kwargs: Any):
        super().__init__(*args, **kwargs)
        self.lazy_commands = dict(lazy_commands or {})

    def list_commands(self, ctx: click.Context) -> list[str]:
        lazy = [name for name, target in self.lazy_commands.items() if _module_exists(target)]
        return sorted({*super().list_commands(ctx), *lazy})

    def get_command(self, ctx: click.Context, cmd_name: str) -> click.Command | None:
        command = super().get_command(ctx, cmd_name)
        if command is not None or cmd_name not in self.lazy_commands:
            return command
        target = self.lazy_commands[cmd_name]
        if not _module_exists(target):
            return None
        module_name, _, attribute = target.partition(":")
        try:
            command = getattr(importlib.import_module(module_name), attribute)
        except Exception as exc:  # the module exists, so this is a bug worth showing
            raise KVPlugClickError(
                f"cannot load command {cmd_name!r} from {target}: {exc}"
            ) from exc
        if not isinstance(command, click.Command):
            raise KVPlugClickError(f"{target} is not a click command")
        return command

    def parse_args(self, ctx: click.Context, args: list[str]) -> list[str]:
        args, note = rewrite_deprecated(list(args))
        if note:
            click.echo(note, err=True)
        return super().parse_args(ctx, args)

    def invoke(self, ctx: click.Context) -> Any:
        try:
            return super().invoke(ctx)
        except KVPlugError as exc:
            raise KVPlugClickError(str(exc)) from exc


def _module_exists(target: str) -> bool:
    try:
        return importlib.util.find_spec(target.partition(":")[0]) is not None
    except (ImportError, ValueError):
        return False


# Lazily registered subcommands: name -> "module:attribute". Add new ones here (or call
# `main.add_command(...)` from code that is imported anyway).
_LAZY_COMMANDS: dict[str, str] = {
    "ab": "kvplug.cli.replay:ab",
    "bench": "kvplug.cli.bench:bench",
    "budget": "kvplug.cli.budget:budget",
    "demo": "kvplug.cli.demo:demo",
    "replay": "kvplug.cli.replay:replay",
    "replay-fleet": "kvplug.cli.replay_fleet:replay_fleet",
    "replay-hybrid": "kvplug.cli.replay_hybrid:replay_hybrid",
    "sweep": "kvplug.cli.sweep:sweep",
}

# The names of the previous release, rewritten to today's with a note (removed next release).
_FLEET_FLAGS = ("--engines", "--router", "--event-lag", "--load-penalty")


def rewrite_deprecated(args: list[str]) -> tuple[list[str], str | None]:
    """`args` with a deprecated command name replaced by today's, and the note to print
    (None when nothing was deprecated)."""
    if not args:
        return args, None
    head, rest = args[0], args[1:]
    new: list[str] | None = None
    if head == "hybrid-replay":
        new = ["replay-hybrid", *rest]
    elif head == "replay" and any(a.split("=")[0] in _FLEET_FLAGS for a in rest):
        new = ["replay-fleet", *rest]
    elif head == "bench" and rest and rest[0] in ("vllm-step", "vllm-manager"):
        new = ["bench", rest[0].removeprefix("vllm-"), *rest[1:]]
    elif head == "ab":
        engine = _option_value(rest, "--engine")
        if engine in ("vllm", "sglang"):
            new = ["bench", "serve", *rest]
    if new is None:
        return args, None
    old_name = " ".join(args[:2] if head == "bench" else args[:1])
    new_name = " ".join(new[:2] if new[0] == "bench" else new[:1])
    return (
        new,
        f"note: `kvplug {old_name}` is now `kvplug {new_name}` (same options); the old form "
        "goes in the next release",
    )


def _option_value(args: list[str], flag: str) -> str | None:
    for i, arg in enumerate(args):
        if arg == flag and i + 1 < len(args):
            return args[i + 1]
        if arg.startswith(flag + "="):
            return arg.partition("=")[2]
    return None


@click.group(cls=LazyGroup, lazy_commands=_LAZY_COMMANDS)
@click.version_option(__version__, "--version", prog_name="kvplug", message="%(prog)s %(version)s")
def main() -> None:
    """kvplug: cost-aware KV-cache management for vLLM and SGLang."""


@main.command(short_help="Show which engines and kernel libraries are installed.")
@click.option("--json", "as_json", is_flag=True, help="Print machine-readable JSON.")
@click.option(
    "--import",
    "import_modules",
    is_flag=True,
    help="Import each installed component in a subprocess (slow; checks it really loads).",
)
@click.argument("names", nargs=-1, metavar="[NAME]...", type=click.Choice(COMPONENT_NAMES))
def info(as_json: bool, import_modules: bool, names: tuple[str, ...]) -> None:
    """Show which engines and kernel libraries are installed.

    Give NAMEs (vllm, sglang, torch, triton, flashinfer) to report only those.
    """
    from kvplug.core.dense import COMPILED
    from kvplug.policies.shadow import COMPILED as SHADOW_COMPILED

    components = probe(import_modules=import_modules, names=names or None)
    plain = "plain Python (no C compiler at install)"
    core = "compiled" if COMPILED else plain
    shadows = "compiled" if SHADOW_COMPILED else plain
    if as_json:
        report = {
            "kvplug": __version__,
            "python": platform.python_version(),
            "dense_core_compiled": COMPILED,
            "learned_shadows_compiled": SHADOW_COMPILED,
            "components": [asdict(c) for c in components],
        }
        click.echo(json.dumps(report, indent=2))
    else:
        click.echo(f"kvplug {__version__} (Python {platform.python_version()})")
        click.echo(f"dense eviction core (cost, learned in vLLM's pool): {core}")
        click.echo(f"learned's shadow caches: {shadows}\n")
        click.echo(_table(components))


def _table(components: list[Component]) -> str:
    rows = [("component", "version", "importable", "enables")]
    for c in components:
        importable = "unchecked" if c.importable is None else ("yes" if c.importable else "no")
        version = c.version or ("unknown version" if c.installed else "not installed")
        rows.append((c.name, version, importable, c.enables))
    widths = [max(len(row[i]) for row in rows) for i in range(3)]
    lines = [
        "  ".join(cell.ljust(w) for cell, w in zip(row[:3], widths, strict=True)) + "  " + row[3]
        for row in rows
    ]
    # "not installed" is already in the version column
    notes = [f"  {c.name}: {c.note}" for c in components if c.note and c.note != "not installed"]
    if notes:
        lines += ["", "notes:", *notes]
    return "\n".join(lines)


# -- registering subcommands from other modules ----------------------------------------
# Eager registration is `from kvplug.cli.bench import bench; main.add_command(bench)`, but
# that imports the module on every run; prefer an entry in `_LAZY_COMMANDS` above.
