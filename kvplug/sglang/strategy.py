"""The ``kvplug-<name>`` eviction strategies SGLang looks up by name.

SGLang builds its radix tree's eviction strategy with
``get_eviction_strategy(--radix-eviction-policy, --radix-eviction-policy-config)``: the
name picks a factory, the JSON object is passed to it as keyword arguments. kvplug adds
one factory per registered kvplug policy, ``kvplug-<name>`` (`policy_choices`). Its
keyword arguments are kvplug's config keys (`kvplug.config.KVPlugConfig`), validated as
in vLLM; without them, ``$KVPLUG_CONFIG`` or the defaults apply. The name's policy
wins over a ``policy`` key, which may only repeat it.

A `KVPlugStrategy` does not rank SGLang nodes itself: the kvplug tree core
(`kvplug.sglang.tree_core`) asks it once for a fresh policy (`new_policy`) and keeps the
candidates in kvplug's eviction core (the host tier's too). Its `get_priority` (SGLang's
recency) answers only SGLang code paths that sort nodes by priority themselves; the
kvplug backend refuses the option that reaches them (the session radix cache). A
``kvplug-<name>`` policy without ``--radix-cache-backend kvplug`` is refused when SGLang
builds its own tree core (`strategy_factory`).
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from contextvars import ContextVar
from typing import Any

from sglang.srt.mem_cache.evict_policy import EvictionStrategy

from kvplug.config import WRAPPER_KEY, KVPlugConfig, build_policy
from kvplug.core.model_spec import ModelSpec, load_model
from kvplug.errors import ConfigError
from kvplug.policies import online_policies
from kvplug.policies.base import EvictionPolicy

PREFIX = "kvplug-"
CONFIG_FLAG = "--radix-eviction-policy-config"
_BUILDING: ContextVar[bool] = ContextVar("kvplug_tree_core_building", default=False)


def policy_choices() -> list[str]:
    """``kvplug-<name>`` for every kvplug policy a server can run, third-party ones too."""
    return [PREFIX + name for name in online_policies()]


def policy_name(choice: str) -> str | None:
    """The kvplug policy a ``--radix-eviction-policy`` value names, or None if it names
    none (an SGLang policy)."""
    choice = choice.lower()
    return choice[len(PREFIX) :] if choice.startswith(PREFIX) else None


def load_config(policy: str | None, given: Mapping[str, Any] | None) -> KVPlugConfig:
    """kvplug's config from ``--radix-eviction-policy-config`` (`given`, kvplug's keys,
    optionally under ``"kvplug"``), else ``$KVPLUG_CONFIG``, else the defaults; with
    `policy` (from ``kvplug-<name>``, None: the config's own) as the policy."""
    if given is None:
        return KVPlugConfig.load(None).with_policy(policy)
    data = dict(given)
    if len(data) == 1 and WRAPPER_KEY in data and isinstance(data[WRAPPER_KEY], Mapping):
        data = dict(data[WRAPPER_KEY])
    if policy is not None:
        if data.get("policy", policy) != policy:
            raise ConfigError(
                f"kvplug config: 'policy' = {data['policy']!r} contradicts "
                f"--radix-eviction-policy {PREFIX}{policy} (from {CONFIG_FLAG}); drop the "
                "key or make them agree"
            )
        data["policy"] = policy
    try:
        return KVPlugConfig.load(data)
    except ConfigError as exc:
        raise ConfigError(f"{exc} (from {CONFIG_FLAG})") from exc


class KVPlugStrategy(EvictionStrategy):
    """SGLang's eviction-strategy slot, filled by a kvplug policy (see the module doc).

    `config` and `model` are set by kvplug's backend, which validated them already; any
    other keyword is one of kvplug's config keys, as given on SGLang's command line.
    """

    def __init__(
        self,
        policy: str | None = None,
        *,
        kvplug_config: KVPlugConfig | None = None,
        kvplug_model: ModelSpec | None = None,
        **config_keys: Any,
    ) -> None:
        if kvplug_config is None:
            kvplug_config = load_config(policy, config_keys or None)
        self.config = kvplug_config
        self.model = kvplug_model if kvplug_model is not None else load_model(None)
        build_policy(self.config, self.model)  # a server-only refusal surfaces here

    def new_policy(self, page_size: int, num_pages: int) -> EvictionPolicy:
        """A fresh policy for a tree of `num_pages` pages of `page_size` tokens."""
        policy = build_policy(self.config, self.model)
        policy.bind(page_size, num_pages)
        return policy

    def get_priority(self, node: Any) -> float:
        return float(node.last_access_time)


@contextmanager
def kvplug_tree_core_building() -> Iterator[None]:
    """Marks the construction of a kvplug tree core: only inside it is a ``kvplug-<name>``
    strategy built (`strategy_factory`)."""
    token = _BUILDING.set(True)
    try:
        yield
    finally:
        _BUILDING.reset(token)


def strategy_factory(policy: str) -> Any:
    """The factory SGLang calls for ``kvplug-<policy>``. Only kvplug's tree core ranks with
    it; SGLang's own tree cores would rank it as recency (the Python core) or die on the
    name (the Rust core), so outside a kvplug tree core it is refused, naming the flag."""

    def factory(**config_keys: Any) -> KVPlugStrategy:
        if not _BUILDING.get():
            raise ConfigError(
                f"--radix-eviction-policy {PREFIX}{policy} is kvplug's policy, served only "
                "by kvplug's radix cache: add --radix-cache-backend kvplug (SGLang's own "
                "tree cores cannot rank with it)"
            )
        return KVPlugStrategy(policy, **config_keys)

    factory.__name__ = f"kvplug_{policy}_strategy"
    return factory
