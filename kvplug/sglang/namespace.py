"""kvplug's namespace on SGLang's prefix keys.

SGLang keys each cached prefix by its tokens plus the request's ``extra_key`` (which
carries the LoRA adapter) and ``cache_salt``. kvplug adds the rest of its namespace
(model, revision, tokenizer and a tenant) by folding it into the request's
``cache_salt``, once, when the cache first matches the request
(`KVPlugRadixCache.match_prefix`), so no cached state crosses a tenant or a revision.

A request names its tenant in its sampling parameters' custom parameters, the way
SGLang requests carry custom parameters::

    {"text": "...", "sampling_params": {"custom_params": {"kvplug_tenant": "acme"}}}

(offline: ``engine.generate(prompt, {"custom_params": {"kvplug_tenant": "acme"}})``).
Without one, the config's ``namespace.tenant`` applies; ``namespace.share_across_tenants:
true`` ignores tenants. Within one server the model and tokenizer never change, so a
request of the default tenant keeps SGLang's key, in its KV events too (a router that
recomputes the keys from the prompt then finds them), unless ``namespace.salt_kv_events``
is set and KV events are on, as in the vLLM adapter.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from kvplug.config import KVPlugConfig
from kvplug.core.keys import namespace_salt

TENANT_PARAM = "kvplug_tenant"
SEEN = "kvplug_seen"  # set on a request once the cache has matched it


def first_sight(req: Any) -> bool:
    """True the first time the cache matches `req` (and marks it), False after."""
    if getattr(req, SEEN, False):
        return False
    setattr(req, SEEN, True)
    return True


@dataclass(frozen=True)
class RequestNamespace:
    """The engine's part of the namespace (fixed order) and how tenants are keyed."""

    engine_parts: tuple[str, ...]
    default_tenant: str
    share_across_tenants: bool
    exported: bool  # KV events on and ``namespace.salt_kv_events``: always salt

    @classmethod
    def for_server(cls, config: KVPlugConfig, server_args: Any, params: Any) -> RequestNamespace:
        def arg(name: str) -> str:
            return str(getattr(server_args, name, None) or "")

        parts = (
            arg("model_path"),
            config.namespace.model_revision or arg("revision"),
            arg("tokenizer_path"),
            arg("tokenizer_revision"),
            arg("dtype"),
        )
        return cls(
            parts,
            config.namespace.tenant,
            config.namespace.share_across_tenants,
            config.namespace.salt_kv_events
            and bool(getattr(params, "enable_kv_cache_events", False)),
        )

    def tenant(self, req: Any) -> str:
        """The tenant `req` names, or the default one."""
        if self.share_across_tenants:
            return self.default_tenant
        custom = getattr(req.sampling_params, "custom_params", None) or {}
        return str(custom.get(TENANT_PARAM, self.default_tenant))

    def apply(self, req: Any) -> bool:
        """Fold the namespace into ``req.cache_salt`` (once per request, at its
        `first_sight`); True if the salt changed, so keys built before must be rebuilt."""
        tenant = self.tenant(req)
        if tenant == self.default_tenant and not self.exported:
            return False
        req.cache_salt = namespace_salt([*self.engine_parts, tenant, req.cache_salt or ""])
        return True
