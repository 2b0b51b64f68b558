"""kvplug inside SGLang: ``--radix-cache-backend kvplug``.

    python -m sglang.launch_server --model-path MODEL --radix-cache-backend kvplug \\
        [--radix-eviction-policy kvplug-cost] [--radix-eviction-policy-config '{...}']

or offline, ``sglang.Engine(model_path=..., radix_cache_backend="kvplug", ...)``.
kvplug's ``sglang.srt.plugins`` entry point registers the names; nothing changes unless
the backend is selected. Options are kvplug's config keys (`kvplug.config.KVPlugConfig`),
from ``--radix-eviction-policy-config`` or the file named by ``$KVPLUG_CONFIG``.

Importing this package does not import SGLang; every module below except `plugin`,
`namespace` and `prefix_keys` does. kvplug decides which node goes next (the eviction core in
`kvplug.core.eviction`, the same one `KVCache` and the vLLM adapter run, and
`kvplug.core.ranked_set` for state evicted from internal nodes); SGLang keeps
its tree, allocation, locks, KV events and its own metrics. A full-attention model runs on
SGLang's default Rust tree core, kvplug naming its victims from a mirror of the tree; a
hybrid model or a host tier runs on SGLang's Python core with kvplug's components
(``$KVPLUG_SGLANG_TREE_CORE`` overrides the choice).

| module | owns |
|---|---|
| `plugin` | the ``sglang.srt.plugins`` entry point: policy choices, strategies, backends |
| `backend` | the ``kvplug`` cache factory, `apply_kvplug` (one set-up site), `KVPlugRadixCache` |
| `rust_core` | `KVPlugRustTreeCore`: SGLang's Rust tree core, its victims named from a mirror |
| `tree_core` | `KVPlugTreeCore` (SGLang's Python tree core) and `NodeRecord` (the core's node) |
| `components` | `KVPlugFullComponent`, `KVPlugSWAComponent`, `KVPlugMambaComponent` |
| `ranked_lru` | `RankedLRUList`: SGLang's SWA / Mamba LRU list, feeding a `RankedSet` |
| `strategy` | the ``kvplug-<name>`` strategies and kvplug's config from SGLang's arguments |
| `namespace` | the tenant and namespace salt folded into each request's ``cache_salt`` |
| `retention` | `TreeRetention`: paths kept on request (``kvplug_retain_s``), by a tree lock |
| `queue_protection` | `TreeQueueProtection`: the paths waiting requests matched, evicted last |
| `openai_user` | the OpenAI ``user`` field, copied to a request's ``kvplug_session`` |
| `prefix_keys` | a node's key: its prefix's, wherever the tree splits it; `VictimEnds` |
| `stats` | `CacheStats` and the Prometheus exporter for SGLang's multiprocess ``/metrics`` |
| `version` | the supported SGLang range, and the private names kvplug checks at start-up |

Its benchmark (``kvplug bench sglang-cache``) is `kvplug.bench.sglang_cache`.
"""
