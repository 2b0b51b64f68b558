"""Eviction policies by name: the decisions, one small strategy class each.

A policy reads cached blocks through `node.CachedNode` only; the eviction core
(`kvplug.core.eviction`) tells it what happened and asks for the next victim. Every
cache builds its policy with `make_policy(name, params, context)` and reads what the
policy can do from its class (`offline`, `release_order`, `RankedPolicy`).

| module | owns |
|---|---|
| `registry` | `make_policy`, `PolicyContext`, the names (built-in and entry points) |
| `node` | `CachedNode`, the fields a policy may read |
| `base` | `EvictionPolicy` (hooks, capabilities) and `RankedPolicy` (one rank per release) |
| `value` | `BlockValue`: the prefill FLOPs a block saves at its depth |
| `lru`, `lfu`, `gdsf`, `cost`, `learned` | the online policies |
| `shadow` | `ShadowCache`, `ShadowDuel`: `learned`'s shadow caches and referee (compiled) |
| `offline` | ``belady``, ``rate-oracle``, ``returning-oracle``: bounds for trace replays |
"""

from __future__ import annotations

from kvplug.policies.base import EvictionPolicy, RankedPolicy
from kvplug.policies.lru import LRUPolicy
from kvplug.policies.registry import (
    ENTRY_POINT_GROUP,
    PolicyContext,
    available_policies,
    make_policy,
    offline_policies,
    online_policies,
    policy_class,
    policy_parameters,
)

__all__ = [
    "ENTRY_POINT_GROUP",
    "EvictionPolicy",
    "LRUPolicy",
    "PolicyContext",
    "RankedPolicy",
    "available_policies",
    "make_policy",
    "offline_policies",
    "online_policies",
    "policy_class",
    "policy_parameters",
]
