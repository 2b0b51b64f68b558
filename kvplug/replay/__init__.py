"""Trace replay: kvplug's policies against the engines' own caches on the same requests.

A trace's requests become jobs in *units* (one unit is one trace block, one cache block
holds one unit); every arm gets the same calls in the same order and decides only what
it keeps. The counters are taken at each request's first admission, so every arm's
ratios share one denominator.

| module | owns |
|---|---|
| `trace` | Mooncake and Bailian traces; `count_blocks`, the one tokens-per-block rule |
| `synthetic` | the seeded synthetic workloads, as Mooncake-style traces |
| `loop` | jobs from a trace, and replaying them through one arm, sequential or realistic |
| `arms` | the `CacheArm` interface and `KVPlugArm`, kvplug's cache with one policy |
| `vllm_stock` | the `vllm-stock` and `vllm-kvplug:<policy>` arms: vLLM's own cache manager |
| `sglang_stock` | the `sglang-stock:<policy>` arm: SGLang's own radix cache |
| `runner` | arms x capacities, one `ReplayRow` each, and the offline policies' oracles |
| `hybrid` | the hybrid replay: capacity in bytes, junction and per-kind hits, `HybridRow` |
| `vllm_hybrid` | vLLM's own hybrid coordinator (and kvplug's pool) as a hybrid arm |
| `sglang_hybrid` | SGLang's unified radix cache with SWA / Mamba components as a hybrid arm |
| `hybrid_cli` | the ``kvplug hybrid-replay`` command |
| `report` | the table, JSON, CSV and the plot (absolute and relative to the stock arm) |
| `cli` | the ``kvplug replay`` and ``kvplug ab`` commands |
"""
