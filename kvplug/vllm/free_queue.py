"""The free-block queue of kvplug's vLLM pool: vLLM's queue interface, kvplug's order.

vLLM keeps every block with ``ref_cnt == 0`` in one `FreeKVCacheBlockQueue` and hands
out its head. `PolicyFreeQueue` has the same interface, split in two:

- *fresh* blocks hold nothing reusable (no hash). They go out first, the most recently
  freed first, as in vLLM (which prepends them to its queue).
- *cached* blocks (a hash, no holder) are the eviction candidates' pool: when no fresh
  block is left, the queue evicts the eviction core's next victim (its `KVPlugBlockPool`
  names it). With ``lru`` the pool uses vLLM's own queue instead (`ReleaseOrderPool`).
- cached blocks freed *to evict first* (vLLM's ``free_blocks(..., evict_first=True)``: a
  lazy offloader gives back blocks another tier now holds) are marked ``held_elsewhere``.
  A policy that prices tiers (`cost`, `learned`) ranks them as a reload and decides
  alone; for any other they also wait in a first-in lane and are evicted before the
  policy's victims, as vLLM's own queue would. Either way they stay cached (a prefix hit
  takes them back).

**The order is the eviction order.** ``iter_blocks_after`` (what vLLM's lazy CPU offload
and other tiers walk from the head, expecting the blocks the allocator takes next) yields
exactly the order ``popleft`` would hand blocks out in: fresh blocks, the lane, then the
pool's victims in its policy's order (`KVPlugBlockPool.iter_victims`). So does the
linked list vLLM's own queue keeps (``fake_free_list_head`` / ``fake_free_list_tail``,
``next_free_block``): reading either sentinel links the free blocks in that order, as of
that read.

Invariant: a block is in at most one of the two sets, and ``num_free_blocks`` is their
total size; every live lane entry is a cached block.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterable, Iterator, Sequence
from itertools import count
from typing import TYPE_CHECKING

from vllm.v1.core.kv_cache_utils import KVCacheBlock

import kvplug.vllm.compat  # noqa: F401 - KVCacheBlock._block_hash on every vLLM release

if TYPE_CHECKING:
    from kvplug.vllm.block_pool import KVPlugBlockPool


class PolicyFreeQueue:
    """The free blocks of a `KVPlugBlockPool`, in the interface vLLM's pool uses.

    ``popleft`` returns a fresh block if there is one, else the pool's next victim. Fresh
    blocks sit on a stack whose stale entries (blocks that left it through ``remove``)
    are skipped lazily, so every operation is O(1) for fresh blocks and O(log n) for
    cached ones.
    """

    def __init__(self, pool: KVPlugBlockPool, blocks: list[KVCacheBlock]) -> None:
        self.pool = pool
        self._fresh: deque[tuple[KVCacheBlock, int]] = deque()  # right end goes out first
        self._fresh_entry: dict[int, int] = {}  # block id -> serial of its live entry
        self._cached: dict[int, KVCacheBlock] = {}  # block id -> block
        self._first: deque[tuple[KVCacheBlock, int]] = deque()  # evict-first lane, left first
        self._first_entry: dict[int, int] = {}  # block id -> serial of its live lane entry
        self._serials = count()
        self._sentinels = (KVCacheBlock(block_id=-1), KVCacheBlock(block_id=-1))
        for block in reversed(blocks):
            self._push_fresh(block, first=True)

    # -- the interface of vLLM's FreeKVCacheBlockQueue --------------------------------
    @property
    def num_free_blocks(self) -> int:
        return len(self._fresh_entry) + len(self._cached)

    def popleft(self) -> KVCacheBlock:
        while self._fresh:
            block, serial = self._fresh.pop()
            if self._fresh_entry.get(block.block_id) == serial:
                del self._fresh_entry[block.block_id]
                return block
        if not self._cached:
            raise ValueError("No free block is available")
        return self._take_victims(1)[0]

    def popleft_n(self, n: int) -> list[KVCacheBlock]:
        taken: list[KVCacheBlock] = []
        fresh, live = self._fresh, self._fresh_entry
        while fresh and len(taken) < n:
            block, serial = fresh.pop()
            if live.get(block.block_id) == serial:
                del live[block.block_id]
                taken.append(block)
        if len(taken) < n:
            if len(taken) + len(self._cached) < n:
                raise ValueError("Not enough free blocks are available")
            taken += self._take_victims(n - len(taken))
        return taken

    def remove(self, block: KVCacheBlock) -> None:
        if self._fresh_entry.pop(block.block_id, None) is not None:
            return
        del self._cached[block.block_id]
        if self._first_entry.pop(block.block_id, None) is not None and not self._first_entry:
            self._first.clear()  # only stale entries were left: never let them pile up
        self.pool.on_unfree(block)

    def append(self, block: KVCacheBlock) -> None:
        self.append_n([block])

    def append_n(self, blocks: Iterable[KVCacheBlock], held_elsewhere: bool = False) -> None:
        """Free `blocks`, the first to be evicted first: cached ones are ranked (as held by
        another tier too, if `held_elsewhere`), others wait behind every fresh block (vLLM
        uses this for blocks still being read)."""
        caching = self.pool.enable_caching
        cached = self._cached
        released: list[tuple[int, KVCacheBlock]] = []  # (from_end, block)
        for item in enumerate(blocks):  # vLLM passes a request's blocks tail first
            block = item[1]
            if caching and block._block_hash is not None:
                cached[block.block_id] = block
                released.append(item)
            else:
                self._push_fresh(block, first=False)
        if released:
            self.pool.on_free_n(released, held_elsewhere)

    def prepend_n(self, blocks: Sequence[KVCacheBlock]) -> None:
        """Free blocks to go out first, `blocks[0]` first: those holding nothing reusable
        before every other free block. Cached ones (vLLM's ``evict_first``: another tier
        holds them) are ranked like any release and, unless the policy prices tiers
        (`EvictionPolicy.prices_tiers`: then its ranking, which values them as a reload,
        decides alone), also wait in the lane."""
        caching = self.pool.enable_caching
        lane: list[KVCacheBlock] = []
        for block in reversed(blocks):
            if caching and block._block_hash is not None:
                lane.append(block)
            else:
                self._push_fresh(block, first=True)
        if lane:
            lane.reverse()
            priced = self.pool.tracked and self.pool.policy.prices_tiers
            self.append_n(lane, held_elsewhere=True)
            if priced:
                return
            for block in lane:
                serial = next(self._serials)
                self._first_entry[block.block_id] = serial
                self._first.append((block, serial))

    def iter_blocks_after(self, cursor: KVCacheBlock | None) -> Iterator[KVCacheBlock]:
        """The free blocks in the order they will be handed out, after `cursor` (None: from
        the head; a cursor no longer free: from the head as well). Nothing may change
        while it is read."""
        order = self._eviction_order()
        if cursor is not None and (self.is_fresh(cursor) or self.is_cached(cursor)):
            for block in order:
                if block is cursor:
                    break
        yield from order

    def get_all_free_blocks(self) -> list[KVCacheBlock]:
        """Every free block, in the order they will be handed out."""
        return list(self._eviction_order())

    def __iter__(self) -> Iterator[KVCacheBlock]:
        return iter(self.get_all_free_blocks())

    @property
    def fake_free_list_head(self) -> KVCacheBlock:
        """vLLM's head sentinel: its ``next_free_block`` chain is the hand-out order."""
        return self._link()[0]

    @property
    def fake_free_list_tail(self) -> KVCacheBlock:
        """vLLM's tail sentinel: its ``prev_free_block`` chain is the hand-out order,
        reversed."""
        return self._link()[1]

    # -- kvplug's own --------------------------------------------------------------------
    def is_cached(self, block: KVCacheBlock) -> bool:
        return block.block_id in self._cached

    def is_fresh(self, block: KVCacheBlock) -> bool:
        return block.block_id in self._fresh_entry

    def cached_blocks(self) -> list[KVCacheBlock]:
        return list(self._cached.values())

    def any_cached(self, taken: Sequence[KVCacheBlock] = ()) -> KVCacheBlock:
        """A cached block not in `taken`."""
        skip = {block.block_id for block in taken}
        return next(b for i, b in self._cached.items() if i not in skip)

    def _eviction_order(self) -> Iterator[KVCacheBlock]:
        fresh, lane = self._fresh_entry, self._first_entry
        for block, serial in reversed(self._fresh):
            if fresh.get(block.block_id) == serial:
                yield block
        first = [block for block, serial in self._first if lane.get(block.block_id) == serial]
        yield from first
        yield from self.pool.iter_victims(first)

    def _link(self) -> tuple[KVCacheBlock, KVCacheBlock]:
        """Link the free blocks, in the order they will be handed out, between two
        sentinels (vLLM's doubly linked list; the queue itself never reads the links)."""
        head, tail = self._sentinels
        previous = head
        for block in self._eviction_order():
            previous.next_free_block = block
            block.prev_free_block = previous
            previous = block
        previous.next_free_block = tail
        tail.prev_free_block = previous
        head.prev_free_block = tail.next_free_block = None
        return head, tail

    def make_all_fresh(self) -> None:
        """Move every cached block to the fresh stack (their hashes are gone)."""
        for block in list(self._cached.values()):
            self.remove(block)
            self._push_fresh(block, first=True)

    def _take_victims(self, n: int) -> list[KVCacheBlock]:
        """Evict `n` cached blocks (there are that many): the lane's, then the pool's
        choices, in order."""
        cached, pool = self._cached, self.pool
        victims = self._take_lane(n)
        if len(victims) < n:
            victims += pool.evict_n(n - len(victims))
        for block in victims:
            del cached[block.block_id]
        pool.on_evicted(victims)
        return victims

    def _take_lane(self, n: int) -> list[KVCacheBlock]:
        """Up to `n` blocks from the evict-first lane, first in first, forgotten."""
        victims: list[KVCacheBlock] = []
        lane, first = self._first_entry, self._first
        while lane and len(victims) < n:
            block, serial = first.popleft()
            if lane.get(block.block_id) == serial:
                del lane[block.block_id]
                self.pool.forget(block)
                victims.append(block)
        return victims

    def _push_fresh(self, block: KVCacheBlock, first: bool) -> None:
        serial = next(self._serials)
        self._fresh_entry[block.block_id] = serial
        if first:
            self._fresh.append((block, serial))
        else:
            self._fresh.appendleft((block, serial))
