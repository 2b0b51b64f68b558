"""The dense eviction core's source run as plain Python, beside the build's module.

`kvplug.core.dense` may be the compiled extension; its tests also run the same source
uncompiled (Cython's shadow module), as an install without a C compiler does, and check
that both decide alike."""

from __future__ import annotations

import importlib.util
from pathlib import Path
from types import ModuleType

import kvplug.core.dense


def plain_dense_module() -> ModuleType:
    """`kvplug/core/dense.py` executed by the interpreter under another module name."""
    source = Path(kvplug.core.dense.__file__).with_name("dense.py")
    spec = importlib.util.spec_from_file_location("kvplug_dense_plain", source)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    assert not module.COMPILED
    return module
