"""kvplug's ``sglang.srt.plugins`` entry point.

SGLang loads general plugins in every process it starts, before it parses its
arguments, whether or not kvplug is wanted, so `register` only adds names (and one key, below):

- the ``kvplug-<name>`` choices of ``--radix-eviction-policy``, one per kvplug policy a
  server can run (third-party policies included), and their strategies;
- the tree-core backends ``kvplug`` (Python) and ``kvplug-rust``, and the radix-cache
  backend ``kvplug``.

It also copies a request's OpenAI ``user`` field to its ``kvplug_session`` custom
param, which only kvplug's backend reads (`kvplug.sglang.openai_user`).

Nothing changes unless ``--radix-cache-backend kvplug`` selects the backend. An untested
SGLang gets a warning here; the error comes from the backend, when selected.
"""

from __future__ import annotations

import functools
import logging
from typing import Any

logger = logging.getLogger("sglang.kvplug")


@functools.cache  # SGLang loads plugins once per process; a second call changes nothing
def register() -> None:
    from kvplug.sglang.version import SGLANG, check_private_names, installed_sglang_version

    problem = SGLANG.problem(installed_sglang_version())
    if problem is not None:
        logger.warning("%s (kvplug stays off unless --radix-cache-backend kvplug)", problem)
    try:
        check_private_names()
    except Exception as exc:  # the backend raises it if selected; never break SGLang here
        logger.warning("%s", exc)
        return
    register_names()
    try:
        from kvplug.sglang.openai_user import forward_user_field

        forward_user_field()
    except Exception as exc:  # the OpenAI server's classes moved: sessions by argument only
        logger.debug("kvplug: the OpenAI user field is not forwarded: %s", exc)


def register_names() -> None:
    """Add kvplug's policy choices, strategies and backends to SGLang's tables."""
    from sglang.srt.arg_groups.choices import (
        RADIX_EVICTION_POLICY_CHOICES,
        add_radix_eviction_policy_choices,
    )
    from sglang.srt.mem_cache import utils as sglang_cache_utils
    from sglang.srt.mem_cache.registry import (
        register_radix_cache_backend,
        registered_radix_cache_backends,
    )
    from sglang.srt.mem_cache.unified_cache.tree_core_registry import (
        register_tree_core_backend,
        registered_tree_core_backends,
    )

    from kvplug.sglang.backend import BACKEND, RUST_BACKEND, kvplug_radix_cache
    from kvplug.sglang.strategy import policy_choices, strategy_factory
    from kvplug.sglang.tree_core import kvplug_tree_core_factory

    choices = policy_choices()
    add_radix_eviction_policy_choices(
        [c for c in choices if c not in RADIX_EVICTION_POLICY_CHOICES]
    )
    factories = sglang_cache_utils._EVICTION_POLICY_FACTORIES
    for choice in choices:
        factories.setdefault(choice, strategy_factory(choice.removeprefix("kvplug-")))
    if BACKEND not in registered_tree_core_backends():
        register_tree_core_backend(BACKEND, kvplug_tree_core_factory)
    if RUST_BACKEND not in registered_tree_core_backends():
        register_tree_core_backend(RUST_BACKEND, _rust_tree_core_factory)
    if BACKEND not in registered_radix_cache_backends():
        register_radix_cache_backend(BACKEND, kvplug_radix_cache)


def _rust_tree_core_factory(params: Any, components: dict[Any, Any]) -> Any:
    """The ``kvplug-rust`` tree core, imported when selected (it loads SGLang's Rust
    extension)."""
    from kvplug.sglang.rust_core import KVPlugRustTreeCore

    return KVPlugRustTreeCore(params)
