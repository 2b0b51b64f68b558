"""kvplug's engine-neutral core: keys, blocks, the prefix index, eviction, and `KVCache`.

Nothing here imports an engine, torch or a kernel library. The engine adapters
(`kvplug.vllm`, `kvplug.sglang`) and the replay (`kvplug.replay`) build on these
modules; the one piece every one of them shares is the eviction core.

| module | owns |
|---|---|
| `keys` | `Namespace`, `MMFeature` and chained block keys ``H(parent, tokens, extras)`` |
| `pool` | physical blocks, `BlockState`, reference counts, the O(1) free queue |
| `index` | the radix tree over block keys, one tree per namespace; matches verify tokens |
| `eviction` | `EvictionCore`: the exact evictable leaves and the next victim, for every adapter |
| `dense` | `DenseCostCore`, `DenseLearnedCore`: `cost`, `learned` over typed arrays by block id |
| `ranked_set` | `RankedSet`: state evicted from any node (SWA, Mamba), by rank then recency |
| `prefix_cache` | `PrefixCache`: lookups, publication and eviction order over the index |
| `fences` | `StepClock`: steps, fences, writes and releases that wait for a fence |
| `retention` | `RetentionBook`: prefixes kept on request, per tenant, capped, expiring |
| `cache` | `KVCache`, the one mutating facade: tables, append, fork, finish, retain |
| `audit` | `check_invariants` and the `usage` gauges of a `KVCache` |
| `events` | `BlockStored` / `BlockRemoved`, what a cache publishes about its index |
| `groups` | `CacheGroupSpec`: full attention, sliding window or Mamba, sharing one pool |
| `metrics` | the cache's counters and its `Usage` snapshot |
| `model_spec` | `ModelSpec`, prefill FLOPs per position, KV bytes per token, `kv_budget` |
"""
