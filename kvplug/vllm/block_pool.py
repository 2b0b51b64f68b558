"""kvplug's block pool for vLLM: vLLM's `BlockPool`, with kvplug choosing what to evict.

vLLM keeps every block with ``ref_cnt == 0`` in one free queue and hands out its head.
`KVPlugBlockPool` keeps vLLM's block objects, hash map, KV events and metrics collector,
and replaces that queue with a `PolicyFreeQueue` split in two:

- *fresh* blocks hold nothing reusable (no hash). They go out first, the most recently
  freed first, as in vLLM (which prepends them to its queue).
- *cached* blocks (a hash, no holder) are the eviction candidates. A kvplug eviction
  policy ranks each one when it is released, and the lowest-ranked *leaf* goes first:
  a block whose children (the blocks cached after it in some request) are still cached
  and free waits for them, so a shared root is evicted after the leaves below it rather
  than being kept forever or orphaning them.

Invariants (checked by `check_invariants`):
- every block other than the null block is held (``ref_cnt > 0``), fresh, or cached,
  never two of these; ``num_free_blocks`` is the number of fresh plus cached blocks;
- a cached block has a hash; a block's policy node exists exactly while it is cached;
- a cached block is a policy candidate exactly when no cached block names it as parent.

With the ``lru`` policy the hand-out order is vLLM's own (fresh blocks first, then
cached blocks least recently released first, a request's tail before its head), so
kvplug reproduces stock vLLM's cache hits exactly.
"""

from __future__ import annotations

from collections import OrderedDict, deque
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass
from itertools import count
from typing import Any

from vllm.v1.core.block_pool import BlockPool
from vllm.v1.core.kv_cache_utils import KVCacheBlock

from kvplug.policies.base import EvictionPolicy
from kvplug.vllm.stats import PoolStats


@dataclass(slots=True)
class Release:
    """What the scheduler knows about the request whose blocks are being freed."""

    output_tokens: int = 0
    request_hit: bool = False


class CachedBlock:
    """One block's record while it has a hash: the policy's node for it, and its place in
    the tree.

    It has the fields a policy reads from `kvplug.core.index.Node` (a policy never sees the
    difference) without a child map: the pool only counts children that are free. Each
    physical block has one record, made with the pool and renewed (`reset`, new serial)
    for each hash the block holds, so serving allocates nothing per cached block.
    """

    __slots__ = (
        "serial", "key", "depth", "hits", "from_end", "request_hit", "request_output",
        "block", "parent", "parent_serial", "free_children", "free",
    )  # fmt: skip

    def __init__(self, block: KVCacheBlock) -> None:
        self.block = block
        self.reset(-1, 0)

    def reset(self, serial: int, depth: int) -> None:
        """Start a new identity: `serial` (-1: no hash), the block's current hash."""
        self.serial = serial
        self.key = self.block.block_hash
        self.depth = depth
        self.hits = 0
        self.from_end = 0
        self.request_hit = False
        self.request_output = 0
        self.parent: CachedBlock | None = None  # the block before it when it was cached
        self.parent_serial = -1  # the parent's serial then; stale once the parent changes
        self.free_children = 0  # free cached blocks whose parent this is
        self.free = False  # whether it is in the queue's cached set

    def live_parent(self) -> CachedBlock | None:
        parent = self.parent
        if parent is None or parent.serial != self.parent_serial:
            return None
        return parent


class PolicyFreeQueue:
    """The free blocks of a `KVPlugBlockPool`, in the interface vLLM's pool uses.

    ``popleft`` returns a fresh block if there is one, else evicts the policy's first
    victim. Fresh blocks sit on a stack whose stale entries (blocks that left it through
    ``remove``) are skipped lazily, so every operation is O(1) for fresh blocks and
    O(log n) for cached ones.
    """

    def __init__(self, pool: KVPlugBlockPool, blocks: list[KVCacheBlock]) -> None:
        self.pool = pool
        self._fresh: deque[tuple[KVCacheBlock, int]] = deque()  # right end goes out first
        self._fresh_entry: dict[int, int] = {}  # block id -> serial of its live entry
        self._cached: dict[int, KVCacheBlock] = {}  # block id -> block, ranked by policy
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
        block = self.pool.choose_victim()
        self.remove(block)
        return block

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
            for _ in range(n - len(taken)):
                block = self.pool.choose_victim()
                self.remove(block)
                taken.append(block)
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
        for from_end, block in enumerate(blocks):  # vLLM passes a request's blocks tail first
            if caching and block.block_hash is not None:
                self._cached[block.block_id] = block
                self.pool.on_free(block, from_end)
            else:
                self._push_fresh(block, first=False)

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

    def any_cached(self) -> KVCacheBlock:
        return next(iter(self._cached.values()))

    def make_all_fresh(self) -> None:
        """Move every cached block to the fresh stack (their hashes are gone)."""
        for block in list(self._cached.values()):
            self.remove(block)
            self._push_fresh(block, first=True)

    def _push_fresh(self, block: KVCacheBlock, first: bool) -> None:
        serial = next(self._serials)
        self._fresh_entry[block.block_id] = serial
        if first:
            self._fresh.append((block, serial))
        else:
            self._fresh.appendleft((block, serial))


class KVPlugBlockPool(BlockPool):
    """vLLM's `BlockPool` with a kvplug policy deciding evictions (see the module doc).

    Constructed by vLLM's KV cache coordinator with vLLM's own arguments; the policy and
    statistics are attached by `kvplug.vllm.scheduler` through `use_policy` before any
    request arrives.
    """

    policy: EvictionPolicy
    stats: PoolStats

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        # vLLM's constructor built its own queue and took the null block from it.
        self.free_block_queue = PolicyFreeQueue(self, [b for b in self.blocks if not b.is_null])
        self._slots = [CachedBlock(block) for block in self.blocks]  # by block id
        self._records: dict[int, CachedBlock] = {}  # block id -> record, while it has a hash
        self._serials = count()
        self.releasing = Release()
        self._evicted: OrderedDict[Any, None] = OrderedDict()  # recent victims' hashes
        self.use_policy(_default_policy(), PoolStats())

    def use_policy(
        self, policy: EvictionPolicy, stats: PoolStats, tree_groups: set[int] | None = None
    ) -> None:
        """Rank with `policy` and count into `stats`. Blocks of the KV cache groups in
        `tree_groups` (full attention: a hit needs every block before it) are evicted
        leaves first; others (sliding window) have no parent. None means every group."""
        if self._records:
            raise RuntimeError("the policy can only be chosen while nothing is cached")
        policy.bind(self.hash_block_size, self.num_gpu_blocks)
        self.policy = policy
        self.stats = stats
        self.tree_groups = tree_groups
        self._first_candidate = getattr(policy, "first_candidate", None) or (
            lambda: next(iter(policy.choose_victims(1)), None)
        )

    def num_cached_blocks(self) -> int:
        """Blocks holding a reusable hash, held or free."""
        return len(self._records)

    # -- vLLM's entry points -------------------------------------------------------------
    def touch(self, blocks: Sequence[KVCacheBlock]) -> None:
        """A request reuses `blocks` (prefix hits): count the hit, then take a reference."""
        records, hit, hits = self._records, self.policy.hit, 0
        for block in blocks:
            record = records.get(block.block_id)
            if record is not None and record.key == block.block_hash:
                record.hits += 1
                hits += 1
                hit(record)  # type: ignore[arg-type]
        self.stats.block_hits += hits
        super().touch(blocks)

    def cache_full_blocks(
        self,
        request: Any,
        blocks: list[KVCacheBlock],
        num_cached_blocks: int,
        num_full_blocks: int,
        block_size: int,
        kv_cache_group_id: int,
        block_mask: list[bool] | None = None,
    ) -> None:
        """Cache blocks as vLLM does, then note each new block's parent in its chain."""
        super().cache_full_blocks(
            request, blocks, num_cached_blocks, num_full_blocks, block_size,
            kv_cache_group_id, block_mask,
        )  # fmt: skip
        tree = self.tree_groups is None or kv_cache_group_id in self.tree_groups
        parent = self._records.get(blocks[num_cached_blocks - 1].block_id) if (
            tree and num_cached_blocks > 0
        ) else None  # fmt: skip
        for i in range(num_cached_blocks, num_full_blocks):
            block = blocks[i]
            if block.is_null or block.block_hash is None:
                parent = None
                continue
            record = self._record(block)
            if tree and record.parent is None and parent is not None:
                record.parent, record.parent_serial = parent, parent.serial
            parent = record if tree else None

    def reset_prefix_cache(self) -> bool:
        if not super().reset_prefix_cache():
            return False
        self.free_block_queue.make_all_fresh()
        for record in self._records.values():
            self.policy.remove(record)  # type: ignore[arg-type]
            record.serial = -1
        self._records.clear()
        return True

    # -- called by PolicyFreeQueue ------------------------------------------------------------
    def on_free(self, block: KVCacheBlock, from_end: int) -> None:
        """`block` (with a hash) lost its last holder: rank it and make it a candidate."""
        record = self._record(block)
        record.from_end = from_end
        record.request_hit = self.releasing.request_hit
        record.request_output = self.releasing.output_tokens
        record.free = True
        policy = self.policy
        policy.release(record)  # type: ignore[arg-type]
        if record.free_children == 0:
            policy.add_candidate(record)  # type: ignore[arg-type]
        parent = record.live_parent()
        if parent is not None:
            parent.free_children += 1
            if parent.free_children == 1 and parent.free:
                policy.discard_candidate(parent)  # type: ignore[arg-type]

    def on_unfree(self, block: KVCacheBlock) -> None:
        """`block` left the cached set (touched by a hit, or about to be evicted)."""
        record = self._records[block.block_id]
        record.free = False
        policy = self.policy
        policy.discard_candidate(record)  # type: ignore[arg-type]
        parent = record.live_parent()
        if parent is not None:
            parent.free_children -= 1
            if parent.free_children == 0 and parent.free:
                policy.add_candidate(parent)  # type: ignore[arg-type]

    def choose_victim(self) -> KVCacheBlock:
        """The cached block to evict next: the policy's first candidate."""
        victim = self._first_candidate()
        if victim is not None:
            block: KVCacheBlock = victim.block  # type: ignore[assignment]
        else:  # unreachable while the parent counts are exact; never strand a free block
            block = self.free_block_queue.any_cached()
        self.stats.evictions += 1
        evicted = self._evicted
        evicted[block.block_hash] = None
        if len(evicted) > self.num_gpu_blocks:
            evicted.popitem(last=False)
        return block

    def _maybe_evict_cached_block(self, block: KVCacheBlock) -> bool:
        """vLLM drops a block's hashes when it is handed out or evicted on request."""
        record = self._records.get(block.block_id)
        if record is not None:
            if record.free:  # evicted on request while free: it is fresh from now on
                self.free_block_queue.remove(block)
                self.free_block_queue.prepend_n([block])
            del self._records[block.block_id]
            self.policy.remove(record)  # type: ignore[arg-type]
            record.serial = -1  # children that still name it see a dead parent
        return super()._maybe_evict_cached_block(block)

    # -- helpers ---------------------------------------------------------------------------
    def _record(self, block: KVCacheBlock) -> CachedBlock:
        """The record of `block` under its current hash (renewed if the hash changed)."""
        record = self._records.get(block.block_id)
        if record is not None and record.key == block.block_hash:
            return record
        if record is not None:
            self.policy.remove(record)  # type: ignore[arg-type]
            record.serial = -1
        num_tokens = block.block_hash_num_tokens or self.hash_block_size
        record = self._slots[block.block_id]
        record.reset(next(self._serials), max(num_tokens // self.hash_block_size - 1, 0))
        if self._evicted.pop(block.block_hash, 0) is None:
            self.stats.churn += 1
        self.policy.insert(record)  # type: ignore[arg-type]
        self._records[block.block_id] = record
        return record

    def check_invariants(self) -> None:
        """Raise AssertionError if a module-level invariant does not hold."""
        queue = self.free_block_queue
        for block in self.blocks:
            if block.is_null:
                continue
            states = [block.ref_cnt > 0, queue.is_fresh(block), queue.is_cached(block)]
            assert sum(states) == 1, f"block {block.block_id}: held/fresh/cached = {states}"
            assert block.ref_cnt >= 0, f"block {block.block_id}: ref_cnt {block.ref_cnt}"
            if queue.is_cached(block):
                assert block.block_hash is not None, f"cached block {block.block_id} has no hash"
                assert self._records[block.block_id].free, f"block {block.block_id} not free"
        assert queue.num_free_blocks == sum(
            1 for b in self.blocks if not b.is_null and b.ref_cnt == 0
        )
        children: dict[int, int] = {}
        for block in queue.cached_blocks():
            parent = self._records[block.block_id].live_parent()
            if parent is not None:
                pid = parent.block.block_id
                children[pid] = children.get(pid, 0) + 1
        leaves = 0
        for block in queue.cached_blocks():
            record = self._records[block.block_id]
            found = children.get(block.block_id, 0)
            assert record.free_children == found, (
                f"block {block.block_id}: {record.free_children} free children counted, "
                f"{found} found"
            )
            leaves += found == 0
        assert len(self.policy) == leaves, "the policy's candidates are not the cached leaves"


def _default_policy() -> EvictionPolicy:
    from kvplug.policies import make_policy

    return make_policy("lru")
