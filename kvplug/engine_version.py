"""Which engine versions an adapter supports, and the check each makes at start-up.

kvplug's adapters subclass engine classes that are not a public interface, so an
untested engine version is refused unless the user says otherwise: ``strict_version:
false`` in kvplug's config or the adapter's override variable set to 1. The vLLM and
SGLang adapters each describe their engine with one `EngineSupport`.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from importlib.metadata import PackageNotFoundError, version

from packaging.specifiers import SpecifierSet
from packaging.version import InvalidVersion, Version

from kvplug.errors import KVPlugError

NOT_INSTALLED = "not installed"


class UnsupportedEngineError(KVPlugError):
    """The installed engine is not a version kvplug is tested with."""


@dataclass(frozen=True)
class EngineSupport:
    """One engine: its name, how to read its version, the range kvplug supports."""

    name: str  # as users write it: "vLLM", "SGLang"
    module: str  # the import name whose ``__version__`` is read first
    distributions: tuple[str, ...]  # the pip distributions that may provide it
    supported: SpecifierSet
    tested: str  # the version the tests ran with
    override_env: str  # set to 1 to accept an untested version
    extra: str  # kvplug's pip extra for the engine

    def installed(self) -> str:
        """The installed version, or `NOT_INSTALLED`."""
        try:
            module = __import__(self.module)
            return str(module.__version__)
        except Exception:
            pass
        for dist in self.distributions:
            try:
                return version(dist)
            except PackageNotFoundError:
                continue
        return NOT_INSTALLED

    def problem(self, found: str) -> str | None:
        """Why `found` is not supported, or None if it is."""
        try:
            if Version(found) in self.supported:
                return None
        except InvalidVersion:
            pass
        return (
            f"kvplug's {self.name} integration supports {self.name} {self.supported} "
            f"(tested: {self.tested}), but {self.name} {found} is installed. Install a "
            f"supported {self.name} (pip install 'kvplug[{self.extra}]'), or accept the "
            f"risk with {self.override_env}=1 or kvplug config strict_version: false"
        )

    def check(self, found: str, strict: bool = True) -> str | None:
        """Raise `UnsupportedEngineError` for an untested `found` unless overridden.

        Returns the problem (to log as a warning) when it was overridden, else None.
        """
        problem = self.problem(found)
        if problem is None:
            return None
        if strict and os.environ.get(self.override_env, "") not in ("1", "true", "yes"):
            raise UnsupportedEngineError(problem)
        return problem
