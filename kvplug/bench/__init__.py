"""Benchmarks: kvplug's code against the engines' own, measured side by side in one run.

| module | owns |
|---|---|
| `core` | the core cache's operations per second (``kvplug bench core``) |
| `vllm_step` | vLLM's scheduler step with kvplug's pool against stock (``kvplug bench step``) |
| `vllm_manager` | vLLM's `KVCacheManager` alone on a trace, full and hybrid (``bench manager``) |
| `told_pool` | vLLM's own `BlockPool` handing out a policy's recorded blocks (``--told``) |
| `block_pool` | vLLM's `BlockPool` calls, µs per call (``kvplug bench block-pool``) |
| `sglang_cache` | SGLang's radix-cache operations, kvplug's policy against SGLang's |
| `cpu_tier` | vLLM's CPU offload tier on a trace, its policies against kvplug's |

Each reports ratios against the stock arm measured in the same run; none is a test.
"""
