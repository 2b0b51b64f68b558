"""The scheduler vLLM builds when started with ``--scheduler-cls kvplug.vllm.Scheduler``.

`Scheduler` is a factory: it takes the class vLLM would have used (``AsyncScheduler``
when async scheduling is on, else ``Scheduler``) and returns an instance of a subclass
whose only differences are

- its KV cache manager's block pool is a `KVPlugBlockPool`, so kvplug's policy decides
  evictions (built by `kvplug.vllm.kv_cache_manager`, the one construction site);
- each request's prefix keys carry kvplug's namespace (model revision, tokenizer and
  tenant) on top of what vLLM hashes already (LoRA, multimodal inputs, ``cache_salt``);
- it keeps `PoolStats` and publishes them for ``/metrics``;
- a finished request that asked (``kvplug_retain_s``) keeps its prompt prefix for a while
  (`kvplug.vllm.retention`);
- with ``queue_protection.requests`` set, the first waiting requests' cached hits are
  evicted last (`kvplug.vllm.queue_protection`).

Everything else (batching, preemption, KV events, vLLM's own metrics) is vLLM's code.
"""

from __future__ import annotations

import functools
import logging
import os
from typing import Any

from vllm.v1.core.sched import scheduler as vllm_scheduler
from vllm.v1.kv_cache_interface import FullAttentionSpec, MLAAttentionSpec

from kvplug.config import KVPlugConfig, build_policy
from kvplug.core.keys import namespace_salt
from kvplug.core.model_spec import ModelSpec, served_model
from kvplug.errors import ConfigError
from kvplug.vllm.block_pool import KVPlugBlockPool
from kvplug.vllm.kv_cache_manager import (
    KVPlugKVCacheManager,
    attach_policy,
    kvplug_classes,
    matched_tokens,
)
from kvplug.vllm.queue_protection import PoolQueueProtection
from kvplug.vllm.queue_protection import refusal_for as protection_refusal
from kvplug.vllm.retention import PoolRetention, refusal_for
from kvplug.vllm.stats import METRICS_DIR_ENV, PoolStats, SnapshotWriter
from kvplug.vllm.version import check_vllm_version

logger = logging.getLogger("vllm.kvplug")

# the KV cache specs whose kept prompt blocks are a prefix hit (full attention, MLA's too)
PREFIX_SPECS = (FullAttentionSpec, MLAAttentionSpec)
TENANT_ARG = "kvplug_tenant"  # per request: SamplingParams.extra_args / OpenAI vllm_xargs


def Scheduler(**kwargs: Any) -> Any:  # noqa: N802 - vLLM calls it like a class
    """Build the scheduler vLLM would have built, with kvplug's pool inside."""
    vllm_config = kwargs["vllm_config"]
    return scheduler_class(bool(vllm_config.scheduler_config.async_scheduling))(**kwargs)


@functools.cache
def scheduler_class(async_scheduling: bool) -> type:
    """vLLM's scheduler class for this mode, with `KVPlugSchedulerMixin` in front."""
    if async_scheduling:
        from vllm.v1.core.sched.async_scheduler import AsyncScheduler as base
    else:
        base = vllm_scheduler.Scheduler
    return type(f"KVPlug{base.__name__}", (KVPlugSchedulerMixin, base), {"__module__": __name__})


def load_config(vllm_config: Any) -> KVPlugConfig:
    """``additional_config["kvplug"]`` if given, else ``$KVPLUG_CONFIG``, else defaults."""
    extra = getattr(vllm_config, "additional_config", None) or {}
    if "kvplug" in extra:
        try:
            return KVPlugConfig.load({"kvplug": extra["kvplug"]})
        except ConfigError as exc:
            raise ConfigError(f"{exc} (from --additional-config)") from exc
    return KVPlugConfig.load(None)


def model_spec(vllm_config: Any) -> ModelSpec:
    """The served model's shape, for FLOPs estimates; a preset if it cannot be read."""
    model_config = vllm_config.model_config
    return served_model(model_config, str(model_config.model))


class KVPlugSchedulerMixin:
    """The kvplug part of the scheduler; placed before vLLM's class in the MRO."""

    kv_cache_manager: KVPlugKVCacheManager

    def __init__(self, **kwargs: Any) -> None:
        vllm_config = kwargs["vllm_config"]
        config = load_config(vllm_config)
        check_vllm_version(strict=config.strict_version)
        _check_block_size(config, vllm_config)
        model = model_spec(vllm_config)
        policy = build_policy(config, model)
        kv_cache_config = kwargs["kv_cache_config"]
        connector = vllm_config.kv_transfer_config is not None
        with kvplug_classes(policy, connector, kv_cache_config):
            super().__init__(**kwargs)  # type: ignore[call-arg]
        self.kvplug_config = config
        self.kvplug_stats = attach_policy(self.kv_cache_manager, policy, kv_cache_config)
        self.kvplug_pool: KVPlugBlockPool = self.kv_cache_manager.block_pool
        self.kvplug_retention = PoolRetention(
            self.kv_cache_manager,
            config.retention.book(kv_cache_config.num_blocks),
            self.kvplug_stats,
            config.retention.default_seconds,
            refusal_for(
                all(
                    type(group.kv_cache_spec) in PREFIX_SPECS
                    for group in kv_cache_config.kv_cache_groups
                )
            ),
        )
        depth = config.queue_protection.requests
        refusal = protection_refusal(depth, self.kvplug_pool)
        if refusal is not None:
            raise ConfigError(refusal)
        self.kvplug_protection: PoolQueueProtection | None = (
            PoolQueueProtection(self.kv_cache_manager, depth) if depth else None
        )
        self._bytes_per_block = _bytes_per_block(kv_cache_config)
        self._model = model
        self._namespace = _namespace_parts(config, vllm_config)
        self._snapshots: SnapshotWriter | None = None
        # vLLM 0.32 resets data_parallel_rank to 0 in each engine core of a dense model;
        # data_parallel_index keeps the engine's own rank (vLLM's KV events use it too).
        parallel = vllm_config.parallel_config
        dp_rank = getattr(parallel, "data_parallel_index", parallel.data_parallel_rank)
        if os.environ.get(METRICS_DIR_ENV):
            self._snapshots = SnapshotWriter(engine=str(dp_rank))
        logger.info(
            "kvplug is active (engine %d): policy=%s %s, %d blocks of %d tokens, "
            "%d KV cache group(s) (%s), prefix caching %s, pool %s",
            dp_rank,
            config.policy,
            config.policy_config or "(defaults)",
            kv_cache_config.num_blocks,
            kwargs.get("block_size"),
            len(kv_cache_config.kv_cache_groups),
            type(self.kv_cache_manager.coordinator).__name__,
            "on" if self.kvplug_pool.enable_caching else "off",
            type(self.kvplug_pool).__name__,
        )

    # -- requests -------------------------------------------------------------------------
    def add_request(self, request: Any) -> None:
        if request.request_id not in self.requests:  # type: ignore[attr-defined]
            self._apply_namespace(request)
        super().add_request(request)  # type: ignore[misc]

    def schedule(self, *args: Any, **kwargs: Any) -> Any:
        self.kvplug_retention.expire()  # (nothing to do, at once, while none is live)
        if self.kvplug_protection is not None:
            self.kvplug_protection.refresh(self.waiting)  # type: ignore[attr-defined]
        return super().schedule(*args, **kwargs)  # type: ignore[misc]

    def _tenant_of(self, request: Any) -> str:
        """The tenant a request's blocks are keyed and retained under."""
        namespace = self.kvplug_config.namespace
        if namespace.share_across_tenants:
            return namespace.tenant
        extra_args = getattr(request.sampling_params, "extra_args", None) or {}
        return str(extra_args.get(TENANT_ARG, namespace.tenant))

    def _apply_namespace(self, request: Any) -> None:
        """Salt the request's first block with kvplug's namespace and rehash its blocks.

        Within one engine every request shares the model, revision and tokenizer, so that
        part of the salt changes no hit; it is applied only where cached state can leave
        the engine (a KV connector), or to KV events with ``namespace.salt_kv_events``. KV
        events only tell a router where prefixes are, so by default they keep vLLM's own
        hashes, which a router recomputing them from the prompt matches. A request naming
        a tenant other than the configured one is always salted, and rehashed (a cost of
        one prompt hash).
        """
        if getattr(request, "_block_hasher", None) is None:
            return  # prefix caching is off: nothing is keyed
        namespace = self.kvplug_config.namespace
        default, tenant = namespace.tenant, self._tenant_of(request)
        exported = self.connector is not None or (  # type: ignore[attr-defined]
            namespace.salt_kv_events and self.enable_kv_cache_events  # type: ignore[attr-defined]
        )
        if tenant == default and not exported:
            return
        parts = [*self._namespace.values(), tenant, request.cache_salt or ""]
        request.cache_salt = namespace_salt(parts)
        request.block_hashes = []
        request.update_block_hashes()

    def _free_request(self, request: Any, delay_free_blocks: bool = False) -> Any:
        stats = self.kvplug_stats
        prompt = request.num_prompt_tokens
        matched = matched_tokens(request)
        stats.requests += 1
        stats.prompt_tokens += prompt
        stats.matched_tokens += matched
        stats.prompt_flops += self._model.prefill_flops(0, prompt)
        stats.saved_flops += self._model.prefill_flops(0, matched)
        retention = self.kvplug_retention
        params = request.sampling_params  # (None for a pooling request)
        if retention.defaults or (params is not None and params.extra_args):
            retention.on_finish(request, self._tenant_of(request))
        return super()._free_request(request, delay_free_blocks)  # type: ignore[misc]

    # -- statistics -----------------------------------------------------------------------
    def make_stats(self, *args: Any, **kwargs: Any) -> Any:
        result = super().make_stats(*args, **kwargs)  # type: ignore[misc]
        snapshots = self._snapshots
        idle = not self.requests  # type: ignore[attr-defined]
        # Rate-limited while busy; the state the engine goes idle in is always written.
        if result is not None and snapshots is not None and snapshots.due(force=idle):
            snapshots.write(self.refresh_kvplug_gauges(), self.kvplug_config.policy)
        return result

    def refresh_kvplug_gauges(self) -> PoolStats:
        stats = self.kvplug_stats
        stats.cached_blocks = self.kvplug_pool.num_cached_blocks()
        stats.bytes_held = stats.cached_blocks * self._bytes_per_block
        deferred = self.deferred_frees  # type: ignore[attr-defined]
        stats.deferred_blocks = sum(len(blocks) for _, blocks in deferred)
        step = self.sched_step_seq  # type: ignore[attr-defined]
        stats.deferred_age_steps = max((step - seq for seq, _ in deferred), default=0)
        retention = self.kvplug_retention
        stats.retained_blocks = retention.retained_blocks()
        stats.protected_blocks = self.kvplug_pool.num_protected()
        stats.retained_bytes = {
            tenant: blocks * self._bytes_per_block
            for tenant, blocks in retention.book.by_tenant().items()
        }
        return stats


def _check_block_size(config: KVPlugConfig, vllm_config: Any) -> None:
    engine_block_size = vllm_config.cache_config.block_size
    if config.block_size is not None and config.block_size != engine_block_size:
        raise ConfigError(
            f"kvplug config: block_size {config.block_size} cannot be served: vLLM allocated "
            f"its KV cache in blocks of {engine_block_size} tokens; start vLLM with "
            f"--block-size {config.block_size} or drop kvplug's block_size"
        )


def _bytes_per_block(kv_cache_config: Any) -> int:
    total = sum(tensor.size for tensor in kv_cache_config.kv_cache_tensors)
    return total // max(kv_cache_config.num_blocks, 1)


def _namespace_parts(config: KVPlugConfig, vllm_config: Any) -> dict[str, str]:
    """The engine's part of the namespace (the tenant is the request's), in a fixed order."""
    model = vllm_config.model_config
    return {
        "model": str(model.model),
        "revision": config.namespace.model_revision or str(model.revision or ""),
        "tokenizer": str(model.tokenizer),
        "tokenizer_revision": str(model.tokenizer_revision or ""),
        "dtype": str(model.dtype),
    }
