"""The ``vllm-*`` arms beside a CPU tier run the way vLLM runs its lazy CPU offload.

`VLLMOffloadArm` is a `VLLMStockArm` (stock vLLM, or vLLM with kvplug's pool) plus a CPU
tier of `host_blocks` blocks, driven as vLLM 0.34's `SimpleCPUOffloadScheduler` drives it
with ``lazy_offload``:

- after every step, the offloader walks the GPU free queue from its head
  (``iter_blocks_after(None)``), covering up to `target_free` blocks, and copies out each
  cached one the CPU tier lacks; the copy is taken as done at once: the GPU blocks are
  touched, the CPU tier stores their hashes (least recently used out first, as vLLM's CPU
  block pool), and the GPU blocks are given back with ``free_blocks(..., evict_first=True)``
  (on 0.32 and 0.33, whose pool lacks the argument, the same calls it makes);
- a request's prefix that the GPU misses but the CPU tier continues is loaded: those
  units reach `allocate_slots` as ``num_external_computed_tokens``, as a connector's hit
  does, and count as saved compute less their reload (`kvplug.policies.reload.HostLink`).

The walk is what the offloader sees, so with kvplug's pool it copies out kvplug's next
victims, and the policy's tier pricing sees the blocks it gives back.
"""

from __future__ import annotations

from collections import OrderedDict
from typing import Any

from kvplug.policies.base import EvictionPolicy
from kvplug.replay.arms.vllm import VLLMStockArm


def free_to_evict_first(pool: Any, blocks: list[Any]) -> None:
    """vLLM 0.34's ``free_blocks(blocks, evict_first=True)``, or on a release without the
    argument the same calls: the blocks' holds dropped, the free ones to the queue's head."""
    try:
        pool.free_blocks(blocks, evict_first=True)
    except TypeError:
        for block in blocks:
            block.ref_cnt -= 1
        pool.free_block_queue.prepend_n([b for b in blocks if b.ref_cnt == 0])


class VLLMOffloadArm(VLLMStockArm):
    """A vLLM arm with a lazily filled CPU tier of `host_blocks` blocks (module doc)."""

    connector = True

    def __init__(
        self,
        capacity_blocks: int,
        host_blocks: int,
        reload_flops: float,
        policy: EvictionPolicy | None = None,
        target_free: int | None = None,
    ) -> None:
        super().__init__(capacity_blocks, policy)
        if host_blocks < 1:
            raise ValueError(f"host_blocks must be >= 1, got {host_blocks}")
        self.name += "+cpu"
        self.host_blocks = host_blocks
        self.reload_flops = reload_flops
        # vLLM sizes its lazy target from the step's token budget; a tenth of the cache
        self.target_free = max(1, capacity_blocks // 10) if target_free is None else target_free
        self._host: OrderedDict[Any, None] = OrderedDict()  # block hash -> None, LRU first
        self.loaded = 0  # units of the last admitted request loaded from the CPU tier

    def admit(self, req_id: int, prompt: list[int], compute: int) -> int | None:
        from vllm.v1.request import Request, RequestStatus

        if req_id in self._requests:
            raise ValueError(f"request {req_id} is already running")
        request = Request(
            str(req_id), list(prompt), self._sampling_params, None, block_hasher=self._block_hasher
        )
        hit_blocks, num_hits, _ = self.manager.get_computed_blocks(request)
        host, hashes = self._host, request.block_hashes
        loaded = 0
        # the last unit is always computed, so a load never covers all of `compute`
        while num_hits + loaded < compute - 1 and hashes[num_hits + loaded] in host:
            loaded += 1
        num_new = max(compute - num_hits - loaded, 0)
        if num_new or num_hits or loaded:
            allocated = self.manager.allocate_slots(
                request,
                num_new,
                num_new_computed_tokens=num_hits,
                new_computed_blocks=hit_blocks,
                num_external_computed_tokens=loaded,
                full_sequence_must_fit=False,
            )
            if allocated is None:
                return None
        for key in hashes[num_hits : num_hits + loaded]:
            host.move_to_end(key)
        self.loaded = loaded
        request.status = RequestStatus.RUNNING
        request.num_computed_tokens = num_hits + loaded + num_new
        self._requests[req_id] = request
        self._record_hits(hit_blocks)
        self._drain_events()
        self._offload()
        return num_hits

    def grow(self, req_id: int, units: list[int]) -> bool:
        grown = super().grow(req_id, units)
        self._offload()
        return grown

    def finish(self, req_id: int, output_tokens: int = 0) -> None:
        super().finish(req_id, output_tokens)
        self._offload()

    def _offload(self) -> None:
        """One step of the lazy offloader (`SimpleCPUOffloadScheduler._prepare_lazy_store_specs`
        and its store completion)."""
        from vllm.v1.core.kv_cache_utils import get_block_hash

        pool = self.manager.block_pool
        host = self._host
        copied = []
        for covered, block in enumerate(pool.free_block_queue.iter_blocks_after(None)):
            if covered >= self.target_free:
                break
            if block.block_hash is None or block.is_null:
                continue
            key = get_block_hash(block.block_hash)
            if key not in host:
                copied.append((key, block))
        if not copied:
            return
        blocks = [block for _, block in copied]
        pool.touch(blocks)
        for key, _ in copied:
            host[key] = None
            if len(host) > self.host_blocks:
                host.popitem(last=False)
        free_to_evict_first(pool, blocks)
