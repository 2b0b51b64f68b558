"""vLLM's CPU offload tier on a trace: kvplug's policy against vLLM's own (lru, arc).

`CPUTier` is vLLM's `CPUOffloadingManager` (the scheduler side of ``OffloadingConnector``'s
CPU tier) with the cache policy vLLM builds by name, driven as its connector drives it:
per request, the leading chunks the tier holds are looked up and loaded, the rest are
offered for store, the copies are reported complete (no worker runs here) and the
request ends. `compare` replays a trace's prompts through one tier per policy and size,
sequentially, and reports the prefill compute the loads save, relative to vLLM's lru in
the same run. The tier stands alone here (every prompt's chunks are offered to it), so
the figures measure the tier's own decisions, not a GPU cache in front of it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from kvplug.core.model_spec import ModelSpec, load_model
from kvplug.replay.trace import Trace, count_blocks

VLLM_POLICIES = ("lru", "arc")  # vLLM's own CPU-tier policies
KVPLUG_POLICIES = ("kvplug-cost", "kvplug-lfu")


class CPUTier:
    """vLLM's CPU manager with cache policy `policy` (vLLM's name, ``kvplug`` or
    ``kvplug-<name>``) over `chunks` chunks of `chunk_tokens` tokens."""

    def __init__(self, chunks: int, policy: str, chunk_tokens: int = 16) -> None:
        from vllm.v1.kv_offload.cpu.manager import CPUOffloadingManager

        from kvplug.vllm.offload_policy import register

        register()  # what kvplug's vLLM entry point does in every vLLM process
        self.manager = CPUOffloadingManager(num_chunks=chunks, cache_policy=policy)
        self.chunk_tokens = chunk_tokens
        self.requests = 0

    @property
    def policy(self) -> Any:
        return self.manager._policy

    def request(self, keys: list[Any]) -> tuple[int, list[Any] | None]:
        """One request over the chunks `keys` (vLLM's offload keys, head first): (chunks
        loaded, keys evicted by its store; None: the store could not make room)."""
        from vllm.v1.kv_offload.base import LookupResult, ReqContext

        self.requests += 1
        context = ReqContext(req_id=f"r{self.requests}")
        for index, key in enumerate(keys):
            context.set_offload_key_position(key, (index + 1) * self.chunk_tokens)
        manager = self.manager
        manager.on_new_request(context)
        hits = 0
        while hits < len(keys) and manager.lookup(keys[hits], context) == LookupResult.HIT:
            hits += 1
        if hits:
            manager.prepare_load(keys[:hits], context)
            manager.complete_load(keys[:hits], context)
        stored = manager.prepare_store(keys, context)
        if stored is not None:
            manager.complete_store(stored.keys_to_store, context)
        manager.on_request_finished(context)
        return hits, None if stored is None else list(stored.evicted_keys)


def offload_key(unit: int) -> Any:
    """vLLM's offload key for chunk `unit` of KV cache group 0."""
    from vllm.v1.kv_offload.base import make_offload_key

    return make_offload_key(unit.to_bytes(8, "big"), 0)


@dataclass(frozen=True)
class TierResult:
    policy: str
    chunks: int
    saved_fraction: float  # prefill FLOPs the loads saved / all prompts' prefill FLOPs
    loaded_chunks: int


def trace_chunks(trace: Trace) -> list[tuple[list[Any], int]]:
    """Each request's full-block chunks as offload keys (a chunk is its block id with
    every id before it) and its prompt length."""
    nodes: dict[tuple[int, int], int] = {}
    requests = []
    for request in trace.requests:
        full = count_blocks(request.input_length, trace.block_tokens).full
        parent, keys = -1, []
        for block_id in request.hash_ids[:full]:
            parent = nodes.setdefault((parent, block_id), len(nodes))
            keys.append(offload_key(parent))
        requests.append((keys, request.input_length))
    return requests


def compare(
    trace: Trace,
    capacities: list[int],
    policies: tuple[str, ...] = VLLM_POLICIES + KVPLUG_POLICIES,
    model: ModelSpec | None = None,
) -> list[TierResult]:
    """Replay `trace` through one tier per policy and capacity (in chunks)."""
    model = model or load_model(None)
    requests = trace_chunks(trace)
    total = sum(model.prefill_flops(0, tokens) for _, tokens in requests)
    results = []
    for chunks in capacities:
        for policy in policies:
            tier = CPUTier(chunks, policy, trace.block_tokens)
            saved, loaded = 0.0, 0
            for keys, tokens in requests:
                hits, _ = tier.request(keys)
                loaded += hits
                saved += model.prefill_flops(0, min(hits * trace.block_tokens, tokens))
            results.append(TierResult(policy, chunks, saved / total, loaded))
    return results


def format_results(results: list[TierResult]) -> str:
    """One row per capacity: each policy's saved fraction, and its ratio to vLLM's lru."""
    policies = list(dict.fromkeys(result.policy for result in results))
    rows = ["| chunks | " + " | ".join(policies) + " |", "|---:|" + "---:|" * len(policies)]
    for chunks in dict.fromkeys(result.chunks for result in results):
        cells = {r.policy: r for r in results if r.chunks == chunks}
        base = cells["lru"].saved_fraction if "lru" in cells else None
        row = []
        for policy in policies:
            fraction = cells[policy].saved_fraction
            ratio = f" ({fraction / base:.2f}x)" if base and policy != "lru" else ""
            row.append(f"{fraction:.3f}{ratio}")
        rows.append(f"| {chunks:,} | " + " | ".join(row) + " |")
    return "\n".join(rows)
