"""Retention in vLLM: a finished request's prompt prefix held as a running request holds it.

A request asks with ``kvplug_retain_s`` in its ``SamplingParams.extra_args`` (``vllm_xargs``
in the OpenAI API), or its tenant's default (`kvplug.config.RetentionConfig`).
`kvplug.core.retention.RetentionBook` decides which retentions are live; `PoolRetention`
does the holding, in vLLM's own terms: just before vLLM frees the request, each of its
cached prompt blocks gains one reference, so vLLM's pool keeps it out of the free queue
and no policy can choose it (the stock pool's or kvplug's: retention works under any
policy). When the retention ends (it expires, its tenant's cap needs room, or an
allocation finds nothing else to evict: `lapse_for_room`) the blocks are freed through
the pool, tail first, and ranked like any other release.

A bad value (not a number of seconds in the accepted range) is not served: the request
runs as if it had asked for nothing, kvplug logs why and counts it
(``kvplug_retentions_refused``); the scheduler runs in vLLM's engine core, where raising
would stop the engine.

Only models whose KV cache groups are all full attention retain: a sliding-window or
Mamba group's state would need its own rule for what a kept prefix is. A tenant default
on such a model is refused at start-up; a request's ask is refused and counted.

Invariants (`check_invariants`): each block's reference count includes one per live
retention holding it; the book's own (`RetentionBook.check_invariants`).
"""

from __future__ import annotations

import functools
import logging
import time
from collections import Counter
from collections.abc import Callable, Mapping
from typing import Any

from kvplug.core.retention import EngineRetentions, Retention, RetentionBook
from kvplug.engine_stats import PoolStats

RETAIN_ARG = "kvplug_retain_s"  # per request: SamplingParams.extra_args / OpenAI vllm_xargs

logger = logging.getLogger("vllm.kvplug")


def refusal_for(all_prefix_groups: bool) -> str | None:
    """Why a vLLM cache cannot retain (see the module doc), or None."""
    if all_prefix_groups:
        return None
    return (
        "retention keeps full-attention prefixes only, and this model's KV cache has "
        "sliding-window or Mamba groups"
    )


class PoolRetention(EngineRetentions):
    """The live retentions of one vLLM KV cache manager (see the module doc)."""

    def __init__(
        self,
        manager: Any,
        book: RetentionBook,
        stats: PoolStats,
        defaults: Mapping[str, float] | None = None,
        refusal: str | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        """`refusal`: why this cache cannot retain (`refusal_for`), or None."""
        super().__init__(book, stats, defaults, refusal, clock, logger)
        self.manager = manager
        self.pool = manager.block_pool
        self.holds: Counter[int] = Counter()  # block id -> live retentions holding it

    def asked(self, request: Any, tenant: str) -> float | None:
        """The seconds `request` asks to be kept (`EngineRetentions.seconds_asked`)."""
        extra = getattr(request.sampling_params, "extra_args", None) or {}
        return self.seconds_asked(extra.get(RETAIN_ARG), tenant, request.request_id, RETAIN_ARG)

    def on_finish(self, request: Any, tenant: str) -> Retention | None:
        """`request` is about to be freed: hold its cached prompt blocks if it asked."""
        seconds = self.asked(request, tenant)
        return None if seconds is None else self.hold(request, tenant, seconds)

    def hold(self, request: Any, tenant: str, seconds: float) -> Retention | None:
        """Keep `request`'s cached prompt blocks for `seconds` (before vLLM frees it),
        as far as `tenant`'s cap allows; returns the retention, or None if nothing is
        kept."""
        blocks = self.prompt_blocks(request)
        retention, lapsed = self.book.retain(
            tenant, [block.block_id for block in blocks], seconds, self.clock()
        )
        if retention is not None:
            for block in blocks:
                block.ref_cnt += 1
                self.holds[block.block_id] += 1
            self.stats.retentions += 1
            self._lapse_when_full()
        for ended in lapsed:
            self._release(ended)
        return retention

    def prompt_blocks(self, request: Any) -> list[Any]:
        """`request`'s prompt blocks that hold a cached hash, in order, every group's."""
        found = []
        for manager in self.manager.coordinator.single_type_managers:
            blocks = manager.req_to_blocks.get(request.request_id, ())
            for block in blocks[: request.num_prompt_tokens // manager.block_size]:
                if block.is_null or block.block_hash is None:
                    break
                found.append(block)
        return found

    def lapse_for_room(self) -> bool:
        """An allocation found no room: end the oldest retention if any block is held by
        retentions alone (ending it may then give room); whether one ended."""
        if not self.book.live:
            return False
        blocks = self.pool.blocks
        if not any(blocks[b].ref_cnt == n for b, n in self.holds.items()):
            return False
        return self.lapse_oldest()

    def _lapse_when_full(self) -> None:
        """From the first retention on, the manager's `allocate_slots` ends retentions
        where it finds no room (wrapped on the instance once, so that a server whose
        requests never ask pays nothing on this call, made for every scheduled request)."""
        manager = self.manager
        if "allocate_slots" in vars(manager):
            return
        allocate = manager.allocate_slots

        @functools.wraps(allocate)
        def allocate_slots(request: Any, *args: Any, **kwargs: Any) -> Any:
            result = allocate(request, *args, **kwargs)
            while result is None and self.lapse_for_room():  # (vLLM changes nothing on None)
                result = allocate(request, *args, **kwargs)
            return result

        manager.allocate_slots = allocate_slots

    def retained_blocks(self) -> int:
        return len(self.holds)

    def _release(self, retention: Retention) -> None:
        blocks = self.pool.blocks
        for block_id in retention.blocks:
            self.holds[block_id] -= 1
            if not self.holds[block_id]:
                del self.holds[block_id]
        # vLLM frees a request's blocks tail first; the pool ranks them as one release
        self.pool.free_blocks([blocks[block_id] for block_id in reversed(retention.blocks)])

    def check_invariants(self) -> None:
        """Raise AssertionError if a module-level invariant does not hold."""
        self.book.check_invariants()
        counted: Counter[int] = Counter()
        for retention in self.book.live.values():
            counted.update(retention.blocks)
        assert counted == self.holds, "retention holds out of step with the book"
        for block_id, holds in self.holds.items():
            assert self.pool.blocks[block_id].ref_cnt >= holds, f"block {block_id}"
