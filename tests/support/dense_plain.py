"""kvplug's compiled modules' sources run as plain Python, beside the build's modules.

`kvplug.core.dense` and `kvplug.policies.shadow` may be compiled extensions; their tests
also run the same sources uncompiled (Cython's shadow module), as an install without a C
compiler does, and check that both decide alike."""

from __future__ import annotations

import importlib.util
from pathlib import Path
from types import ModuleType

import kvplug.core.dense


def plain_module(module: ModuleType) -> ModuleType:
    """`module`'s ``.py`` source executed by the interpreter under another module name."""
    source = Path(module.__file__ or "").with_name(module.__name__.rsplit(".", 1)[-1] + ".py")
    name = module.__name__.replace(".", "_") + "_plain"
    spec = importlib.util.spec_from_file_location(name, source)
    assert spec is not None and spec.loader is not None
    plain = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(plain)
    assert not plain.COMPILED
    return plain


def plain_dense_module() -> ModuleType:
    """`kvplug/core/dense.py` executed by the interpreter under another module name."""
    return plain_module(kvplug.core.dense)
