"""Every ``kvplug`` command the README and the docs show is one the CLI accepts: the
command exists under today's name, and every option and value parses (nothing runs)."""

from __future__ import annotations

import re
import shlex
from pathlib import Path

import click
import pytest

from kvplug.cli import main
from kvplug.cli.app import rewrite_deprecated

ROOT = Path(__file__).resolve().parents[2]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]
FENCE = re.compile(r"^```(?:bash|sh|console)\n(.*?)^```", re.MULTILINE | re.DOTALL)


def documented_commands() -> list[tuple[str, list[str]]]:
    """(page:line, argv after ``kvplug``) for each ``kvplug ...`` line in a shell block."""
    found = []
    for page in PAGES:
        text = page.read_text()
        for block in FENCE.finditer(text):
            start = text[: block.start(1)].count("\n") + 1
            for offset, line in enumerate(block.group(1).splitlines()):
                words = shlex.split(line.split(" #")[0], comments=False) if line.strip() else []
                while words and re.fullmatch(r"[A-Z_][A-Z0-9_]*=.*", words[0]):
                    words = words[1:]  # VAR=value before the command
                if words and words[0] == "$":
                    words = words[1:]
                if words and Path(words[0]).name == "kvplug":
                    where = f"{page.relative_to(ROOT)}:{start + offset}"
                    found.append((where, words[1:]))
    return found


COMMANDS = documented_commands()


def test_the_docs_show_commands() -> None:
    assert len(COMMANDS) > 30, "the fence pattern found too few commands"


@pytest.mark.parametrize(("where", "argv"), COMMANDS, ids=[w for w, _ in COMMANDS])
def test_documented_command_parses(where: str, argv: list[str]) -> None:
    assert rewrite_deprecated(argv)[1] is None, f"{where}: an old name: kvplug {shlex.join(argv)}"
    command: click.Command = main
    ctx = click.Context(main, info_name="kvplug")
    args = list(argv)
    while isinstance(command, click.Group) and args and not args[0].startswith("-"):
        name = args.pop(0)
        sub = command.get_command(ctx, name)
        assert sub is not None, f"{where}: no command {name!r} in kvplug {shlex.join(argv)}"
        command, ctx = sub, click.Context(sub, info_name=name, parent=ctx)
    if args in (["--help"], []) and isinstance(command, click.Group):
        return
    try:
        command.make_context(command.name or "kvplug", args, parent=ctx.parent)
    except click.exceptions.Exit:  # --help, --version
        pass
    except click.UsageError as exc:
        pytest.fail(f"{where}: kvplug {shlex.join(argv)}: {exc.format_message()}")
