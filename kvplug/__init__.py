"""kvplug: cost-aware KV-cache management for vLLM and SGLang.

The engine-neutral core (keys, pool, index, cache, policies, metrics, config) imports
no engine, no torch and no kernel library. Engine adapters live in their own subpackages
and are imported only when a user turns kvplug on.
"""

__version__ = "0.1.0"
