"""Which SGLang versions kvplug's integration supports, and the checks made at start-up.

kvplug subclasses SGLang's radix-tree core, tree components and LRU list and registers
into two private tables; none of these is a public interface. So at start-up kvplug

- refuses an untested SGLang (``strict_version: false`` in kvplug's config or
  ``KVPLUG_ALLOW_UNTESTED_SGLANG=1`` overrides), through the shared
  `kvplug.engine_version.EngineSupport`;
- checks that every private SGLang name it reaches exists (`check_private_names`), and
  fails naming the missing one otherwise.
"""

from __future__ import annotations

import importlib

from packaging.specifiers import SpecifierSet

from kvplug.engine_version import EngineSupport, UnsupportedEngineError

SUPPORTED_SGLANG = SpecifierSet(">=0.5.23,<0.6")
OVERRIDE_ENV = "KVPLUG_ALLOW_UNTESTED_SGLANG"
SGLANG = EngineSupport(
    "SGLang", "sglang", ("sglang",), SUPPORTED_SGLANG, "0.5.23", OVERRIDE_ENV, "sglang"
)

# (module, attribute) pairs kvplug relies on that SGLang does not document as public.
PRIVATE_NAMES = (
    ("sglang.srt.mem_cache.utils", "_EVICTION_POLICY_FACTORIES"),
    ("sglang.srt.mem_cache.unified_cache.unified_tree_core", "UnifiedTreeCore._add_new_node"),
    # a finished request's hand-over to the tree (what its released nodes learn of it)
    ("sglang.srt.mem_cache.unified_radix_cache", "UnifiedRadixCache.checkpoint_into_tree"),
    ("sglang.srt.mem_cache.unified_cache.unified_tree_core", "UnifiedTreeCore._split_node"),
    ("sglang.srt.mem_cache.unified_cache.unified_tree_core", "UnifiedTreeCore._insert_tail_step"),
    (
        "sglang.srt.mem_cache.unified_cache.unified_tree_core",
        "UnifiedTreeCore._inc_hit_count_and_check",
    ),
    ("sglang.srt.mem_cache.unified_cache.unified_tree_core", "UnifiedTreeCore._collect_all_nodes"),
    ("sglang.srt.mem_cache.unified_cache.components.full", "FullComponent._evict_device_start"),
    (
        "sglang.srt.mem_cache.unified_cache.components.full",
        "FullComponent._evict_device_next_node",
    ),
    ("sglang.srt.mem_cache.unified_cache.components.full", "FullComponent._evict_device_end"),
    # the sliding-window and Mamba walks and the LRU list that feeds kvplug's ranked sets
    ("sglang.srt.mem_cache.unified_cache.components.swa", "SWAComponent._evict_device_next_node"),
    (
        "sglang.srt.mem_cache.unified_cache.components.mamba",
        "MambaComponent._evict_device_next_node",
    ),
    (
        "sglang.srt.mem_cache.unified_cache.unified_tree_core",
        "UnifiedTreeCore._session_lru_predicate",
    ),
    ("sglang.srt.mem_cache.unified_cache.unified_tree_core", "UnifiedLRUList.insert_after"),
    # SGLang's own reasons its Rust tree core cannot serve (the backend's choice of core)
    ("sglang.srt.mem_cache.unified_cache.tree_core_registry", "_rust_fallback_reason"),
    (
        "sglang.srt.mem_cache.unified_cache.unified_tree_core",
        "UnifiedLRUList.reset_node_and_window_ancestors_mru",
    ),
)


def installed_sglang_version() -> str:
    return SGLANG.installed()


def check_sglang_version(strict: bool = True, found: str | None = None) -> str | None:
    """Raise `UnsupportedEngineError` for an untested SGLang unless overridden.

    Returns the problem (to log as a warning) when it was overridden, else None.
    """
    return SGLANG.check(installed_sglang_version() if found is None else found, strict)


def missing_private_names(names: tuple[tuple[str, str], ...] = PRIVATE_NAMES) -> list[str]:
    """The private SGLang names in `names` that the installed SGLang lacks."""
    missing = []
    for module_name, dotted in names:
        try:
            target: object = importlib.import_module(module_name)
            for part in dotted.split("."):
                target = getattr(target, part)
        except (ImportError, AttributeError):
            missing.append(f"{module_name}.{dotted}")
    return missing


def check_private_names(names: tuple[tuple[str, str], ...] = PRIVATE_NAMES) -> None:
    """Raise `UnsupportedEngineError` naming each private SGLang name that is missing."""
    missing = missing_private_names(names)
    if missing:
        raise UnsupportedEngineError(
            f"kvplug's SGLang integration needs SGLang internals that SGLang "
            f"{installed_sglang_version()} does not have: {', '.join(missing)}. Install a "
            f"supported SGLang ({SUPPORTED_SGLANG}, tested: {SGLANG.tested})"
        )


__all__ = [
    "SUPPORTED_SGLANG",
    "UnsupportedEngineError",
    "check_private_names",
    "check_sglang_version",
    "installed_sglang_version",
]
