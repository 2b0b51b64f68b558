"""The one road from a policy name to a policy: `make_policy(name, params, context)`.

Policies shipped with kvplug and those other packages declare under the entry-point group
``kvplug.policies`` (``name = "package.module:PolicyClass"``) are found by name; an outside
package cannot shadow a built-in name. Every cache that runs a policy (`KVCache`, the
hybrid cache, the engine adapters, the replay's arms, the configuration) builds it here,
and reads what it can do from the class's declared capabilities (`EvictionPolicy.offline`,
`EvictionPolicy.release_order`, `RankedPolicy`), never from its name.
"""

from __future__ import annotations

import inspect
from collections.abc import Mapping
from dataclasses import dataclass, field
from importlib.metadata import entry_points
from typing import TYPE_CHECKING, Any

from kvplug.errors import UnknownPolicyError
from kvplug.policies.base import EvictionPolicy
from kvplug.policies.cost import CostPolicy
from kvplug.policies.gdsf import GDSFPolicy
from kvplug.policies.learned import LearnedPolicy
from kvplug.policies.lfu import LFUPolicy
from kvplug.policies.lru import LRUPolicy
from kvplug.policies.offline.belady import BeladyPolicy
from kvplug.policies.offline.rate_oracle import RateOraclePolicy, ReturningOraclePolicy

if TYPE_CHECKING:
    from kvplug.core.model_spec import ModelSpec

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

# Constructor parameters a cache fills in from its `PolicyContext` unless `params` set them.
CONTEXT_PARAMETERS = ("model", "tokens_per_block")


@dataclass(frozen=True)
class PolicyContext:
    """What the cache that will run a policy knows about itself.

    `model`: the served model (a preset name or `ModelSpec`), for policies that value a
    block by the prefill compute it saves. `tokens_per_block`: the tokens one cache block
    stands for (a trace block in the replay). `serving`: a live engine, where a policy
    that needs the future (`EvictionPolicy.offline`) is refused. `variants`: a subclass to
    build instead of the registered class, per name (the hybrid cache runs ``cost`` as its
    junction-aware subclass); a variant must subclass the class it replaces.
    """

    model: str | ModelSpec | None = None
    tokens_per_block: int | None = None
    serving: bool = False
    variants: Mapping[str, type[EvictionPolicy]] = field(default_factory=dict)


def _registry() -> dict[str, Any]:
    registry: dict[str, Any] = {ep.name: ep for ep in entry_points(group=ENTRY_POINT_GROUP)}
    registry.update(_BUILTIN)
    return registry


def available_policies() -> list[str]:
    """Names of every policy that `make_policy` knows, sorted."""
    return sorted(_registry())


def policy_class(name: str) -> type[EvictionPolicy]:
    """The class registered under `name`."""
    if name in _BUILTIN:  # (no scan of installed packages: a built-in is never shadowed)
        return _BUILTIN[name]
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


def offline_policies() -> list[str]:
    """Names of the policies that need every request in advance (trace replays only)."""
    return [name for name in available_policies() if policy_class(name).offline]


def online_policies() -> list[str]:
    """Names of the policies a serving engine can run."""
    return [name for name in available_policies() if not policy_class(name).offline]


def policy_parameters(name: str) -> list[str] | None:
    """The keyword parameters policy `name`'s constructor takes, sorted, or None when it
    takes any (``**kwargs``)."""
    params = inspect.signature(policy_class(name)).parameters.values()
    if any(p.kind is p.VAR_KEYWORD for p in params):
        return None
    return sorted(p.name for p in params if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY))


def make_policy(
    name: str,
    params: Mapping[str, Any] | None = None,
    context: PolicyContext | None = None,
) -> EvictionPolicy:
    """A fresh policy `name`, built with `params` and what `context` knows.

    Raises `UnknownPolicyError` naming what is accepted for an unknown name, a parameter
    the constructor does not take, or an offline policy in a serving context.
    """
    context = context or PolicyContext()
    cls = policy_class(name)
    if cls.offline and context.serving:
        raise UnknownPolicyError(
            f"policy {name!r} cannot run in a server: it needs every request in advance "
            f"(use it in kvplug replay); accepted here: {', '.join(online_policies())}"
        )
    variant = context.variants.get(name)
    if variant is not None:
        if not issubclass(variant, cls):
            raise TypeError(f"variant {variant.__name__} of {name!r} must subclass {cls.__name__}")
        cls = variant
    accepted = policy_parameters(name)
    given = dict(params or {})
    if accepted is not None:
        unknown = sorted(set(given) - set(accepted))
        if unknown:
            listing = ", ".join(p for p in accepted if p not in CONTEXT_PARAMETERS) or "none"
            raise UnknownPolicyError(
                f"policy {name!r} takes no parameter {', '.join(map(repr, unknown))} "
                f"(accepted: {listing})"
            )
    for key in CONTEXT_PARAMETERS:
        value = getattr(context, key)
        if value is not None and key not in given and (accepted is None or key in accepted):
            given[key] = value
    try:
        return cls(**given)
    except (TypeError, ValueError) as exc:
        raise UnknownPolicyError(f"policy {name!r} rejected its parameters {given}: {exc}") from exc
