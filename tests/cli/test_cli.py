"""The kvplug CLI, the environment probe and the kernel-backend report."""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import click
import pytest
from click.testing import CliRunner

import kvplug.core.dense
import kvplug.policies.shadow
from kvplug import __version__
from kvplug.cli.app import LazyGroup, main
from kvplug.errors import ConfigError
from kvplug.kernels import available_backends
from kvplug.tools import info
from kvplug.tools.info import COMPONENT_NAMES, Component, import_check, probe

NAMES = ["vllm", "sglang", "torch", "triton", "flashinfer"]


def installed(module: str) -> bool:
    return importlib.util.find_spec(module) is not None


def test_version() -> None:
    result = CliRunner().invoke(main, ["--version"])
    assert result.exit_code == 0
    assert result.output.strip() == f"kvplug {__version__}"


def test_help_lists_info() -> None:
    result = CliRunner().invoke(main, ["--help"])
    assert result.exit_code == 0
    assert "info" in result.output


def test_info_table() -> None:
    result = CliRunner().invoke(main, ["info"])
    assert result.exit_code == 0, result.output
    header = next(line for line in result.output.splitlines() if line.startswith("component"))
    assert header.split() == ["component", "version", "importable", "enables"]
    rows = {line.split()[0]: line for line in result.output.splitlines() if line.strip()}
    for name in NAMES:
        assert "unchecked" in rows[name]
        if not installed(name):
            assert "not installed" in rows[name]
    # the columns line up
    assert len({rows[name].index("unchecked") for name in NAMES}) == 1


def test_info_json() -> None:
    result = CliRunner().invoke(main, ["info", "--json"])
    assert result.exit_code == 0, result.output
    report = json.loads(result.output)
    assert report["kvplug"] == __version__
    assert report["dense_core_compiled"] is kvplug.core.dense.COMPILED
    assert report["learned_shadows_compiled"] is kvplug.policies.shadow.COMPILED
    by_name = {c["name"]: c for c in report["components"]}
    assert sorted(by_name) == sorted(NAMES)
    assert by_name["vllm"]["installed"] == installed("vllm")
    assert by_name["vllm"]["kind"] == "engine"
    assert by_name["flashinfer"]["kind"] == "kernel"
    for component in by_name.values():
        assert component["importable"] is None  # never claimed without trying
        assert component["enables"]
        if not component["installed"]:
            assert component["version"] is None or component["note"]


def test_info_import_one_component() -> None:
    result = CliRunner().invoke(main, ["info", "--import", "--json", "sglang"])
    assert result.exit_code == 0, result.output
    (sglang,) = json.loads(result.output)["components"]
    assert sglang["name"] == "sglang"
    assert sglang["installed"] == installed("sglang")
    assert isinstance(sglang["importable"], bool)
    if not sglang["installed"]:
        assert sglang["importable"] is False


def test_info_rejects_unknown_name() -> None:
    result = CliRunner().invoke(main, ["info", "nosuch"])
    assert result.exit_code == 2
    assert "vllm" in result.output


def test_probe_default_imports_nothing() -> None:
    components = probe()
    assert [c.name for c in components] == NAMES == list(COMPONENT_NAMES)
    assert all(c.importable is None for c in components)
    assert {c.name: c.installed for c in components} == {n: installed(n) for n in NAMES}


def test_probe_rejects_unknown_name() -> None:
    with pytest.raises(ValueError, match="known: vllm"):
        probe(names=["nosuch"])


def test_import_check_runs_a_subprocess() -> None:
    assert import_check("json") == (True, "")
    ok, note = import_check("kvplug_no_such_module_xyz")
    assert ok is False
    assert "ModuleNotFoundError" in note


def test_probe_with_imports(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    (tmp_path / "kvplug_broken_fixture.py").write_text("raise RuntimeError('boom at import')\n")
    monkeypatch.syspath_prepend(str(tmp_path))  # for find_spec here
    monkeypatch.setenv("PYTHONPATH", str(tmp_path))  # for the import subprocess
    fakes = (
        info._Known("json", "library", "json", ("no-such-dist-kvplug",), "stdlib json"),
        info._Known("broken", "library", "kvplug_broken_fixture", ("no-such-dist",), "nothing"),
        info._Known("absent", "library", "kvplug_absent_xyz", ("no-such-dist",), "nothing"),
    )
    monkeypatch.setattr(info, "KNOWN", fakes)
    ok, broken, absent = probe(import_modules=True, timeout=60)
    assert ok == Component(
        "json",
        "library",
        True,
        None,
        True,
        "stdlib json",
        "module found but no distribution metadata",
    )
    assert broken.installed is True
    assert broken.importable is False
    assert broken.note == "RuntimeError: boom at import"
    assert absent.installed is False
    assert absent.importable is False
    assert absent.note == "not installed"


FAKE_TORCH = """
class cuda:
    @staticmethod
    def is_available():
        return False

    @staticmethod
    def device_count():
        return 0

class version:
    cuda = None
"""


@pytest.fixture
def fake_torch(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """A stand-in `torch` (CPU-only build) and an empty `triton` on the import path."""
    for name, text in (("torch", FAKE_TORCH), ("triton", "")):
        (tmp_path / name).mkdir()
        (tmp_path / name / "__init__.py").write_text(text)
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setenv("PYTHONPATH", str(tmp_path))
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    saved = {name: sys.modules.pop(name) for name in ("torch", "triton") if name in sys.modules}
    yield
    for name in ("torch", "triton"):
        sys.modules.pop(name, None)
    sys.modules.update(saved)


@pytest.mark.usefixtures("fake_torch")
def test_torch_import_reports_gpu_visibility() -> None:
    (torch,) = probe(import_modules=True, names=["torch"], timeout=60)
    assert torch.installed is True
    assert torch.importable is True
    assert torch.note == "no CUDA GPU visible (CPU-only torch build)"


@pytest.mark.usefixtures("fake_torch")
def test_backends_without_gpu(monkeypatch: pytest.MonkeyPatch) -> None:
    backends = available_backends()
    assert backends["reference"] == "available"
    assert backends["triton"] == "triton installed but no GPU; set TRITON_INTERPRET=1 to run on CPU"
    if not installed("flashinfer"):
        assert backends["flashinfer"] == "flashinfer not installed"
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    assert available_backends()["triton"] == "available"


def test_available_backends_are_honest() -> None:
    backends = available_backends()
    assert sorted(backends) == ["flashinfer", "reference", "triton"]
    if not installed("torch"):
        assert set(backends.values()) == {"torch not installed"}
    if not installed("triton"):
        assert backends["triton"] != "available"
    if not installed("flashinfer"):
        assert backends["flashinfer"] != "available"


def test_core_imports_no_torch_and_no_engine() -> None:
    code = (
        "import sys, kvplug, kvplug.config, kvplug.cli, kvplug.tools.info, kvplug.kernels\n"
        "heavy = ('torch', 'vllm', 'sglang', 'triton', 'flashinfer')\n"
        "print(','.join(m for m in heavy if m in sys.modules))\n"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == ""


# -- the lazy group --------------------------------------------------------------------

LAZY_MODULE = '''
import click
from kvplug.errors import ConfigError

@click.command()
def hello():
    """Say hello."""
    click.echo("hello from a lazy command")

@click.command()
def fail():
    raise ConfigError("kvplug config: 'block_size' = 0 is not accepted: must be >= 1")
'''


@pytest.fixture
def lazy_group(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> click.Group:
    (tmp_path / "kvplug_lazy_fixture.py").write_text(LAZY_MODULE)
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.delitem(sys.modules, "kvplug_lazy_fixture", raising=False)

    @click.group(
        cls=LazyGroup,
        lazy_commands={
            "hello": "kvplug_lazy_fixture:hello",
            "fail": "kvplug_lazy_fixture:fail",
            "gone": "kvplug_no_such_module_xyz:cmd",
        },
    )
    def group() -> None:
        pass

    @group.command()
    def eager() -> None:
        raise ConfigError("eager went wrong")

    return group


def test_lazy_command_is_imported_only_when_used(lazy_group: click.Group) -> None:
    assert "kvplug_lazy_fixture" not in sys.modules
    result = CliRunner().invoke(lazy_group, ["hello"])
    assert result.exit_code == 0, result.output
    assert result.output.strip() == "hello from a lazy command"
    assert "kvplug_lazy_fixture" in sys.modules


def test_lazy_commands_with_missing_modules_are_not_listed(lazy_group: click.Group) -> None:
    result = CliRunner().invoke(lazy_group, ["--help"])
    assert result.exit_code == 0, result.output
    assert "hello" in result.output
    assert "eager" in result.output
    assert "gone" not in result.output
    missing = CliRunner().invoke(lazy_group, ["gone"])
    assert missing.exit_code == 2
    assert "No such command" in missing.output


@pytest.mark.parametrize(
    ("command", "message"),
    [("fail", "'block_size' = 0 is not accepted"), ("eager", "eager went wrong")],
)
def test_kvplug_errors_become_usage_style_errors(
    lazy_group: click.Group, command: str, message: str
) -> None:
    result = CliRunner().invoke(lazy_group, [command])
    assert result.exit_code == 2
    assert result.exception is None or isinstance(result.exception, SystemExit)
    assert result.output.startswith("Error: ")
    assert message in result.output
    assert "Traceback" not in result.output


def test_main_lists_every_command_in_the_ecosystems_shape() -> None:
    listed = main.list_commands(click.Context(main))
    assert set(listed) == {"ab", "bench", "budget", "demo", "info", "replay", "replay-fleet",
                           "replay-hybrid", "sweep"}  # fmt: skip
    bench = main.get_command(click.Context(main), "bench")
    assert set(bench.list_commands(click.Context(bench))) >= {
        "core", "replay", "step", "manager", "block-pool", "sglang-cache", "serve"
    }  # fmt: skip


@pytest.mark.parametrize(
    ("old", "new"),
    [
        (["hybrid-replay", "T", "--quiet"], ["replay-hybrid", "T", "--quiet"]),
        (["replay", "T", "--engines", "2"], ["replay-fleet", "T", "--engines", "2"]),
        (["replay", "T", "--router=cache-aware"], ["replay-fleet", "T", "--router=cache-aware"]),
        (["bench", "vllm-step", "--steps", "4"], ["bench", "step", "--steps", "4"]),
        (["bench", "vllm-manager"], ["bench", "manager"]),
        (
            ["ab", "--engine", "vllm", "--model", "M"],
            ["bench", "serve", "--engine", "vllm", "--model", "M"],
        ),  # fmt: skip
    ],
)
def test_the_previous_releases_names_still_work_with_a_note(old, new) -> None:
    from kvplug.cli.app import rewrite_deprecated

    args, note = rewrite_deprecated(old)
    assert args == new
    assert note is not None and "next release" in note and f"kvplug {new[0]}" in note


@pytest.mark.parametrize(
    "args", [["replay", "T", "--policy", "lru"], ["ab"], ["ab", "--engine", "replay"], []]
)
def test_current_names_are_not_rewritten(args) -> None:
    from kvplug.cli.app import rewrite_deprecated

    assert rewrite_deprecated(args) == (args, None)


def test_a_deprecated_name_runs_and_says_what_replaced_it() -> None:
    result = CliRunner().invoke(main, ["hybrid-replay", "synthetic:agent-loop", "--policy", "x"])
    assert "`kvplug hybrid-replay` is now `kvplug replay-hybrid`" in result.output
    assert result.exit_code == 2 and "unknown hybrid arm 'x'" in result.output


def test_installing_kvplug_registers_no_engine_hooks() -> None:
    """kvplug acts only when enabled: its installed entry points touch no engine (the
    engine plugins only add names; tests/test_sglang_plugin.py and the vLLM tests check
    that nothing changes unless selected)."""
    from importlib.metadata import distribution

    groups = {ep.group for ep in distribution("kvplug").entry_points}
    engines = {"vllm.general_plugins", "sglang.srt.plugins"}
    assert groups <= {"console_scripts", "kvplug.policies", *engines}, groups
