"""kvplug inside vLLM: ``--scheduler-cls kvplug.vllm.Scheduler``.

    python -m vllm.entrypoints.openai.api_server --model MODEL \\
        --scheduler-cls kvplug.vllm.Scheduler \\
        --additional-config '{"kvplug": {"policy": "cost"}}'

or offline, ``LLM(model, scheduler_cls="kvplug.vllm.Scheduler", additional_config=...)``.
Options are kvplug's config keys (`kvplug.config.KVPlugConfig`), from
``additional_config["kvplug"]`` or the file named by ``$KVPLUG_CONFIG``.

Importing this package does not import vLLM; `Scheduler` does, when vLLM calls it.
kvplug decides which block goes next (the eviction core in `kvplug.core.eviction`, the
same one `KVCache` runs); vLLM keeps allocation, reference counts, hashing, KV events
and its own metrics. For a hybrid model (sliding-window and full-attention groups) the
pool makes one decision across groups: a victim takes the other sliding-window groups'
blocks at its position with it, since no junction can use them any more.

| module | owns |
|---|---|
| `scheduler` | the `Scheduler` factory, kvplug's config, the namespace salt, statistics |
| `kv_cache_manager` | the one construction site: vLLM's manager over kvplug's pool; group kinds |
| `block_pool` | `KVPlugBlockPool`, `ReleaseOrderPool` (lru), `pool_class`, `RecordNodes` |
| `dense_pool` | `DenseCostPool`: `cost` and `learned` over the dense core, the same decisions |
| `anchors` | `HybridRules`: cross-group retiring, anchored windows, over a pool's `BlockNodes` |
| `free_queue` | `PolicyFreeQueue`: vLLM's free-queue interface; its walk is the eviction order |
| `offload_policy` | `KVPlugCachePolicy`: kvplug's decision in vLLM's CPU offload tier |
| `retention` | `PoolRetention`: prefixes kept on request (``kvplug_retain_s``), by reference |
| `queue_protection` | `PoolQueueProtection`: the waiting queue's hits, claimed once per step |
| `openai_user` | the OpenAI ``user`` field, copied to a request's ``kvplug_session`` |
| `compat` | everything that differs between the vLLM releases supported (0.32 to 0.34) |
| `stats` | `PoolStats`, metrics snapshots and the Prometheus collector |
| `plugin` | the ``vllm.general_plugins`` entry point |
| `version` | the supported vLLM range and its check |

The benchmarks of this adapter (``kvplug bench step``, ``manager``, ``block-pool``,
``cpu-tier``) are in `kvplug.bench`.
"""

from __future__ import annotations

from typing import Any

__all__ = ["Scheduler"]


def Scheduler(**kwargs: Any) -> Any:  # noqa: N802 - vLLM calls it like a class
    """Build the scheduler vLLM would have built, with kvplug's block pool inside."""
    from kvplug.vllm.scheduler import Scheduler as build

    return build(**kwargs)
