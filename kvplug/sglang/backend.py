"""The ``kvplug`` radix-cache backend: SGLang's own unified radix cache, kvplug deciding.

``--radix-cache-backend kvplug`` makes SGLang's scheduler call `kvplug_radix_cache`
(registered by `kvplug.sglang.plugin`). It builds what SGLang's default chain builds for
the model, a `UnifiedRadixCache` with full-attention, sliding-window and Mamba components
as the model needs, through SGLang's own `create_unified_radix_cache`, with three
differences, all set on SGLang's ``CacheInitParams`` by `apply_kvplug` (the one place a
kvplug cache is configured; the replay arm and the tests use it too):

- the tree core is kvplug's: SGLang's default Rust core with its full-attention victims
  named by kvplug (`kvplug.sglang.rust_core`, tree-core backend ``kvplug-rust``) where it
  serves the model (full attention, no host tier), else SGLang's pure-Python core with
  kvplug's eviction core beside it (`kvplug.sglang.tree_core`, backend ``kvplug``) and
  kvplug's full-attention, sliding-window and Mamba components
  (`kvplug.sglang.components`). ``$KVPLUG_SGLANG_TREE_CORE`` picks: ``auto`` (the
  default: Rust where it serves), ``rust`` (refused at start-up where it cannot serve),
  ``python``. Both make the same decisions; the Rust core is faster;
- the cache class is `KVPlugRadixCache`, which folds kvplug's namespace into each
  request's ``cache_salt`` (`kvplug.sglang.namespace`), counts kvplug's statistics, and
  keeps a finished request's path when it asks (``kvplug_retain_s``:
  `kvplug.sglang.retention`).

The policy is ``--radix-eviction-policy kvplug-<name>``, or kvplug's configured policy
(``cost`` by default) when that flag is left at SGLang's default. An SGLang policy named
explicitly is refused: it would not be kvplug's. The log says once
``kvplug is active: policy=...``.

With ``--enable-hierarchical-cache`` (SGLang's HiCache) kvplug ranks both tiers: a
device node the host holds is priced as a reload and demoted first, and the host pool
evicts by the same policy (`kvplug.sglang.tree_core`, "Tiers").

Start-up checks, each a clear error before the scheduler serves: the SGLang version,
the private SGLang names kvplug reaches, kvplug's config, and options kvplug does not
serve (the session radix cache, LMCache, pure sliding-window models, and, of HiCache,
a storage backend (its third tier) and sliding-window or Mamba models).
"""

from __future__ import annotations

import dataclasses
import logging
import os
from typing import Any

from sglang.srt.mem_cache.radix_cache import RadixKey
from sglang.srt.mem_cache.unified_radix_cache import UnifiedRadixCache

from kvplug.config import KVPlugConfig
from kvplug.core.model_spec import ModelSpec, load_model, served_model
from kvplug.core.sessions import SESSION_ARG, names_session
from kvplug.errors import ConfigError
from kvplug.sglang.components import kvplug_components
from kvplug.sglang.namespace import RequestNamespace, first_sight
from kvplug.sglang.queue_protection import TreeQueueProtection
from kvplug.sglang.queue_protection import refusal_for as protection_refusal
from kvplug.sglang.retention import TreeRetention, refusal_for
from kvplug.sglang.stats import CacheStats, PrometheusExporter
from kvplug.sglang.strategy import PREFIX, load_config, policy_name
from kvplug.sglang.tree_core import FULL, ReleasingRequest
from kvplug.sglang.version import check_private_names, check_sglang_version

logger = logging.getLogger("sglang.kvplug")


def request_names_session(req: Any, stats: CacheStats) -> bool:
    """Whether SGLang's `req` names a session (`kvplug.core.sessions`): ``kvplug_session``
    in its sampling params' ``custom_params``, decided and counted once per request."""
    named = getattr(req, "kvplug_session", None)
    if named is None:
        custom = getattr(req.sampling_params, "custom_params", None) or {}
        asked = custom.get(SESSION_ARG) if isinstance(custom, dict) else None
        named = req.kvplug_session = names_session(asked, None, stats, req.rid, logger)
    return named


BACKEND = "kvplug"  # the name of both the radix-cache and the Python tree-core backend
RUST_BACKEND = "kvplug-rust"  # the tree-core backend of `kvplug.sglang.rust_core`
TREE_CORE_ENV = "KVPLUG_SGLANG_TREE_CORE"
TREE_CORE_CHOICES = ("auto", "rust", "python")


class KVPlugRadixCache(UnifiedRadixCache):
    """SGLang's `UnifiedRadixCache`; each request's keys carry kvplug's namespace, a
    finished request's released nodes learn what it knew (`ReleasingRequest`), and
    kvplug's counters (``kvplug_stats``, its tree core's) count each request once, when it
    finishes, with the cached tokens SGLang itself reports for it (``req.cached_tokens``,
    so kvplug's and SGLang's counters agree), and reach ``/metrics`` through
    ``kvplug_exporter`` when SGLang's metrics are on, at every finish (a few memory-mapped
    writes; a rate limit would leave the last request of a burst unpublished).
    """

    kvplug_namespace: RequestNamespace | None = None
    kvplug_model: ModelSpec | None = None
    kvplug_exporter: PrometheusExporter | None = None
    kvplug_stats: CacheStats
    kvplug_retention: TreeRetention | None = None  # what finished requests asked to keep
    kvplug_protection: TreeQueueProtection | None = None  # what waiting requests will hit

    def match_prefix(self, params: Any) -> Any:
        retention = self.kvplug_retention
        if retention is not None and retention.book.live:
            retention.expire()
        req = params.req
        first = req is not None and first_sight(req)
        namespace = self.kvplug_namespace
        if first and namespace is not None and namespace.apply(req):
            key = params.key
            params = dataclasses.replace(
                params,
                key=RadixKey(
                    key.token_ids,
                    key.extra_key,
                    is_bigram=key.is_bigram,
                    limit=key.limit,
                    cache_salt=req.cache_salt,
                ),
            )
        result = super().match_prefix(params)
        protection = self.kvplug_protection
        if protection is not None and req is not None:
            protection.matched(req, self.tree_core.last_matched)
        if retention is not None and retention.book.live and req is not None:
            # SGLang admits a request when its new tokens fit in the free and evictable
            # slots: retained paths (locked) give way first, oldest first, so that a
            # request never waits for a retention
            need = len(params.key.token_ids) - result.device_prefix_len
            allocator = self.token_to_kv_pool_allocator
            while allocator.available_size() + self.full_evictable_size() < need:
                if not retention.lapse_oldest():
                    break
        return result

    def checkpoint_into_tree(self, req: Any, *, up_to: int, **kwargs: Any) -> None:
        # A finished request's insert and the lock release after it (SGLang's
        # `release_kv_cache`) let its path go: the records learn of it until `on_release`.
        # Its output is its ``output_ids``, or ``kvplug_output_tokens`` where a caller
        # whose tokens are not model tokens sets it (the replay: a unit is a trace block).
        self.tree_core.releasing = None
        if req.finished():
            self.tree_core.releasing = ReleasingRequest(
                min(up_to, len(req.full_untruncated_fill_ids)),
                self.page_size,
                req.cached_tokens > 0,
                getattr(req, "kvplug_output_tokens", None) or len(req.output_ids),
                request_names_session(req, self.tree_core.stats),
            )
        super().checkpoint_into_tree(req, up_to=up_to, **kwargs)
        retention = self.kvplug_retention
        if retention is not None and req.finished() and req.lock is not None:
            namespace = self.kvplug_namespace
            tenant = namespace.tenant(req) if namespace is not None else ""
            seconds = retention.asked(req, tenant)
            if seconds is not None:  # its path, ending where its insert ended, kept
                node = req.lock.node
                pages = self.path_device_indices(node)[:: self.page_size].tolist()
                retention.hold(node, pages, tenant, seconds)

    def evict_for_alloc(self, params: Any, **kwargs: Any) -> Any:
        # SGLang's allocation walk runs to a target, past the tokens it names; those
        # are what partial eviction frees (`KVPlugTreeCore.split_victim`)
        if self.kvplug_protection is not None:
            self.kvplug_protection.refresh()
        retention = self.kvplug_retention
        if retention is None or not retention.book.live or kwargs:
            return self._evict_for_alloc(params, **kwargs)
        retention.expire()
        # a retained path goes only when nothing else can: the oldest retention ends
        # while the eviction falls short of the slots asked for
        allocator = self.token_to_kv_pool_allocator
        target = allocator.available_size() + params.num_tokens
        result = self._evict_for_alloc(params)
        while allocator.available_size() < target and retention.lapse_oldest():
            more = self._evict_for_alloc(
                dataclasses.replace(params, num_tokens=target - allocator.available_size())
            )
            result.num_tokens_evicted += more.num_tokens_evicted
        return result

    def _evict_for_alloc(self, params: Any, **kwargs: Any) -> Any:
        self.tree_core.evict_goal = params.num_tokens
        try:
            return super().evict_for_alloc(params, **kwargs)
        finally:
            self.tree_core.evict_goal = None

    def on_release(self, req: Any, *, checkpointed: bool) -> None:
        self.tree_core.releasing = None
        super().on_release(req, checkpointed=checkpointed)
        if req.finished() and self.kvplug_protection is not None:
            self.kvplug_protection.forget(req)
        if req.finished() and not getattr(req, "kvplug_counted", False):
            req.kvplug_counted = True  # a request is released once per retraction too
            self._count_request(len(req.origin_input_ids), req.cached_tokens)

    def _count_request(self, prompt: int, matched: int) -> None:
        stats = self.kvplug_stats
        stats.requests += 1
        stats.prompt_tokens += prompt
        stats.matched_tokens += matched
        model = self.kvplug_model
        if model is not None:
            stats.prompt_flops += model.prefill_flops(0, prompt)
            stats.saved_flops += model.prefill_flops(0, matched)
        exporter = self.kvplug_exporter
        if exporter is not None:
            core = self.tree_core
            tokens = core.full_evictable_size() + core.full_protected_size()
            stats.cached_blocks = tokens // self.page_size  # pages, not tree nodes
            if model is not None:
                stats.bytes_held = int(tokens * model.kv_bytes_per_token())
            if self.kvplug_retention is not None:
                stats.retained_blocks = self.kvplug_retention.retained_blocks()
            if self.kvplug_protection is not None:
                stats.protected_blocks = self.kvplug_protection.protected_pages()
            exporter.publish(stats)


def tree_core_wanted(given: str | None = None) -> str:
    """`given`, else ``$KVPLUG_SGLANG_TREE_CORE``: ``auto`` (unset), ``rust`` or
    ``python``."""
    source = "tree_core" if given is not None else TREE_CORE_ENV
    raw = given if given is not None else os.environ.get(TREE_CORE_ENV, "auto")
    wanted = raw.strip().lower() or "auto"
    if wanted not in TREE_CORE_CHOICES:
        raise ConfigError(
            f"{source}={raw!r} is not a tree core; choose one of {', '.join(TREE_CORE_CHOICES)}"
        )
    return wanted


def rust_core_refusal(params: Any, *, hybrid: bool, hicache: bool) -> str | None:
    """Why the Rust core cannot serve a kvplug cache built from SGLang's `params`, or None.
    `hybrid`: the model has sliding-window or Mamba layers; `hicache`: a host tier."""
    from sglang.srt.mem_cache.unified_cache.tree_core_registry import _rust_fallback_reason

    if hybrid:
        return "sliding-window and Mamba state are ranked on the Python core"
    if hicache:
        return "the host tier (HiCache) is ranked on the Python core"
    if params.is_eagle:
        return "EAGLE's bigram keys are mirrored on the Python core only"
    components = tuple(params.tree_components or (FULL,))
    if components != (FULL,):
        return "sliding-window and Mamba state are ranked on the Python core"
    # SGLang's own reasons (session cache, platform, PyTorch, a missing extension), for
    # SGLang's stock components: the Rust core evicts through its own
    stock = dataclasses.replace(params, component_registry_override=None)
    return _rust_fallback_reason(stock)


def choose_tree_core(
    params: Any, *, hybrid: bool, hicache: bool, wanted: str | None = None
) -> tuple[str, str]:
    """(``rust`` or ``python``, why) for a kvplug cache built from SGLang's `params`, as
    `wanted` or else ``$KVPLUG_SGLANG_TREE_CORE`` asks (`tree_core_wanted`); ``rust``
    asked where it cannot serve is refused."""
    wanted = tree_core_wanted(wanted)
    if wanted == "python":
        return "python", f"{TREE_CORE_ENV}=python"
    refusal = rust_core_refusal(params, hybrid=hybrid, hicache=hicache)
    if refusal is None:
        return "rust", "SGLang's default core, kvplug naming its victims"
    if wanted == "rust":
        raise ConfigError(
            f"{TREE_CORE_ENV}=rust cannot be served: {refusal}; set {TREE_CORE_ENV}=auto or python"
        )
    return "python", refusal


def apply_kvplug(
    params: Any,
    config: KVPlugConfig,
    model: ModelSpec | None = None,
    *,
    hybrid: bool | None = None,
    hicache: bool = False,
    tree_core: str | None = None,
) -> tuple[str, str]:
    """Configure SGLang's `CacheInitParams` so that the cache built from them is
    kvplug's: its tree core (`choose_tree_core`; `hybrid` defaults to what
    ``params.tree_components`` say), its components on the Python core, and the policy
    `config` names; `tree_core` overrides ``$KVPLUG_SGLANG_TREE_CORE``. Registers kvplug's
    names with SGLang first, if the entry point has not. Returns the tree core chosen and
    why."""
    from kvplug.sglang.plugin import register_names

    register_names()
    if hybrid is None:
        hybrid = any(ct != FULL for ct in (params.tree_components or ()))
    core, why = choose_tree_core(params, hybrid=hybrid, hicache=hicache, wanted=tree_core)
    if core == "rust":
        params.tree_core_backend = RUST_BACKEND
    else:
        params.tree_core_backend = BACKEND
        params.component_registry_override = {
            **(params.component_registry_override or {}),
            **kvplug_components(),
        }
    params.eviction_policy = PREFIX + config.policy
    params.eviction_policy_config = {
        "kvplug_config": config,
        "kvplug_model": model if model is not None else load_model(None),
    }
    return core, why


def build_cache(
    params: Any,
    config: KVPlugConfig,
    model: ModelSpec | None = None,
    *,
    tree_core: str | None = None,
) -> Any:
    """A `KVPlugRadixCache` from SGLang's `params` (pools already built), ranked by
    `config`'s policy on the tree core `tree_core` asks for (`apply_kvplug`): what the
    backend builds, for callers that hold the pools."""
    apply_kvplug(params, config, model, tree_core=tree_core)
    cache = KVPlugRadixCache(params)
    attach(cache, config)
    return cache


def attach(
    cache: Any,
    config: KVPlugConfig,
    namespace: RequestNamespace | None = None,
    model: ModelSpec | None = None,
    exporter: PrometheusExporter | None = None,
    tp_size: int = 1,
) -> None:
    """Give a built cache its namespace, model, exporter and retentions (a server with
    `tp_size` tensor-parallel ranks); its statistics are its tree core's."""
    cache.kvplug_stats = cache.tree_core.stats
    cache.kvplug_namespace = namespace
    cache.kvplug_model = model
    cache.kvplug_exporter = exporter
    pages = cache.token_to_kv_pool_allocator.size // cache.page_size
    cache.kvplug_retention = TreeRetention(
        cache,
        config.retention.book(pages),
        cache.kvplug_stats,
        config.retention.default_seconds,
        refusal_for(tuple(cache.tree_components) == (FULL,), tp_size),
    )
    depth = config.queue_protection.requests
    refusal = protection_refusal(depth, tuple(cache.tree_components) == (FULL,))
    if refusal is not None:
        raise ConfigError(refusal)
    cache.kvplug_protection = TreeQueueProtection(cache, depth) if depth else None


def server_config(params: Any, server_args: Any) -> KVPlugConfig:
    """kvplug's config for a server: the policy from ``--radix-eviction-policy``, keys
    from ``--radix-eviction-policy-config`` or ``$KVPLUG_CONFIG``."""
    choice = str(params.eviction_policy)
    name = policy_name(choice)
    explicit = bool(getattr(server_args, "_radix_eviction_policy_explicitly_set", False))
    if name is None and (explicit or choice.lower() != "lru"):
        raise ConfigError(
            f"--radix-cache-backend {BACKEND} ranks with kvplug's policies, but "
            f"--radix-eviction-policy {choice} is SGLang's; use kvplug-<name> (for SGLang's "
            f"order, kvplug-lru) or drop --radix-cache-backend {BACKEND}"
        )
    config = load_config(name, params.eviction_policy_config)
    if config.block_size is not None and config.block_size != params.page_size:
        raise ConfigError(
            f"kvplug config: block_size {config.block_size} cannot be served: SGLang pages "
            f"its KV cache in {params.page_size} tokens; start SGLang with --page-size "
            f"{config.block_size} or drop kvplug's block_size"
        )
    return config


def refuse_unserved(ctx: Any) -> None:
    """Raise `ConfigError` for an SGLang option the kvplug backend does not serve."""
    from sglang.srt.runtime_context import get_memory

    unserved = []
    if ctx.enable_hierarchical_cache:
        if ctx.is_hybrid_swa or ctx.is_hybrid_ssm:
            # their host copies of sliding-window and Mamba state are ranked by SGLang's
            # own LRU lists, which kvplug does not rank
            unserved.append("--enable-hierarchical-cache with a sliding-window or Mamba model")
        if getattr(ctx.server_args, "hicache_storage_backend", None):
            unserved.append(
                f"--hicache-storage-backend {ctx.server_args.hicache_storage_backend} (HiCache's "
                "third tier; the device and host tiers alone are served)"
            )
    if ctx.params.enable_session_radix_cache:
        unserved.append("--enable-session-radix-cache")
    if getattr(get_memory(), "enable_lmcache", False):
        unserved.append("--enable-lmcache")
    if ctx.is_hybrid_swa and ctx.full_tokens_per_layer == 0:
        unserved.append("a model with sliding-window layers only")
    if unserved:
        raise ConfigError(
            f"--radix-cache-backend {BACKEND} does not serve {', '.join(unserved)}; drop "
            f"--radix-cache-backend {BACKEND} to use SGLang's own cache there"
        )


def kvplug_radix_cache(ctx: Any) -> Any:
    """The ``kvplug`` entry of SGLang's radix-cache registry (see the module doc)."""
    from sglang.srt.mem_cache.registry import create_unified_radix_cache

    params = ctx.params
    config = server_config(params, ctx.server_args)
    problem = check_sglang_version(strict=config.strict_version)
    if problem is not None:
        logger.warning("%s (overridden)", problem)
    check_private_names()
    if ctx.disable_radix_cache:
        logger.info("kvplug is inactive: the radix cache is disabled")
        from sglang.srt.mem_cache.registry import default_radix_cache_factory

        return default_radix_cache_factory(ctx)
    refuse_unserved(ctx)
    model = served_model(ctx.model_config, str(getattr(ctx.model_config, "model_path", "")))
    core, why = apply_kvplug(
        params,
        config,
        model,
        hybrid=bool(ctx.is_hybrid_swa or ctx.is_hybrid_ssm),
        hicache=bool(ctx.enable_hierarchical_cache),
    )
    cache = create_unified_radix_cache(ctx, cache_class=KVPlugRadixCache)
    exporter = None
    if params.enable_metrics:
        exporter = PrometheusExporter(str(getattr(ctx, "tp_rank", 0)), config.policy)
    namespace = RequestNamespace.for_server(config, ctx.server_args, params)
    attach(cache, config, namespace, model, exporter, int(getattr(ctx, "tp_size", 1) or 1))
    components = "+".join(component.name for component in params.tree_components)
    logger.info(
        "kvplug is active: policy=%s %s, %d pages of %d tokens, components %s, tree core: %s (%s)",
        config.policy,
        config.policy_config or "(defaults)",
        cache.tree_core.num_pages,
        params.page_size,
        components,
        "SGLang's Rust core" if core == "rust" else "SGLang's Python core",
        why,
    )
    return cache
