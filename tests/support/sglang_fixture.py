"""SGLang's unified radix cache, built by SGLang's own unit-test fixture with kvplug's parts.

`build(shape, policy)` returns what SGLang's fixture
(`sglang.test.kits.unified_radix_cache.fixtures.build_fixture`) builds: real token,
sliding-window and Mamba pools on the CPU and a `UnifiedRadixCache`; with a
``kvplug-<name>`` policy, with kvplug's tree core (over the kit's inspecting core) and
kvplug's components, the classes ``--radix-cache-backend kvplug`` installs.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import pytest


def _allow_kit_import() -> None:
    """SGLang's test kit imports `sglang.test.test_utils`, which imports its benchmark
    dataset loaders and so Hugging Face ``datasets`` (not in .venv-sglang: SGLang is
    installed without its dependencies). Nothing here loads a dataset, so a missing
    ``datasets`` is stood in by an empty module whose loader refuses; no SGLang code is."""
    import importlib.util
    import sys
    import types

    if importlib.util.find_spec("datasets") is None and "datasets" not in sys.modules:
        module = types.ModuleType("datasets")

        def load_dataset(*args: object, **kwargs: object) -> None:
            raise RuntimeError("Hugging Face datasets is not installed")

        module.load_dataset = load_dataset  # type: ignore[attr-defined]
        sys.modules["datasets"] = module


_allow_kit_import()


from sglang.srt.mem_cache.unified_cache.component_type import ComponentType  # noqa: E402
from sglang.srt.mem_cache.unified_cache.tree_core_registry import (  # noqa: E402
    register_tree_core_backend,
    registered_tree_core_backends,
)
from sglang.srt.mem_cache.unified_radix_cache import UnifiedRadixCache  # noqa: E402
from sglang.test.kits.unified_radix_cache import fixtures  # noqa: E402
from sglang.test.kits.unified_radix_cache.config import CacheConfig  # noqa: E402
from sglang.test.kits.unified_radix_cache.fixtures import (  # noqa: E402
    build_fixture,
    match_prefix,
)
from sglang.test.kits.unified_radix_cache.unified_tree_core_inspector import (  # noqa: E402
    UnifiedTreeCoreInspector,
)

from kvplug.sglang.backend import RUST_BACKEND  # noqa: E402
from kvplug.sglang.components import kvplug_components  # noqa: E402
from kvplug.sglang.plugin import register_names  # noqa: E402
from kvplug.sglang.tree_core import KVPlugTreeCoreMixin  # noqa: E402

FULL, SWA, MAMBA = ComponentType.FULL, ComponentType.SWA, ComponentType.MAMBA
__all__ = ["FULL", "MAMBA", "SHAPES", "SWA", "build", "match_prefix"]
INSPECTED = "kvplug-inspected"  # kvplug's tree core with the fixture's inspection interface

SHAPES = {
    "full-p1": CacheConfig(page_size=1, kv_size=64, max_num_reqs=64),
    "full-p4": CacheConfig(page_size=4, kv_size=96, max_num_reqs=64),
    "full+swa": CacheConfig(
        page_size=1, components=(FULL, SWA), sliding_window_size=4, kv_size=64, max_num_reqs=64
    ),
    "full+mamba": CacheConfig(
        page_size=1, components=(FULL, MAMBA), kv_size=64, max_num_reqs=64, mamba_cache_size=64
    ),
}


class KVPlugInspector(KVPlugTreeCoreMixin, UnifiedTreeCoreInspector):
    """kvplug's tree core over the SGLang test kit's inspecting tree core."""


def build(shape: str, policy: str, core: str = "python") -> tuple[Any, Any, Any]:
    """(cache, allocator, request pool) from SGLang's fixture; `policy` is SGLang's name
    (``lru``) or ``kvplug-<name>``, ranked on kvplug's Python tree core (`core`
    ``python``: over the kit's inspecting core, with kvplug's components) or on SGLang's
    Rust core (``rust``: `kvplug.sglang.rust_core`, SGLang's own components; the kit
    builds the pools, SGLang's cache class the cache)."""
    register_names()
    if INSPECTED not in registered_tree_core_backends():
        register_tree_core_backend(INSPECTED, KVPlugInspector)
    cfg = dataclasses.replace(SHAPES[shape], eviction_policy=policy)
    rust = policy.startswith("kvplug-") and core == "rust"
    if rust:  # the kit's Rust inspector needs SGLang's Rust sources: pools built for lru
        cfg = dataclasses.replace(cfg, eviction_policy="lru")
    kvplug: dict[str, Any] = {}
    if policy.startswith("kvplug-") and not rust:
        kvplug = {
            "component_registry_override": kvplug_components(),
            "tree_core_backend": INSPECTED,
        }
    with pytest.MonkeyPatch.context() as patch:
        # The fixture asks SGLang for the accelerator; SGLang's own CPU switch
        # (SGLANG_USE_CPU_ENGINE) is read once at import, so the device is named here.
        patch.setattr(fixtures, "get_device", lambda: "cpu")
        built = build_fixture(cfg, **kvplug)
    if rust:
        params = dataclasses.replace(
            built[0].cache_init_params, eviction_policy=policy, tree_core_backend=RUST_BACKEND
        )
        cache = UnifiedRadixCache(params)
        cache.cache_init_params = params
        built = (cache, *built[1:])
    if "component_registry_override" in kvplug:  # every component of the cache is kvplug's
        components = built[0].tree_core.components_by_type
        assert {ct: type(c) for ct, c in components.items()} == {
            ct: kvplug_components()[ct] for ct in cfg.components
        }
    return built
