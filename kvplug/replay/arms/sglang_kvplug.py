"""The `sglang-kvplug:<policy>` arm: SGLang's real radix cache with kvplug's policy.

It is the `sglang-stock` arm (`kvplug.replay.arms.sglang`: SGLang 0.5.23's
`UnifiedRadixCache`, driven the way SGLang's scheduler drives it) with one difference:
the cache is built as ``--radix-cache-backend kvplug`` builds it, through
`kvplug.sglang.backend.build_cache` (kvplug's tree core, on SGLang's Rust core or its
Python core as ``$KVPLUG_SGLANG_TREE_CORE`` or `tree_core` asks, the policy from kvplug's
registry). Both cores make the same decisions. With ``lru`` it evicts exactly as
``sglang-stock:lru``.
"""

from __future__ import annotations

from typing import Any

from kvplug.config import KVPlugConfig
from kvplug.core.sessions import SESSION_ARG
from kvplug.policies import policy_class
from kvplug.replay.arms.sglang import SGLangStockArm


class SGLangKVPlugArm(SGLangStockArm):
    """SGLang's `UnifiedRadixCache` with ``capacity_blocks`` slots, evicting by kvplug's
    policy `policy` with `policy_config` (see the module doc)."""

    arm_prefix = "sglang-kvplug"

    def __init__(
        self,
        capacity_blocks: int,
        policy: str = "cost",
        *,
        policy_config: dict[str, Any] | None = None,
        tree_core: str | None = None,
        queue_depth: int = 0,
        **kwargs: Any,
    ) -> None:
        """`queue_depth`: the cache's ``queue_protection.requests`` (it protects what the
        requests matched while waiting will hit, `kvplug.sglang.queue_protection`)."""
        self.policy_config = dict(policy_config or {})
        self.queue_depth = queue_depth
        super().__init__(capacity_blocks, policy, tree_core=tree_core, **kwargs)

    def _check_policy(self, policy: str) -> None:
        policy_class(policy)  # raises UnknownPolicyError listing kvplug's policies

    def _build_cache(self, params: Any, policy: str) -> Any:
        from kvplug.sglang.backend import build_cache

        config = KVPlugConfig.load(
            {
                "policy": policy,
                "policy_config": self.policy_config,
                "queue_protection": {"requests": self.queue_depth},
            }
        )
        cache = build_cache(params, config, tree_core=self.tree_core)
        self.now = 0.0
        cache.kvplug_retention.clock = lambda: self.now  # the replay's clock
        return cache

    def advance(self, now: float) -> None:
        self.now = now

    def retain(self, req_id: int, seconds: float) -> bool:
        """The request asks, as a server's request does (``custom_params``); its path is
        kept when it finishes, as far as its tenant's cap allows."""
        from kvplug.sglang.retention import RETAIN_PARAM

        params = self.requests[req_id].sampling_params
        params.custom_params = {**(params.custom_params or {}), RETAIN_PARAM: seconds}
        return True

    def name_session(self, req_id: int) -> None:
        """The request names a session, as a server's request does (``custom_params``)."""
        params = self.requests[req_id].sampling_params
        params.custom_params = {**(params.custom_params or {}), SESSION_ARG: f"replay-{req_id}"}


__all__ = ["SGLangKVPlugArm"]
