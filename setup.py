"""Builds kvplug's compiled module where a C compiler is present.

`kvplug/core/dense.py` (the dense eviction core) and `kvplug/policies/shadow.py`
(`learned`'s shadow caches) are written in Cython's pure-Python mode: Cython compiles them
to C extensions at install, and where that fails (no compiler, no Python headers) kvplug
installs without them and runs the same sources as plain Python (each module's
``COMPILED`` says which). Everything else is in pyproject.toml.
"""

from __future__ import annotations

import os
import sys

from setuptools import Extension, setup
from setuptools.command.build_ext import build_ext

COMPILED_MODULES = ["kvplug/core/dense.py", "kvplug/policies/shadow.py"]


class OptionalBuildExt(build_ext):
    """build_ext that warns and goes on where a compiled module cannot be built."""

    def run(self) -> None:
        try:
            super().run()
        except Exception as error:  # noqa: BLE001 - any build failure leaves plain Python
            self._skip(error)

    def build_extension(self, ext: Extension) -> None:
        try:
            super().build_extension(ext)
        except Exception as error:  # noqa: BLE001
            self._skip(error)

    @staticmethod
    def _skip(error: BaseException) -> None:
        print(f"kvplug: compiled modules not built ({error}); plain Python", file=sys.stderr)


def extensions() -> list[Extension]:
    if os.environ.get("KVPLUG_NO_COMPILE"):
        return []
    try:
        from Cython.Build import cythonize
    except ImportError:
        return []
    modules = [
        Extension(
            path[:-3].replace("/", "."),
            [path],
            # the same float arithmetic, in the same order, as the Python source
            extra_compile_args=["-O2", "-ffp-contract=off"],
        )
        for path in COMPILED_MODULES
    ]
    return cythonize(modules, language_level=3, quiet=True)


setup(ext_modules=extensions(), cmdclass={"build_ext": OptionalBuildExt})
