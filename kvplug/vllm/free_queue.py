"""The free-block queue of kvplug's vLLM pool: vLLM's queue interface, kvplug's order.

vLLM keeps every block with ``ref_cnt == 0`` in one `FreeKVCacheBlockQueue` and hands
out its head. `PolicyFreeQueue` has the same interface, split in two:

- *fresh* blocks hold nothing reusable (no hash). They go out first, the most recently
  freed first, as in vLLM (which prepends them to its queue).
- *cached* blocks (a hash, no holder) are the eviction candidates' pool: when no fresh
  block is left, the queue evicts the eviction core's next victim (its `KVPlugBlockPool`
  names it). With ``lru`` the pool uses vLLM's own queue instead (`ReleaseOrderPool`).

Invariant: a block is in at most one of the two sets, and ``num_free_blocks`` is their
total size.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterable, Iterator, Sequence
from itertools import count
from typing import TYPE_CHECKING

from vllm.v1.core.kv_cache_utils import KVCacheBlock

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
        self._serials = count()
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
        self.pool.on_unfree(block)

    def append(self, block: KVCacheBlock) -> None:
        self.append_n([block])

    def append_n(self, blocks: Iterable[KVCacheBlock]) -> None:
        """Free `blocks`, the first to be evicted first: cached ones are ranked, others
        wait behind every fresh block (vLLM uses this for blocks still being read)."""
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
            self.pool.on_free_n(released)

    def prepend_n(self, blocks: Sequence[KVCacheBlock]) -> None:
        """Free blocks that hold nothing reusable; `blocks[0]` goes out first."""
        for block in reversed(blocks):
            self._push_fresh(block, first=True)

    def get_all_free_blocks(self) -> list[KVCacheBlock]:
        fresh = [b for b, s in reversed(self._fresh) if self._fresh_entry.get(b.block_id) == s]
        return fresh + list(self._cached.values())

    def __iter__(self) -> Iterator[KVCacheBlock]:
        return iter(self.get_all_free_blocks())

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

    def make_all_fresh(self) -> None:
        """Move every cached block to the fresh stack (their hashes are gone)."""
        for block in list(self._cached.values()):
            self.remove(block)
            self._push_fresh(block, first=True)

    def _take_victims(self, n: int) -> list[KVCacheBlock]:
        """Evict `n` cached blocks (there are that many), the pool's choices in order."""
        cached, pool = self._cached, self.pool
        victims = pool.evict_n(n)
        for block in victims:
            del cached[block.block_id]
        pool.on_evicted(victims)
        return victims

    def _push_fresh(self, block: KVCacheBlock, first: bool) -> None:
        serial = next(self._serials)
        self._fresh_entry[block.block_id] = serial
        if first:
            self._fresh.append((block, serial))
        else:
            self._fresh.appendleft((block, serial))
