"""The `sglang-stock:<policy>` arm: SGLang's own radix cache, driven the way its scheduler does.

What runs is the installed SGLang 0.5.23's code, not a model of it:

- `sglang.srt.mem_cache.unified_radix_cache.UnifiedRadixCache`, the tree cache SGLang's
  scheduler builds for a plain full-attention model (`default_radix_cache_factory`), with
  one `FULL` component, ``page_size=1``, KV cache events on, and its pure-Python tree core
  (``tree_core_backend="python"``, `UnifiedTreeCore`), or, with ``tree_core="rust"``, its
  default Rust core (`RustUnifiedTreeCore`; the same decisions, made faster). The
  eviction strategy is SGLang's own, looked up by name in
  `sglang.srt.mem_cache.evict_policy` via `get_eviction_strategy`. (The legacy
  `radix_cache.RadixCache` is no longer what the scheduler builds.)
- `TokenToKVPoolAllocator` with ``capacity_blocks`` slots, and `ReqToTokenPool`, the
  request-to-slot table the cache reads and rewrites.
- Requests are `sglang.srt.managers.schedule_batch.Req` objects. The calls that need
  SGLang's process configuration run inside a runtime context built from
  ``ServerArgs(model_path="dummy", device="cpu")`` (SGLang's own dummy-model path; the
  model config is irrelevant to caching), activated per call with `use_context`.

One unit is one token and one slot; unit ids are the token ids.

How each arm call maps to what SGLang's scheduler does:

- `admit`: `Req.init_next_round_input(tree_cache)`, which runs `match_kv_cache` and so
  `match_prefix` on the prompt *without its last token* (SGLang never matches the whole
  input: the last token is always computed). The matched node is locked
  (`tree_cache.lock`, i.e. `inc_lock_ref`), as `PrefillAdder` does while it checks the
  budget. If the uncached units cannot be had from free plus evictable slots, or no
  request row is free, the lock is released and None is returned: no size, slot or lock
  has changed, though, as in SGLang's own failed attempt, the match has refreshed the
  prefix's recency (and may have split a node where it ended). Otherwise
  `alloc_req_slots` takes a request row and `alloc_token_slots` takes the slots, evicting
  through the allocator's `evict_to_free_tokens` -> `tree_cache.evict_for_alloc` when the
  pool is short, and the row is written as `alloc_for_extend` writes it.
- `grow`: decode. `alloc_token_slots` for the new units (evicting the same way), written at
  the end of the request's row; the units are appended to ``req.output_ids``. False, with
  nothing changed, if free plus evictable slots are too few (the scheduler would retract).
- `finish`: the request finishes by length (``finished_reason = FINISH_LENGTH``), then
  `release_kv_cache(req, tree_cache, checkpoint=True)`, the scheduler's own release: the
  tree inserts ``origin_input_ids + output_ids`` up to the slots the request holds,
  frees the duplicate slots, moves and drops the lock, and frees the row. What is
  inserted is what the request holds; `output_tokens` only tells a kvplug cache how many
  tokens the request generated (``req.kvplug_output_tokens``: a unit is a trace block,
  so ``output_ids`` undercounts them), as kvplug's own cache is told. SGLang's own
  policies do not read it.
- `stats`: from SGLang's KV cache events. ``evictions`` counts `BlockRemoved` units;
  ``churn`` counts removed units that no successful `admit` matched since their
  `BlockStored` (the events' parent-linked hash chains identify the matched units).
  ``cached_blocks`` is the tree's size, ``evictable_size() + protected_size()``.

The admission check is the capacity SGLang's allocation can reach (free slots plus
evictable tree slots once the prefix is locked), not the scheduler's `PrefillBudget`
gate, which also reserves room for the request's future decode tokens (unknown here) and
for running requests. SGLang evicts whole tree nodes, so one eviction can free more units
than it needed. Rows of the request table are limited to ``max_running_requests``, like
SGLang's own setting.
"""

from __future__ import annotations

from array import array
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from functools import cache
from typing import TYPE_CHECKING, Any

from kvplug.errors import UnknownPolicyError
from kvplug.replay.arms.base import ArmStats, ArmUnavailable, CacheArm, require_engine

if TYPE_CHECKING:
    from sglang.srt.managers.schedule_batch import Req

SUPPORTED_SGLANG_VERSION = "0.5.23"
DEFAULT_MAX_RUNNING_REQUESTS = 1024


def check_sglang(arm: str) -> None:
    """Raise `ArmUnavailable` unless the SGLang release the arms support is importable."""
    require_engine(
        "sglang", "SGLang", SUPPORTED_SGLANG_VERSION, arm, "requirements/sglang-replay.txt"
    )


def _check_native_hash() -> None:
    """Raise `ArmUnavailable` unless SGLang's KV-event hash extension loads.

    SGLang JIT-compiles it (C++, with OpenSSL) at first use; without it, every insert into
    a tree with KV events on would fail mid-replay.
    """
    from sglang.srt.mem_cache.cpp_utils.native_hash import get_native_hash

    try:
        get_native_hash(array("q", [0]), None, 1)
    except RuntimeError as exc:
        raise ArmUnavailable(
            "the sglang-stock arm needs SGLang's native hash extension for its KV events, "
            f"which could not be built here ({exc.__cause__ or exc}); it needs g++, ninja "
            "and the OpenSSL headers"
        ) from exc


def sglang_policies() -> list[str]:
    """The eviction policy names SGLang's radix cache accepts: the registry that
    `get_eviction_strategy` looks names up in (lru, lfu, fifo, mru, filo, priority, slru,
    tlru in 0.5.23), less the ``kvplug-`` names kvplug's entry point adds (those need
    kvplug's radix cache: the sglang-kvplug arm)."""
    from sglang.srt.mem_cache.utils import _EVICTION_POLICY_FACTORIES

    return [name for name in _EVICTION_POLICY_FACTORIES if not name.startswith("kvplug-")]


@cache
def _scheduler_context() -> Any:
    """SGLang's runtime configuration for a CPU scheduler, built once per process."""
    from sglang.srt.runtime_context import create_context
    from sglang.srt.server_args import ServerArgs

    return create_context(ServerArgs(model_path="dummy", device="cpu"), role="scheduler")


class SGLangStockArm(CacheArm):
    """SGLang's `UnifiedRadixCache` with ``capacity_blocks`` slots and SGLang's eviction
    strategy `policy`, on SGLang's Python tree core or (`tree_core` ``rust``) its Rust
    core."""

    def __init__(
        self,
        capacity_blocks: int,
        policy: str = "lru",
        *,
        max_running_requests: int = DEFAULT_MAX_RUNNING_REQUESTS,
        tree_core: str | None = None,
    ) -> None:
        self.tree_core = tree_core
        check_sglang(self.arm_prefix)
        self._check_policy(policy)
        if capacity_blocks < 1:
            raise ValueError(f"capacity_blocks must be >= 1, got {capacity_blocks}")
        if max_running_requests < 1:
            raise ValueError(f"max_running_requests must be >= 1, got {max_running_requests}")
        import torch
        from sglang.srt.mem_cache.allocator import TokenToKVPoolAllocator
        from sglang.srt.mem_cache.cache_init_params import CacheInitParams
        from sglang.srt.mem_cache.memory_pool import ReqToTokenPool
        from sglang.srt.mem_cache.unified_cache.component_type import ComponentType

        self.name = f"{self.arm_prefix}:{policy}"
        self.capacity_blocks = capacity_blocks
        self._context = _scheduler_context()
        _check_native_hash()
        with self._sglang():
            # The allocator hands out slot ids only; the KV tensors themselves are irrelevant.
            self.allocator = TokenToKVPoolAllocator(
                capacity_blocks, torch.float16, "cpu", kvcache=None, need_sort=False
            )
            # A request never holds more than the whole pool, so rows need no more columns.
            self.req_to_token_pool = ReqToTokenPool(
                size=min(max_running_requests, capacity_blocks),
                max_context_len=capacity_blocks,
                device="cpu",
                enable_memory_saver=False,
            )
            self.cache = self._build_cache(
                CacheInitParams(
                    disable=False,
                    req_to_token_pool=self.req_to_token_pool,
                    token_to_kv_pool_allocator=self.allocator,
                    page_size=1,
                    eviction_policy=policy,
                    enable_kv_cache_events=True,
                    tree_components=(ComponentType.FULL,),
                    tree_core_backend="rust" if tree_core == "rust" else "python",
                ),
                policy,
            )
        self.requests: dict[int, Req] = {}
        # The cached units as SGLang's events name them: a unit's block hash chains its
        # parent's, so (parent block hash, unit id) identifies a unit with its prefix.
        self._events = EventLedger()

    arm_prefix = "sglang-stock"

    def _check_policy(self, policy: str) -> None:
        if policy.lower() not in sglang_policies():
            raise UnknownPolicyError(
                f"unknown SGLang eviction policy {policy!r}; SGLang "
                f"{SUPPORTED_SGLANG_VERSION} accepts: {', '.join(sglang_policies())}"
            )

    def _build_cache(self, params: Any, policy: str) -> Any:
        """SGLang's `UnifiedRadixCache` from `params` (its pools built already)."""
        from sglang.srt.mem_cache.unified_radix_cache import UnifiedRadixCache

        return UnifiedRadixCache(params)

    def admit(self, req_id: int, prompt: list[int], compute: int) -> int | None:
        from sglang.srt.managers.schedule_batch import Req
        from sglang.srt.mem_cache.allocation import alloc_req_slots, alloc_token_slots
        from sglang.srt.sampling.sampling_params import SamplingParams

        if req_id in self.requests:
            raise ValueError(f"request {req_id} is already running")
        if not 1 <= compute <= len(prompt):
            # SGLang holds KV for at least one token of every request it runs.
            raise ValueError(f"compute must be in [1, len(prompt) = {len(prompt)}], got {compute}")
        with self._sglang():
            req = Req(str(req_id), "", array("q", prompt), SamplingParams())
            req.init_next_round_input(self.cache)
            hits = req.prefix_len
            req.cached_tokens = hits  # as SGLang's batch counts it when the prefill runs
            held = max(hits, compute)  # hits past `compute` are adopted with no new slots
            req.lock = self.cache.lock(req.last_node)
            if not self._fits(held - hits) or not self.req_to_token_pool.available_size():
                self.cache.unlock(req.lock)
                return None
            alloc_req_slots(self.req_to_token_pool, [req], self.cache)
            row = req.kv.req_pool_idx
            self.req_to_token_pool.write(
                (row, slice(0, hits)), self.cache.prefix_device_indices(req)
            )
            self.req_to_token_pool.write(
                (row, slice(hits, held)), alloc_token_slots(self.cache, held - hits)
            )
            req.kv.kv_allocated_len = req.kv.kv_committed_len = held
        self.requests[req_id] = req
        self._events.drain(self.cache)
        self._events.record_hits(prompt[:hits])
        return hits

    def grow(self, req_id: int, units: list[int]) -> bool:
        from sglang.srt.mem_cache.allocation import alloc_token_slots

        req = self.requests[req_id]
        if not units:
            return True
        with self._sglang():
            if not self._fits(len(units)):
                return False
            start = req.kv.kv_allocated_len
            end = start + len(units)
            slots = alloc_token_slots(self.cache, len(units))
            self.req_to_token_pool.write((req.kv.req_pool_idx, slice(start, end)), slots)
            req.output_ids.extend(units)
            req.kv.kv_allocated_len = req.kv.kv_committed_len = end
            self._after_step(req)
        self._events.drain(self.cache)
        return True

    def _after_step(self, req: Req, finished_output: int | None = None) -> None:
        """What the scheduler does after a decode step, and at a request's end (given the
        tokens it generated), besides allocating: nothing here; the hybrid arm frees
        sliding-window state."""

    def finish(self, req_id: int, output_tokens: int = 0) -> None:
        from sglang.srt.managers.schedule_batch import FINISH_LENGTH
        from sglang.srt.mem_cache.common import release_kv_cache

        req = self.requests.pop(req_id)
        with self._sglang():
            self._after_step(req, output_tokens)
            # As `Req.update_finish_state` marks a request that reached its length.
            req.finished_reason = FINISH_LENGTH(length=len(req.output_ids))
            req.finished_len = len(req.output_ids)
            # a unit is a trace block: kvplug's cache reads the trace's output length
            req.kvplug_output_tokens = output_tokens
            release_kv_cache(req, self.cache, checkpoint=True)
        self._events.drain(self.cache)

    def stats(self) -> ArmStats:
        self._events.drain(self.cache)
        cached = self.cache.evictable_size() + self.cache.protected_size()
        return ArmStats(self._events.evictions, self._events.churn, cached)

    @contextmanager
    def _sglang(self) -> Iterator[None]:
        """Run SGLang code under its scheduler configuration (restored afterwards)."""
        from sglang.srt.runtime_context import use_context

        with use_context(self._context):
            yield

    def _fits(self, units: int) -> bool:
        """Whether SGLang's allocation of `units` slots succeeds: free slots plus what
        `evict_to_free_tokens` can evict (the locked prefix is not evictable)."""
        return units <= self.allocator.available_size() + self.cache.evictable_size()


class EventLedger:
    """Evictions, churn and hits per stored block, from the cache's KV events: a block is
    the event's hash, named by its parent's hash and its unit. Units the events never
    named (state SGLang stores for no block) are not counted."""

    def __init__(self) -> None:
        self.block_of: dict[tuple[int | None, int], int] = {}
        self.edge_of: dict[int, tuple[int | None, int]] = {}
        self.hits: dict[int, int] = {}  # block hash -> successful lookups since stored
        self.evictions = 0
        self.churn = 0

    def record_hits(self, units: Sequence[int]) -> None:
        """Count a successful lookup of the cached prefix `units`."""
        parent = None
        for unit in units:
            block = self.block_of.get((parent, unit))
            if block is None:
                return
            self.hits[block] += 1
            parent = block

    def drain(self, cache: Any) -> None:
        from sglang.srt.disaggregation.kv_events import (
            AllBlocksCleared,
            BlockRemoved,
            BlockStored,
        )

        for event in cache.take_events():
            if isinstance(event, BlockStored):
                parent = event.parent_block_hash
                for unit, block in zip(event.token_ids, event.block_hashes, strict=True):
                    self.block_of[(parent, unit)] = block
                    self.edge_of[block] = (parent, unit)
                    self.hits.setdefault(block, 0)
                    parent = block
            elif isinstance(event, BlockRemoved):
                for block in event.block_hashes:
                    if block not in self.hits:
                        continue
                    self.evictions += 1
                    self.churn += self.hits.pop(block) == 0
                    del self.block_of[self.edge_of.pop(block)]
            elif isinstance(event, AllBlocksCleared):
                self.block_of.clear()
                self.edge_of.clear()
                self.hits.clear()


__all__ = ["SUPPORTED_SGLANG_VERSION", "EventLedger", "SGLangStockArm", "sglang_policies"]
