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

from kvplug.index import Node
from kvplug.policies.base import EvictionPolicy
from kvplug.vllm.stats import PoolStats


@dataclass(slots=True)
class Release:
    """What the scheduler knows about the request whose blocks are being freed."""

    output_tokens: int = 0
    request_hit: bool = False


@dataclass(slots=True)
class _Cached:
    """Bookkeeping for one block while it has a hash: its policy node and its parent."""

    node: Node
    parent: tuple[int, Any] | None = None  # (block id, the parent's hash then)
    free_children: int = 0  # cached blocks that name this one as parent


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
        return [self.popleft() for _ in range(n)]

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
        for block in blocks:
            if block.block_hash is not None and self.pool.enable_caching:
                self._cached[block.block_id] = block
                self.pool.on_free(block)
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
        self._entries: dict[int, _Cached] = {}
        self._serials = count()
        self.releasing = Release()
        self._from_end: dict[int, int] = {}
        self._evicted: OrderedDict[Any, None] = OrderedDict()  # recent victims' hashes
        self.use_policy(_default_policy(), PoolStats())

    def use_policy(
        self, policy: EvictionPolicy, stats: PoolStats, tree_groups: set[int] | None = None
    ) -> None:
        """Rank with `policy` and count into `stats`. Blocks of the KV cache groups in
        `tree_groups` (full attention: a hit needs every block before it) are evicted
        leaves first; others (sliding window) have no parent."""
        if self._entries:
            raise RuntimeError("the policy can only be chosen while nothing is cached")
        policy.bind(self.hash_block_size, self.num_gpu_blocks)
        self.policy = policy
        self.stats = stats
        self.tree_groups = set(range(1 << 16)) if tree_groups is None else tree_groups

    def num_cached_blocks(self) -> int:
        """Blocks holding a reusable hash, held or free."""
        return len(self._entries)

    # -- vLLM's entry points -------------------------------------------------------------
    def touch(self, blocks: Sequence[KVCacheBlock]) -> None:
        """A request reuses `blocks` (prefix hits): count the hit, then take a reference."""
        for block in blocks:
            entry = self._entries.get(block.block_id)
            if entry is not None and block.block_hash is not None:
                entry.node.hits += 1
                self.stats.block_hits += 1
                self.policy.hit(entry.node)
        super().touch(blocks)

    def free_blocks(self, ordered_blocks: Iterable[KVCacheBlock]) -> None:
        """Release blocks, tail first. Their position in this call is `from_end`."""
        ordered = list(ordered_blocks)
        self._from_end = {b.block_id: i for i, b in enumerate(ordered) if b.pool is self}
        try:
            super().free_blocks(ordered)
        finally:
            self._from_end = {}

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
        for i in range(max(num_cached_blocks, 0), num_full_blocks):
            block = blocks[i]
            if block.is_null or block.block_hash is None:
                continue
            entry = self._entry(block)
            if kv_cache_group_id not in self.tree_groups:
                continue
            if entry.parent is None and i > 0 and not blocks[i - 1].is_null:
                parent = blocks[i - 1]
                if parent.block_hash is not None:
                    entry.parent = (parent.block_id, parent.block_hash)

    def reset_prefix_cache(self) -> bool:
        if not super().reset_prefix_cache():
            return False
        self.free_block_queue.make_all_fresh()
        for entry in self._entries.values():
            self.policy.remove(entry.node)
        self._entries.clear()
        return True

    # -- called by PolicyFreeQueue ------------------------------------------------------------
    def on_free(self, block: KVCacheBlock) -> None:
        """`block` (with a hash) lost its last holder: rank it and make it a candidate."""
        entry = self._entry(block)
        node = entry.node
        node.from_end = self._from_end.get(block.block_id, 0)
        node.request_hit = self.releasing.request_hit
        node.request_output = self.releasing.output_tokens
        self.policy.release(node)
        if entry.free_children == 0:
            self.policy.add_candidate(node)
        parent = self._parent_entry(entry)
        if parent is not None:
            parent.free_children += 1
            if parent.free_children == 1 and self.free_block_queue.is_cached(
                self.blocks[entry.parent[0]]
            ):
                self.policy.discard_candidate(parent.node)

    def on_unfree(self, block: KVCacheBlock) -> None:
        """`block` left the cached set (touched by a hit, or about to be evicted)."""
        entry = self._entries[block.block_id]
        self.policy.discard_candidate(entry.node)
        parent = self._parent_entry(entry)
        if parent is not None:
            parent.free_children -= 1
            if parent.free_children == 0 and self.free_block_queue.is_cached(
                self.blocks[entry.parent[0]]
            ):
                self.policy.add_candidate(parent.node)

    def choose_victim(self) -> KVCacheBlock:
        """The cached block to evict next: the policy's first candidate."""
        victims = self.policy.choose_victims(1)
        if victims:
            block: KVCacheBlock = victims[0].block  # type: ignore[assignment]
        else:  # unreachable while the parent counts are exact; never strand a free block
            block = next(iter(self.free_block_queue.cached_blocks()))
        self.stats.evictions += 1
        self._evicted[block.block_hash] = None
        while len(self._evicted) > self.num_gpu_blocks:
            self._evicted.popitem(last=False)
        return block

    def _maybe_evict_cached_block(self, block: KVCacheBlock) -> bool:
        """vLLM drops a block's hashes when it is handed out or evicted on request."""
        if self.free_block_queue.is_cached(block):  # evicted on request while free
            self.free_block_queue.remove(block)
            self.free_block_queue.prepend_n([block])
        entry = self._entries.pop(block.block_id, None)
        if entry is not None:
            self.policy.remove(entry.node)
        return super()._maybe_evict_cached_block(block)

    # -- helpers ---------------------------------------------------------------------------
    def _entry(self, block: KVCacheBlock) -> _Cached:
        """The bookkeeping of `block` under its current hash (renewed if the hash changed)."""
        entry = self._entries.get(block.block_id)
        if entry is not None and entry.node.key == block.block_hash:
            return entry
        if entry is not None:
            self.policy.remove(entry.node)
        num_tokens = block.block_hash_num_tokens or self.hash_block_size
        depth = max(num_tokens // self.hash_block_size - 1, 0)
        # Node.block holds vLLM's block here; the policy never looks at it.
        node = Node(next(self._serials), block.block_hash, (), (), None, block, depth)  # type: ignore[arg-type]
        if self._evicted.pop(block.block_hash, 0) is None:
            self.stats.churn += 1
        self.policy.insert(node)
        entry = self._entries[block.block_id] = _Cached(node)
        return entry

    def _parent_entry(self, entry: _Cached) -> _Cached | None:
        """The parent's bookkeeping, if the parent still holds the hash it had."""
        if entry.parent is None:
            return None
        block_id, block_hash = entry.parent
        parent = self._entries.get(block_id)
        if parent is None or parent.node.key != block_hash:
            return None
        return parent

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
        assert queue.num_free_blocks == sum(
            1 for b in self.blocks if not b.is_null and b.ref_cnt == 0
        )
        children: dict[int, int] = {}
        for block in queue.cached_blocks():
            parent = self._parent_entry(self._entries[block.block_id])
            if parent is not None:
                pid = parent.node.block.block_id  # type: ignore[union-attr]
                children[pid] = children.get(pid, 0) + 1
        for block in queue.cached_blocks():
            entry = self._entries[block.block_id]
            assert entry.free_children == children.get(block.block_id, 0), (
                f"block {block.block_id}: {entry.free_children} free children counted, "
                f"{children.get(block.block_id, 0)} found"
            )
        assert len(self.policy) == sum(
            1 for b in queue.cached_blocks() if self._entries[b.block_id].free_children == 0
        ), "the policy's candidates are not the cached leaves"


def _default_policy() -> EvictionPolicy:
    from kvplug.policies import make_policy

    return make_policy("lru")
