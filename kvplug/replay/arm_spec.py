"""Arm names, parsed once: ``NAME`` into an `ArmSpec` (which cache, which policy).

| name | cache | policy |
|---|---|---|
| ``<policy>`` | kvplug's own (`KVPlugArm`) | any registered kvplug policy, offline ones too |
| ``vllm-stock`` | vLLM's `KVCacheManager` with vLLM's pool | vLLM's |
| ``vllm-kvplug:<policy>`` | the same manager over kvplug's pool | an online kvplug policy |
| ``sglang-stock[:<policy>]`` | SGLang's radix cache | one of SGLang's (default ``lru``) |
| ``sglang-kvplug:<policy>`` | the same cache with kvplug's policy | an online kvplug policy |

The hybrid replay takes the same names, its kvplug policies limited to its own.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from enum import Enum

from kvplug.errors import UnknownPolicyError
from kvplug.policies import available_policies, online_policies


class Cache(Enum):
    """Which cache an arm runs."""

    KVPLUG = "kvplug"
    VLLM_STOCK = "vllm-stock"
    VLLM_KVPLUG = "vllm-kvplug"
    SGLANG_STOCK = "sglang-stock"
    SGLANG_KVPLUG = "sglang-kvplug"

    @property
    def engine(self) -> str | None:
        """The engine this cache runs inside, or None for kvplug's own."""
        return None if self is Cache.KVPLUG else self.value.split("-", 1)[0]

    @property
    def kvplug_policy(self) -> bool:
        """Whether its policy is one of kvplug's."""
        return self in (Cache.KVPLUG, Cache.VLLM_KVPLUG, Cache.SGLANG_KVPLUG)


@dataclass(frozen=True)
class ArmSpec:
    """One arm: its name as given, its cache, and its policy (None: the engine's own)."""

    name: str
    cache: Cache
    policy: str | None

    @property
    def engine(self) -> str | None:
        return self.cache.engine

    @property
    def kvplug_policy(self) -> str | None:
        """The kvplug policy the arm runs, or None for an engine's own policy."""
        return self.policy if self.cache.kvplug_policy else None


ACCEPTED = (
    "kvplug policies, vllm-stock, vllm-kvplug:<kvplug policy>, sglang-stock[:<policy>], "
    "sglang-kvplug:<kvplug policy>"
)


def parse_arm(
    name: str, kvplug_policies: Sequence[str] | None = None, what: str = "arm"
) -> ArmSpec:
    """`name` as an `ArmSpec`; `kvplug_policies` limits the policies kvplug's own cache and
    the engine arms with kvplug inside may run (default: every registered policy, online
    ones inside an engine). Raises `UnknownPolicyError` naming what is accepted."""
    own = list(kvplug_policies) if kvplug_policies is not None else available_policies()
    inside = list(kvplug_policies) if kvplug_policies is not None else online_policies()
    base, colon, policy = name.partition(":")
    if not colon and name in own:
        return ArmSpec(name, Cache.KVPLUG, name)
    try:
        cache = Cache(base)
    except ValueError:
        cache = None
    if cache is Cache.VLLM_STOCK and not colon:
        return ArmSpec(name, cache, None)
    if cache is Cache.SGLANG_STOCK and (policy or not colon):
        return ArmSpec(name, cache, policy or "lru")
    if cache in (Cache.VLLM_KVPLUG, Cache.SGLANG_KVPLUG) and policy in inside:
        return ArmSpec(name, cache, policy)
    raise UnknownPolicyError(
        f"unknown {what} {name!r}; accepted: {', '.join(own)} (kvplug's own cache), "
        f"vllm-stock, vllm-kvplug:<{'|'.join(inside)}>, sglang-stock[:<policy>], "
        f"sglang-kvplug:<{'|'.join(inside)}>"
    )


def parse_arms(
    names: Sequence[str], kvplug_policies: Sequence[str] | None = None, what: str = "arm"
) -> list[ArmSpec]:
    """`parse_arm` for each of `names`."""
    return [parse_arm(name, kvplug_policies, what) for name in names]
