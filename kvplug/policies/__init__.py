"""Eviction policies by name: the decisions, one small strategy class each.

Policies shipped with kvplug and those other packages declare under the entry-point
group ``kvplug.policies`` (``name = "package.module:PolicyClass"``) are found by name.
A policy reads cached blocks through `node.CachedNode` only; the eviction core
(`kvplug.core.eviction`) tells it what happened and asks for the next victim.

| module | owns |
|---|---|
| `node` | `CachedNode`, the fields a policy may read |
| `base` | `EvictionPolicy` and `RankedPolicy` (one rank per release, a lazy heap) |
| `value` | `BlockValue`: the prefill FLOPs a block saves at its depth |
| `lru`, `lfu`, `gdsf`, `cost`, `learned` | the online policies |
| `belady`, `rate_oracle` | offline bounds for trace replays (they need the future) |
"""

from __future__ import annotations

from importlib.metadata import entry_points
from typing import Any

from kvplug.errors import UnknownPolicyError
from kvplug.policies.base import EvictionPolicy
from kvplug.policies.belady import BeladyPolicy
from kvplug.policies.cost import CostPolicy
from kvplug.policies.gdsf import GDSFPolicy
from kvplug.policies.learned import LearnedPolicy
from kvplug.policies.lfu import LFUPolicy
from kvplug.policies.lru import LRUPolicy
from kvplug.policies.rate_oracle import RateOraclePolicy, ReturningOraclePolicy

ENTRY_POINT_GROUP = "kvplug.policies"

_BUILTIN: dict[str, type[EvictionPolicy]] = {
    cls.name: cls
    for cls in (
        LRUPolicy,
        LFUPolicy,
        GDSFPolicy,
        CostPolicy,
        LearnedPolicy,
        BeladyPolicy,
        RateOraclePolicy,
        ReturningOraclePolicy,
    )
}
# Policies that need every request in advance: trace replays only, never an engine.
OFFLINE_POLICIES = ("belady", "rate-oracle", "returning-oracle")


def _registry() -> dict[str, type[EvictionPolicy]]:
    found: dict[str, Any] = {ep.name: ep for ep in entry_points(group=ENTRY_POINT_GROUP)}
    registry: dict[str, Any] = dict(found)
    registry.update(_BUILTIN)  # an outside package cannot shadow a built-in name
    return registry


def available_policies() -> list[str]:
    """Names of every policy that `make_policy` accepts, sorted."""
    return sorted(_registry())


def policy_class(name: str) -> type[EvictionPolicy]:
    """The class registered under `name`."""
    registry = _registry()
    if name not in registry:
        raise UnknownPolicyError(
            f"unknown eviction policy {name!r}; known policies: {', '.join(sorted(registry))}"
        )
    target = registry[name]
    cls = target if isinstance(target, type) else target.load()
    if not (isinstance(cls, type) and issubclass(cls, EvictionPolicy)):
        raise UnknownPolicyError(
            f"entry point {name!r} in group {ENTRY_POINT_GROUP!r} is not an EvictionPolicy"
        )
    return cls


def make_policy(name: str, **params: Any) -> EvictionPolicy:
    """Build the policy registered under `name` with `params` as keyword arguments."""
    cls = policy_class(name)
    try:
        return cls(**params)
    except TypeError as exc:
        raise UnknownPolicyError(
            f"policy {name!r} rejected its parameters {params}: {exc}"
        ) from exc


__all__ = [
    "OFFLINE_POLICIES",
    "EvictionPolicy",
    "LRUPolicy",
    "available_policies",
    "make_policy",
    "policy_class",
]
