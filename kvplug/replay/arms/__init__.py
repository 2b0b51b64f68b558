"""The caches a replay compares, behind one interface (`base.CacheArm`), one module per
engine; each engine module imports its engine only when an arm is built.

| module | owns |
|---|---|
| `base` | `CacheArm`, `ArmStats`, `ArmUnavailable`, `require_engine`, `KVPlugArm` |
| `vllm` | ``vllm-stock`` and ``vllm-kvplug:<policy>``: vLLM's own `KVCacheManager` |
| `vllm_hybrid` | vLLM's hybrid coordinator (and kvplug's pool) as a hybrid arm |
| `sglang` | ``sglang-stock:<policy>``: SGLang's own radix cache |
| `sglang_kvplug` | ``sglang-kvplug:<policy>``: the same cache with kvplug's policy |
| `sglang_hybrid` | SGLang's unified radix cache with SWA / Mamba components |
"""
