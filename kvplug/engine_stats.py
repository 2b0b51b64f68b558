"""What kvplug counts inside an engine: the counters and gauges every adapter exposes.

The vLLM adapter (`kvplug.vllm.stats`) and the SGLang adapter (`kvplug.sglang.stats`)
count into one `PoolStats` and expose each field as the Prometheus metric
``kvplug_<field>``, with the help text in `HELP`; fields in `GAUGES` are gauges, the
rest counters; fields in `TENANT_GAUGES` are gauges with a series per tenant. How they
reach ``/metrics`` is each adapter's own.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any


@dataclass
class PoolStats:
    """Counters since start-up (except the gauges marked so)."""

    requests: int = 0  # finished requests
    prompt_tokens: int = 0
    matched_tokens: int = 0  # prompt tokens served from the prefix cache
    prompt_flops: float = 0.0  # prefill FLOPs of all prompts
    saved_flops: float = 0.0  # prefill FLOPs of the matched prefixes
    block_hits: int = 0  # cached blocks reused by a request
    evictions: int = 0  # cached blocks evicted to make room
    # evicted blocks cached again soon after (within a pool's worth); above 2,048 blocks an
    # estimate from a sample of the keys (`kvplug.core.dense.recent_sampling`)
    churn: int = 0
    retired: int = 0  # evicted as dependents: their junction lost another group's block
    retentions: int = 0  # prompt prefixes kept after their request, as it asked
    retentions_refused: int = 0  # asks not served (a bad value, or a model it cannot serve)
    session_requests: int = 0  # requests that named a session (`kvplug.core.sessions`)
    sessions_refused: int = 0  # session ids not served (a bad value)
    cached_blocks: int = 0  # gauge: blocks with a reusable hash
    bytes_held: int = 0  # gauge: bytes of those blocks
    deferred_blocks: int = 0  # gauge: blocks freed but not yet returned (in-flight writes)
    deferred_age_steps: int = 0  # gauge: scheduler steps the oldest of those has waited
    retained_blocks: int = 0  # gauge: blocks kept by live retentions
    protected_blocks: int = 0  # gauge: cached blocks waiting requests claim (queue protection)
    # gauge by tenant: bytes kept by each tenant's live retentions (`TENANT_GAUGES`)
    retained_bytes: dict[str, int] = field(default_factory=dict)

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


HELP = {
    "requests": "Finished requests seen by kvplug",
    "prompt_tokens": "Prompt tokens of finished requests",
    "matched_tokens": "Prompt tokens served from kvplug's prefix cache",
    "prompt_flops": "Prefill FLOPs of all prompts (model estimate)",
    "saved_flops": "Prefill FLOPs saved by prefix-cache hits (model estimate)",
    "block_hits": "Cached blocks reused by requests",
    "evictions": "Cached blocks evicted by kvplug's policy",
    "churn": "Evicted blocks cached again within a pool's worth of evictions "
    "(estimated from a sample of the keys in pools over 2,048 blocks)",
    "retired": "Hybrid models: blocks evicted because their junction lost another group's block",
    "cached_blocks": "Blocks holding reusable KV state",
    "bytes_held": "Bytes of KV cache holding reusable state",
    "deferred_blocks": "Freed blocks held back until in-flight writes end",
    "deferred_age_steps": "Scheduler steps the oldest deferred release has waited",
    "retentions": "Prompt prefixes kept after their request ended, as it asked (kvplug_retain_s)",
    "retentions_refused": "Retention asks not served (a bad value, or a model it cannot serve)",
    "retained_blocks": "Blocks kept by live retentions",
    "session_requests": "Requests that named a session (kvplug_session or the OpenAI user field)",
    "sessions_refused": "Session ids not served (not a string or integer of 1 to 256 characters)",
    "protected_blocks": "Cached blocks waiting requests will hit, evicted last",
}
# gauges with one series per tenant (``tenant`` label), each a mapping in `PoolStats`;
# not in `HELP`, whose fields are single numbers
TENANT_GAUGES = {"retained_bytes": "Bytes of KV cache kept by live retentions, by tenant"}
GAUGES = {
    "cached_blocks",
    "bytes_held",
    "deferred_blocks",
    "deferred_age_steps",
    "retained_blocks",
    "protected_blocks",
}
