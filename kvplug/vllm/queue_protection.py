"""Waiting-queue protection inside vLLM: the requests waiting in the scheduler's queue
claim the cached blocks they will hit.

Once per scheduler step, before vLLM schedules (`KVPlugSchedulerMixin.schedule`), the
first `depth` requests of vLLM's waiting queue, in the order vLLM will start them, are
looked up with the engine's own lookup (the KV cache coordinator's
``find_longest_cache_hit``, which changes nothing), and every group's hit blocks are
claimed. The rule and its levels are the engine-neutral ones of
`kvplug.core.queue_protection`; the pool's eviction core evicts by (level, policy order),
so the free queue (what vLLM's lazy CPU offload and LMCache read from its head) shows the
protected blocks last.

A step reads a request's hit once, when it enters the first `depth`; while it stays
there, each later step checks that its claimed blocks still hold its hashes (a claim is
cut at the first that does not: evicted, or reused for another hash) and looks up the
one block past its end (another request may have cached it since): one lookup per
request and step, not one per block, where the pool's model has one full-attention group
hashed at its block size (`direct_lookup`; otherwise every step looks each request up
anew).

It needs a pool whose order kvplug keeps (`KVPlugBlockPool.tracked`): with ``lru`` vLLM's
own free queue decides, and the scheduler refuses the setting at start-up
(`refusal_for`). A hybrid model's sliding-window blocks that its rules evict first
(`kvplug.vllm.anchors`) keep that place; the claim protects what the eviction core ranks.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from typing import Any

from kvplug.core.queue_protection import QueueProtection


def refusal_for(depth: int, pool: Any) -> str | None:
    """Why `pool` cannot protect `depth` waiting requests' hits, or None if it can."""
    if depth and not pool.tracked:
        return (
            f"kvplug config: queue_protection.requests = {depth} needs a policy kvplug ranks "
            f"itself (cost, learned, ...), not {pool.policy.name!r}, which keeps vLLM's own "
            "free queue; set queue_protection.requests to 0 or choose another policy"
        )
    return None


def direct_lookup(coordinator: Any) -> bool:
    """Whether a request's hit is its run of cached blocks from the start, block ``i``
    under hash ``i`` of group 0 (one full-attention group hashed at its block size, no
    EAGLE drop, no context parallelism), so that a claim can be checked and extended
    block by block."""
    from vllm.v1.core.kv_cache_coordinator import UnitaryKVCacheCoordinator
    from vllm.v1.core.single_type_kv_cache_manager import FullAttentionManager

    return (
        type(coordinator) is UnitaryKVCacheCoordinator
        and type(coordinator.single_type_managers[0]) is FullAttentionManager
        and coordinator.block_pool.hash_block_size == coordinator.block_size
        and not coordinator.eagle_group_ids
        and getattr(coordinator, "dcp_world_size", 1) == 1
        and getattr(coordinator, "pcp_world_size", 1) == 1
    )


class _Claim:
    """A waiting request's hit blocks and the hashes they held when claimed."""

    __slots__ = ("request", "ids", "keys")

    def __init__(self, request: Any, ids: list[int], keys: list[Any]) -> None:
        self.request = request
        self.ids = ids
        self.keys = keys


class PoolQueueProtection:
    """`QueueProtection` of one vLLM KV cache manager's pool, claims read from requests
    (anything with vLLM's ``request_id``, ``block_hashes`` and ``num_tokens``)."""

    def __init__(self, manager: Any, depth: int) -> None:
        self.pool = manager.block_pool
        self.protection: QueueProtection[int] = QueueProtection(depth, self.pool)
        coordinator = manager.coordinator
        self._find = coordinator.find_longest_cache_hit
        self._direct = direct_lookup(coordinator)
        self._block_size = coordinator.block_size
        self._claims_of: dict[str, _Claim] = {}  # request id -> claim, the last refresh's

    def refresh(self, waiting: Iterable[Any]) -> None:
        """Claim the hits of the first requests of `waiting` (a queue, next first)."""
        if not waiting and not self.protection.live:
            return
        claims: dict[str, _Claim] = {}
        self.protection.refresh(self._claims(waiting, claims))
        self._claims_of = claims

    def _claims(self, waiting: Iterable[Any], claims: dict[str, _Claim]) -> Iterator[list[int]]:
        find = self._find
        for request in waiting:
            hashes = request.block_hashes
            if not hashes:
                yield []
                continue
            if self._direct:
                claim = self._claims_of.get(request.request_id)
                if claim is None or claim.request is not request:
                    claim = self._first_claim(request)
                else:
                    self._update(claim)
                claims[request.request_id] = claim
                yield claim.ids
                continue
            groups = find(hashes, request.num_tokens - 1)[0]
            yield [block.block_id for blocks in groups for block in blocks if not block.is_null]

    def _first_claim(self, request: Any) -> _Claim:
        (blocks,), _, _ = self._find(request.block_hashes, request.num_tokens - 1)
        return _Claim(request, [b.block_id for b in blocks], [b._block_hash for b in blocks])

    def _update(self, claim: _Claim) -> None:
        """Cut `claim` at its first block that no longer holds its hash, then extend it by
        the blocks now cached past its end."""
        blocks, ids, keys = self.pool.blocks, claim.ids, claim.keys
        for at, block_id in enumerate(ids):
            if blocks[block_id]._block_hash != keys[at]:
                del ids[at:], keys[at:]
                break
        request = claim.request
        hashes = request.block_hashes
        limit = min((request.num_tokens - 1) // self._block_size, len(hashes))
        get_cached_block = self.pool.get_cached_block
        while len(ids) < limit:
            cached = get_cached_block(hashes[len(ids)], [0])
            if not cached:
                return
            ids.append(cached[0].block_id)
            keys.append(cached[0]._block_hash)
