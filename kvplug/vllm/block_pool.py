"""kvplug's block pool for vLLM: vLLM's `BlockPool`, with kvplug choosing what to evict.

`KVPlugBlockPool` keeps vLLM's block objects, hash map, touch and free code, KV events
and metrics collector. It changes two things:

- its free queue is a `kvplug.vllm.free_queue.PolicyFreeQueue`, which hands out blocks
  without a hash first (as vLLM does) and then a victim;
- with every policy but ``lru`` (the pool is *tracked*), each block holding a hash has a
  `CachedBlock` record, the node kvplug's eviction core
  (`kvplug.core.eviction.EvictionCore`, the same one `KVCache` uses) and its policy see.
  The pool tells the core when a record is cached (with the block before it in its
  request's chain, for full-attention groups), released (a request's blocks in one
  call), hit and dropped, and the core names the victim: the policy's lowest-ranked
  *leaf*, so a shared root is evicted after the leaves below it.

**Hybrid models with sliding-window groups** (*anchors*). A hit is the junction every
group serves: at block position a, every full-attention block before a and, in each
sliding-window group, the window of W blocks before a (W = ``cdiv(sliding_window - 1,
block_size)``). vLLM caches every sliding-window block a request computed, but later
requests are served at a few positions only, the *anchors*; a sliding-window record is
marked ``anchored`` when it lies in the window before one:

- a position a lookup was served at (the blocks `touch` reuses are that window);
- a prompt's end, and the longest hit a resend of it can get (vLLM leaves the last token
  to compute), both in `cache_full_blocks`;
- where a request left the cached tree (the full-attention blocks of its prompt cached
  at its first lookup, beyond the hit it got: ``kvplug_branch``, set by the manager);
- the request's end (the manager marks it as the request is freed).

A released sliding-window block that is not anchored is evicted before the policy's
choice, in release order, and is never ranked (no policy learns from it); so is a
full-attention block whose hash another block holds (vLLM caches duplicates: a request
served a shorter junction than the full-attention hit recomputes those blocks), and a
request's blocks after such a copy are recorded below the first copy, so the copies stay
leaves. When a full-attention block goes, a parent left as a leaf whose next position has
an incomplete window in some group serves no junction, and is retired too, up the path.
Evictions still go through vLLM's hand-out path, so KV events stay exact.

With ``lru`` the pool is not tracked (`ReleaseOrderPool`): vLLM's own free queue
evicts the block released longest ago, which is vLLM's own order (fresh blocks first,
then cached blocks least recently released first, a request's tail before its head), so
kvplug reproduces stock vLLM's cache hits exactly. A request holding a block holds every
block before it, and frees them tail first, so in that order a block is released no
earlier than the blocks below it (unless vLLM cached two blocks with one hash; this mode
then still follows vLLM): the leaf rule would change nothing, and no record, ranking,
tree or per-block state is kept. The pool still counts hits, evictions, churn and cached
blocks, exactly as when tracked.

Invariants (checked by `check_invariants`):

- every block other than the null block is held (``ref_cnt > 0``), fresh, or cached,
  never two of these; ``num_free_blocks`` is the number of fresh plus cached blocks;
- a block's key (the hash the pool accounts for) is its current hash, and every cached
  block has one; when tracked, its live record holds that key and is evictable exactly
  while the block is in the queue's cached set;
- when tracked, the policy's candidates are exactly the evictable records that no cached
  record names as its live parent, less the unanchored sliding-window records (evicted
  first, never ranked); when not, the policy has no candidates.
"""

from __future__ import annotations

from collections import OrderedDict, deque
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from itertools import count
from typing import Any

from vllm.v1.core.block_pool import BlockPool
from vllm.v1.core.kv_cache_utils import FreeKVCacheBlockQueue, KVCacheBlock

from kvplug.core.eviction import EvictionCore, live_parent
from kvplug.core.groups import GroupKind
from kvplug.policies.base import EvictionPolicy
from kvplug.policies.lru import LRUPolicy
from kvplug.vllm.free_queue import PolicyFreeQueue
from kvplug.vllm.stats import PoolStats


@dataclass(slots=True)
class Release:
    """What the scheduler knows about the request whose blocks are being freed."""

    output_tokens: int = 0
    request_hit: bool = False


# victims whose position's sliding-window blocks in other groups are retired with them
RETIRING_KINDS = (GroupKind.FULL, GroupKind.SLIDING_WINDOW)


class CachedBlock:
    """One block's record while it holds a hash: a `kvplug.core.eviction.TreeNode`.

    Each physical block has one record, made with the pool and renewed (`reset`, new
    serial) for each hash the block holds, so serving allocates nothing per cached block.
    A record whose block lost its hash has serial -1, so records naming it as parent see
    that the link is dead.
    """

    __slots__ = (
        "serial", "key", "depth", "hits", "from_end", "request_hit", "request_output",
        "block", "parent", "parent_serial", "cached_children", "evictable", "anchored",
    )  # fmt: skip

    def __init__(self, block: KVCacheBlock) -> None:
        self.block = block
        self.parent: CachedBlock | None = None
        self.reset(-1, None, 0)

    def reset(self, serial: int, key: Any, depth: int) -> None:
        """Start a new identity: `serial` (-1: no hash) for the block's hash `key`."""
        self.serial = serial
        self.key = key
        self.depth = depth
        self.hits = 0
        self.from_end = 0
        self.request_hit = False
        self.request_output = 0
        self.parent_serial = -1
        self.cached_children = 0
        self.evictable = False
        self.anchored = False  # sliding window: in the window before some request's anchor


class KVPlugBlockPool(BlockPool):
    """vLLM's `BlockPool` with a kvplug policy deciding evictions (see the module doc).

    Constructed by vLLM's KV cache coordinator with vLLM's own arguments; the policy and
    statistics are attached by `kvplug.vllm.kv_cache_manager.attach_policy` through
    `use_policy` before any request arrives.

    A tracked pool keeps per-block state in lists indexed by block id: ``_keys[i]`` is the
    hash the pool accounts for on block ``i`` (None: none; otherwise the block's current
    hash), and ``_slots[i]`` is its `CachedBlock`, live exactly while ``_keys[i]`` is set
    (a `ReleaseOrderPool` keeps neither). Hot paths read vLLM's ``KVCacheBlock._block_hash``
    slot directly: its ``block_hash`` property costs a Python call per read.
    """

    eviction: EvictionCore[CachedBlock]
    stats: PoolStats
    tracked: bool  # the eviction core ranks every cached block (any policy but exact lru)
    counts_handed_out = False  # evictions counted in get_new_blocks (else by the queue)

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        # vLLM's constructor built its own queue and took the null block from it;
        # `use_policy` sets the queue this pool's policy needs.
        # per-block state of a tracked pool, made by `use_policy` (an lru pool keeps none)
        self._slots: list[CachedBlock] = []  # by block id
        self._keys: list[Any] = []  # by block id
        self._num_keys = 0  # blocks whose _keys entry is set
        self._serials = count()
        self.releasing = Release()
        self._evicted: OrderedDict[Any, None] = OrderedDict()  # recent victims' hashes
        self.use_policy(_default_policy(), PoolStats())

    @property
    def policy(self) -> EvictionPolicy:
        return self.eviction.policy

    def use_policy(
        self,
        policy: EvictionPolicy,
        stats: PoolStats,
        tree_groups: set[int] | None = None,
        group_kinds: Mapping[int, GroupKind] | None = None,
        windows: Mapping[int, int] | None = None,
    ) -> None:
        """Rank with `policy` and count into `stats`. Blocks of the KV cache groups in
        `tree_groups` (full attention: a hit needs every block before it) are evicted
        leaves first; others (sliding window) have no parent. None means every group.

        `group_kinds` (a hybrid model's groups, by id) makes one decision span the groups:
        a hit is the junction every group serves, so when the policy evicts a block, the
        other groups' blocks at the same position that only the junctions it served
        needed are evicted next (`dependents`). `windows` (each sliding-window group's
        window in blocks) turns on the anchor rules of the module doc, with a
        full-attention group.

        kvplug's `LRUPolicy` is vLLM's own order (least recently released first, a
        request's tail first), and in that order a cached child is always released before
        its parent, so the leaf rule never changes its choice: with it the pool keeps no
        records and the queue evicts in release order (``tracked`` is False)."""
        if self._num_keys:
            raise RuntimeError("the policy can only be chosen while nothing is cached")
        policy.bind(self.hash_block_size, self.num_gpu_blocks)
        self.eviction = EvictionCore(policy)
        self.stats = stats
        self.tree_groups = tree_groups
        self.group_kinds = dict(group_kinds or {})
        # dependents to evict next: (record, its serial, the victim's key they depend on)
        self._retiring: deque[tuple[CachedBlock, int, Any]] = deque()
        # sliding-window groups with a known window (blocks a hit needs before it), by
        # group id; with a full-attention group, they turn on the anchor rules (module doc)
        full = {g.to_bytes(4, "big") for g, k in self.group_kinds.items() if k is GroupKind.FULL}
        self.windows = {
            group: window
            for group, window in (windows or {}).items()
            if full and window > 0 and self.group_kinds.get(group) is GroupKind.SLIDING_WINDOW
        }
        self._window_suffixes = {group.to_bytes(4, "big") for group in self.windows}
        self._full_suffixes = full if self.windows else set()
        # released blocks evicted before the policy's choice, in release order (unanchored
        # sliding-window blocks, full-attention copies): (record, its serial)
        self._first: deque[tuple[CachedBlock, int]] = deque()
        self.tracked = type(policy) is not LRUPolicy
        free = [b for b in self.blocks if not b.is_null]  # nothing cached: all held or free
        if self.tracked:
            self.__class__ = KVPlugBlockPool
            self.free_block_queue = PolicyFreeQueue(self, free)
            if not self._slots:
                self._slots = [CachedBlock(block) for block in self.blocks]
                self._keys = [None] * len(self.blocks)
        else:  # vLLM's own queue and order; `ReleaseOrderPool` only counts
            self.__class__ = ReleaseOrderPool
            self.free_block_queue = FreeKVCacheBlockQueue(free)
            self._partial_entries = False  # whether vLLM registered a partial entry

    def num_cached_blocks(self) -> int:
        """Blocks holding a reusable hash, held or free."""
        return self._num_keys

    # -- vLLM's entry points -------------------------------------------------------------
    def touch(self, blocks: Sequence[KVCacheBlock]) -> None:
        """A request reuses `blocks` (prefix hits): count the hit, then take a reference."""
        keys, slots, hit, hits = self._keys, self._slots, self.eviction.hit, 0
        windowed = self._window_suffixes
        for block in blocks:
            key = keys[block.block_id]
            if key is not None and key == block._block_hash:
                hits += 1
                record = slots[block.block_id]
                if windowed and key[-4:] in windowed:  # the window before the junction
                    record.anchored = True
                hit(record)
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
        """Cache blocks as vLLM does, then record each new block below its parent."""
        super().cache_full_blocks(
            request, blocks, num_cached_blocks, num_full_blocks, block_size,
            kv_cache_group_id, block_mask,
        )  # fmt: skip
        keys = self._keys
        tree = self.tree_groups is None or kv_cache_group_id in self.tree_groups
        parent = None
        if tree and num_cached_blocks > 0:
            before = blocks[num_cached_blocks - 1]
            if keys[before.block_id] is not None:
                parent = self._slots[before.block_id]
                if self.windows:
                    parent = self._canonical(parent)
        for i in range(num_cached_blocks, num_full_blocks):
            block = blocks[i]
            if block.is_null or block._block_hash is None:
                parent = None
                continue
            record = self._record(block, parent)
            if not tree:
                parent = None
            elif self.windows:  # a copy's children go below the first copy (module doc)
                parent = self._canonical(record)
            else:
                parent = record
        window = self.windows.get(kv_cache_group_id)
        if window:
            # the prompt's end, and the longest hit a resend of it can get (vLLM leaves
            # its last token to compute), and where it left the cached tree
            ends = (
                request.num_prompt_tokens // block_size,
                (request.num_prompt_tokens - 1) // block_size,
                getattr(request, "kvplug_branch", 0) // block_size,
            )
            for end in ends:
                start = max(end - window, num_cached_blocks)
                self.anchor(blocks[start : min(end, num_full_blocks)])

    def anchor(self, blocks: Sequence[KVCacheBlock]) -> None:
        """`blocks` (one sliding-window group's) lie in the window before an anchor: a
        position a later request is likely served at. Released, they are ranked by the
        policy; other released sliding-window blocks are evicted first."""
        keys, slots = self._keys, self._slots
        for block in blocks:
            key = keys[block.block_id]
            if key is not None and key == block._block_hash:
                slots[block.block_id].anchored = True

    def get_new_blocks(self, num_blocks: int) -> list[KVCacheBlock]:
        """vLLM's `get_new_blocks`, with `_maybe_evict_cached_block` and
        `_remove_cached_block_hashes` inlined for the blocks handed out: the same effects
        (hash map, block hashes, collector calls, KV events) in fewer Python calls, which
        pays for kvplug's bookkeeping. (`kvplug.vllm.version` pins the vLLM versions this
        copy is checked against.)"""
        if num_blocks > self.get_num_free_blocks():
            raise ValueError(f"Cannot get {num_blocks} free blocks from the pool")
        taken: list[KVCacheBlock] = self.free_block_queue.popleft_n(num_blocks)
        if self._reuse_watchers:
            self._notify_reuse(taken)
        caching, collector = self.enable_caching, self.metrics_collector
        hash_map, extra_hashes = self.cached_block_hash_to_block, self.cached_block_hashes_by_block
        events = self.enable_kv_cache_events
        evicted, evictions, counting = self._evicted, 0, self.counts_handed_out
        for block in taken:
            if caching:
                if collector:
                    collector.on_block_evicted(block)
                key = block._block_hash
                if key is not None:
                    block_id = block.block_id
                    removed = [key] if hash_map.pop(key, block_id) is not None else []
                    if extra_hashes:
                        for other in extra_hashes.pop(block_id, ()):
                            if hash_map.pop(other, block_id) is not None:
                                removed.append(other)
                    block._block_hash = None  # block.reset_hash()
                    block._block_hash_num_tokens = None
                    if events and removed:
                        self._emit_block_removed_events(removed)
                    if counting:  # a tracked pool counted its victims as it chose them
                        evicted[key] = None
                        evictions += 1
            assert block.ref_cnt == 0
            block.ref_cnt += 1
            if collector:
                collector.on_block_allocated(block)
        if evictions:
            self._num_keys -= evictions
            self.stats.evictions += evictions
            while len(evicted) > self.num_gpu_blocks:
                evicted.popitem(last=False)
        return taken

    def reset_prefix_cache(self) -> bool:
        if not super().reset_prefix_cache():
            return False
        self.free_block_queue.make_all_fresh()
        for block in self.blocks:
            if self._keys[block.block_id] is not None:
                self._forget(block)
        return True

    def _maybe_evict_cached_block(self, block: KVCacheBlock) -> bool:
        """vLLM drops a block's hashes when it is handed out or evicted on request."""
        if self._keys[block.block_id] is not None:
            queue = self.free_block_queue
            if queue.is_cached(block):  # evicted on request while free: fresh from now on
                queue.remove(block)
                queue.prepend_n([block])
            self._forget(block)
        return super()._maybe_evict_cached_block(block)

    # -- called by PolicyFreeQueue ------------------------------------------------------
    def on_free_n(self, released: list[tuple[int, KVCacheBlock]]) -> None:
        """Blocks (with a hash) lost their last holder, each with its `from_end` (blocks
        of the releasing request after it): rank them and offer them for eviction."""
        keys = self._keys
        slots, release_n = self._slots, self.eviction.release_n
        records: list[CachedBlock] = []
        request_hit = self.releasing.request_hit
        output_tokens = self.releasing.output_tokens
        windowed, full, first = self._window_suffixes, self._full_suffixes, self._first
        unranked: list[CachedBlock] = []  # evicted first, and never ranked
        for from_end, block in released:
            if keys[block.block_id] == block._block_hash:
                record = slots[block.block_id]
            else:  # a hash not cached through cache_full_blocks: record it now
                if records:  # rank the blocks before it first, as one at a time would
                    release_n(records)
                    records = []
                record = self._record(block, None)
            record.from_end = from_end
            record.request_hit = request_hit
            record.request_output = output_tokens
            if windowed:
                group = record.key[-4:]
                if group in windowed and not record.anchored:
                    first.append((record, record.serial))
                    unranked.append(record)
                    continue
                if group in full and self._cached_elsewhere(record.key, block.block_id):
                    first.append((record, record.serial))  # a copy: the other one serves
            records.append(record)
        if records:
            release_n(records)
        if unranked:
            self.eviction.release_unranked(unranked)

    def on_unfree(self, block: KVCacheBlock) -> None:
        """`block` left the queue's cached set without being evicted (a prefix hit)."""
        self.eviction.reclaim(self._slots[block.block_id])

    def evict_n(self, n: int) -> list[KVCacheBlock]:
        """`evict_next` `n` times (the queue holds that many cached blocks): the eviction
        core's victims in order, forgotten. Without a hybrid model's rules, the core
        removes each victim as it names it (`EvictionCore.pop_victim`)."""
        if self.group_kinds:
            taken: list[KVCacheBlock] = []
            for _ in range(n):
                taken.append(self.evict_next(taken))
            return taken
        pop_victim, keys = self.eviction.pop_victim, self._keys
        victims: list[KVCacheBlock] = []
        popped = 0
        for _ in range(n):
            record = pop_victim()
            if record is None:  # unreachable while the child counts are exact
                block = self.free_block_queue.any_cached(victims)
                self._forget(block)
            else:
                block = record.block
                record.serial = -1  # `_forget`, less the core's part, which is done
                keys[block.block_id] = None
                popped += 1
            victims.append(block)
        self._num_keys -= popped
        return victims

    def evict_next(self, taken: Sequence[KVCacheBlock] = ()) -> KVCacheBlock:
        """Forget the eviction core's next victim (its hash goes when vLLM hands the block
        out) and return its block, never one of `taken` (victims already chosen with it);
        the queue then calls `on_evicted`. Tracked only."""
        retiring, is_candidate = self._retiring, self.eviction.is_candidate
        while retiring:
            record, serial, needed = retiring.popleft()
            # still dead: the victim's block was not cached again since (vLLM's map keeps
            # the victim itself until it is handed out; the pool forgot it already)
            if self._is_cached(needed):
                continue
            if record.serial == serial and is_candidate(record):
                block: KVCacheBlock = record.block
                self.stats.retired += 1
                if record.key[-4:] in self._full_suffixes:  # a dead leaf: its path's turn
                    retiring.extend(self.dependents(record))
                    self._retire_dead_parent(record)
                self._forget(block)
                return block
        first = self._first
        while first:
            record, serial = first.popleft()
            if record.serial != serial or not is_candidate(record):
                continue
            if record.key[-4:] in self._full_suffixes:
                if not self._cached_elsewhere(record.key, record.block.block_id):
                    continue  # the other copy went first: this one is ranked
            elif record.anchored:
                continue
            block = record.block
            self._forget(block)
            return block
        victim = self.eviction.next_victim()
        if victim is not None:
            block = victim.block
            if self.group_kinds:
                retiring.extend(self.dependents(victim))
                if victim.key[-4:] in self._full_suffixes:
                    self._retire_dead_parent(victim)
        else:  # unreachable while the child counts are exact; never strand a free block
            block = self.free_block_queue.any_cached(taken)
        self._forget(block)
        return block

    def _retire_dead_parent(self, victim: CachedBlock) -> None:
        """When full-attention `victim` goes, its parent may become a leaf that ends a
        path no junction can use (the window before the position after it is missing
        in some sliding-window group): retire it too, which cascades up the path."""
        parent = live_parent(victim)
        if parent is None or parent.cached_children != 1 or not parent.evictable:
            return
        hashes, node = [], parent
        for _ in range(min(max(self.windows.values()), parent.depth + 1)):
            if node is None:
                return  # cannot tell
            hashes.append(node.key[:-4])
            node = live_parent(node)
        for group, window in self.windows.items():
            suffix = group.to_bytes(4, "big")
            if not all(self._is_cached(position + suffix) for position in hashes[:window]):
                self._retiring.append((parent, parent.serial, victim.key))
                return

    def dependents(self, victim: CachedBlock) -> list[tuple[CachedBlock, int, Any]]:
        """Evictable blocks of other groups at `victim`'s position that serve no junction
        once it is gone, with their serials and the victim's key (a dependent is evicted
        only while that key is not cached again).

        A junction at position p needs every full-attention block before p and the window
        of sliding-window blocks before p, in every group. So when a full-attention block
        (a leaf) or one group's sliding-window block goes, the other sliding-window groups'
        blocks at that position serve no junction. A full-attention block is never a
        dependent (deeper junctions need it; `_retire_dead_parent` retires one that no
        junction can use); with the anchor rules, a victim whose hash another block holds
        has none. Mamba states are not retired this way: on the Mamba preset of the hybrid
        replay it cost saved compute (the policy then relearns their reuse from ghosts it
        would not otherwise see); see the README."""
        key = victim.key
        kinds = self.group_kinds
        if kinds.get(int.from_bytes(key[-4:], "big")) not in RETIRING_KINDS:
            return []
        if self.windows and self._cached_elsewhere(key, victim.block.block_id):
            return []  # another copy still serves the position
        position = key[:-4]
        lookup, keys, slots = self.cached_block_hash_to_block.get_one_block, self._keys, self._slots
        found = []
        for group, kind in kinds.items():
            if kind is not GroupKind.SLIDING_WINDOW:
                continue
            other = position + group.to_bytes(4, "big")
            if other == key:
                continue
            block = lookup(other)
            if block is not None and keys[block.block_id] == other:
                record = slots[block.block_id]
                if record.evictable:
                    found.append((record, record.serial, key))
        return found

    def on_evicted(self, blocks: list[KVCacheBlock]) -> None:
        """The queue evicted `blocks` (their hashes go when vLLM hands them out): forget
        them (`evict_next` did), count them and remember their hashes, for churn."""
        self.stats.evictions += len(blocks)
        evicted = self._evicted
        for block in blocks:
            evicted[block._block_hash] = None
        while len(evicted) > self.num_gpu_blocks:
            evicted.popitem(last=False)

    # -- helpers ---------------------------------------------------------------------------
    def _canonical(self, record: CachedBlock) -> CachedBlock:
        """The record vLLM's map names first for `record`'s key (vLLM caches duplicates):
        a request that recomputed cached blocks continues below the first copy, so its
        own copies stay leaves."""
        block = self.cached_block_hash_to_block.get_one_block(record.key)
        if block is None or block is record.block or self._keys[block.block_id] != record.key:
            return record
        return self._slots[block.block_id]

    def _is_cached(self, key: Any) -> bool:
        """Whether a block holds `key` as the pool accounts for it (vLLM's map keeps a
        victim's hash until the block is handed out)."""
        block = self.cached_block_hash_to_block.get_one_block(key)
        if block is None:
            return False
        return self._keys[block.block_id] == key or self._cached_elsewhere(key, block.block_id)

    def _cached_elsewhere(self, key: Any, block_id: int) -> bool:
        """Whether a block other than `block_id` holds `key` (vLLM caches duplicates; its
        map holds them in a dict by block id)."""
        blocks = self.cached_block_hash_to_block._cache.get(key)
        if not isinstance(blocks, dict):
            return False
        keys = self._keys
        return any(i != block_id and keys[i] == key for i in blocks)

    def _adopt(self, block: KVCacheBlock, key: Any) -> None:
        """`block` holds `key`, which the pool does not account for yet: count it."""
        if self._keys[block.block_id] is not None:  # the block holds another hash now
            self._forget(block)
        if self._evicted.pop(key, 0) is None:
            self.stats.churn += 1
        self._keys[block.block_id] = key
        self._num_keys += 1

    def _record(self, block: KVCacheBlock, parent: CachedBlock | None) -> CachedBlock:
        """The record of `block` under its current hash, made below `parent` if new."""
        key = block._block_hash
        record = self._slots[block.block_id]
        if self._keys[block.block_id] == key:
            return record
        self._adopt(block, key)
        size = self.hash_block_size
        depth = (block._block_hash_num_tokens or size) // size - 1
        record.reset(next(self._serials), key, depth if depth > 0 else 0)
        self.eviction.insert(record, parent)
        return record

    def _forget(self, block: KVCacheBlock) -> None:
        """`block` no longer holds the hash the pool accounts for: it leaves the eviction
        core (tracked) and the pool's count."""
        record = self._slots[block.block_id]
        self.eviction.remove(record)
        record.serial = -1  # records that name it as parent see a dead link
        self._keys[block.block_id] = None
        self._num_keys -= 1

    def check_invariants(self) -> None:
        """Raise AssertionError if a module-level invariant does not hold."""
        queue = self.free_block_queue
        for block in self.blocks:
            if block.is_null:
                continue
            states = [block.ref_cnt > 0, queue.is_fresh(block), queue.is_cached(block)]
            assert sum(states) == 1, f"block {block.block_id}: held/fresh/cached = {states}"
            key = self._keys[block.block_id]
            if key is not None:
                assert key == block.block_hash, f"block {block.block_id}: stale key"
                record = self._slots[block.block_id]
                assert record.key == key, f"block {block.block_id}: stale record"
                assert record.evictable == queue.is_cached(block), block.block_id
            else:
                assert not queue.is_cached(block), f"block {block.block_id}: cached, no key"
        assert queue.num_free_blocks == sum(
            1 for b in self.blocks if not b.is_null and b.ref_cnt == 0
        )
        assert self._num_keys == sum(1 for key in self._keys if key is not None)
        records = [self._slots[i] for i, key in enumerate(self._keys) if key is not None]
        children: dict[int, int] = {}
        for record in records:
            parent = live_parent(record)
            if parent is not None:
                children[parent.serial] = children.get(parent.serial, 0) + 1
        leaves = 0
        for record in records:
            found = children.get(record.serial, 0)
            assert record.cached_children == found, (
                f"block {record.block.block_id}: {record.cached_children} cached children "
                f"counted, {found} found"
            )
            unranked = record.key[-4:] in self._window_suffixes and not record.anchored
            leaves += record.evictable and found == 0 and not unranked
        assert len(self.policy) == leaves, "the policy's candidates are not the cached leaves"


class ReleaseOrderPool(KVPlugBlockPool):
    """The pool with kvplug's ``lru``: vLLM's own free queue and code, kvplug counting.

    kvplug's lru is vLLM's order (see the module doc), so this pool ranks nothing and
    keeps no per-block record: it is vLLM's `BlockPool` with its `FreeKVCacheBlockQueue`,
    counting hits, evictions, churn and cached blocks as a tracked pool does (a test
    checks them against tracked lru, operation by operation). `use_policy` makes a pool
    this class for `LRUPolicy`, and a `KVPlugBlockPool` again for any other policy.

    Its evictions are counted as `get_new_blocks` hands the blocks out
    (`counts_handed_out`): a wrapper of `_maybe_evict_cached_block` would cost a call for
    every block.
    """

    counts_handed_out = True

    def touch(self, blocks: Sequence[KVCacheBlock]) -> None:
        self.stats.block_hits += sum(1 for block in blocks if block._block_hash is not None)
        BlockPool.touch(self, blocks)

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
        """vLLM's, then the new hashes counted. Until vLLM registers a partial entry (a
        hash for part of a block, see `cache_partial_block`), the blocks being cached hold
        no hash yet, so no before-state is needed."""
        new = blocks[num_cached_blocks:num_full_blocks]
        before = [b._block_hash for b in new] if self._partial_entries else None
        BlockPool.cache_full_blocks(
            self, request, blocks, num_cached_blocks, num_full_blocks, block_size,
            kv_cache_group_id, block_mask,
        )  # fmt: skip
        evicted = self._evicted
        if before is None:
            keys = [key for b in new if (key := b._block_hash) is not None]
            self._num_keys += len(keys)
            pop = evicted.pop
            # a key popped from the recent victims is cached again after an eviction
            self.stats.churn += sum(1 for key in keys if pop(key, 0) is None)
            return
        cached = churn = 0
        for block, old in zip(new, before, strict=True):
            key = block._block_hash
            if key is not None and key != old:
                cached += old is None
                if evicted.pop(key, 0) is None:
                    churn += 1
        self._num_keys += cached
        self.stats.churn += churn

    def cache_partial_block(self, *args: Any, **kwargs: Any) -> Any:
        """vLLM's; a block that gets its first hash this way is counted as cached."""
        block: KVCacheBlock = kwargs["block"] if "block" in kwargs else args[1]
        old = block._block_hash
        key = BlockPool.cache_partial_block(self, *args, **kwargs)
        self._partial_entries = True
        if old is None and block._block_hash is not None:
            self._num_keys += 1
            if self._evicted.pop(block._block_hash, 0) is None:
                self.stats.churn += 1
        return key

    def reset_prefix_cache(self) -> bool:
        if not BlockPool.reset_prefix_cache(self):
            return False
        self._num_keys = 0
        return True

    def _maybe_evict_cached_block(self, block: KVCacheBlock) -> bool:
        """Evicted on request (a KV connector): not counted as an eviction."""
        self._num_keys -= block._block_hash is not None
        return BlockPool._maybe_evict_cached_block(self, block)

    def check_invariants(self) -> None:
        """Raise AssertionError if an invariant of the module doc does not hold."""
        free = {block.block_id for block in self.free_block_queue.get_all_free_blocks()}
        for block in self.blocks:
            if not block.is_null:
                held = block.ref_cnt > 0
                assert held != (block.block_id in free), f"block {block.block_id}: held and free"
        assert self.free_block_queue.num_free_blocks == len(free)
        assert self._num_keys == sum(1 for b in self.blocks if b._block_hash is not None)
        assert len(self.policy) == 0, "lru ranks nothing in the pool"


def _default_policy() -> EvictionPolicy:
    from kvplug.policies import make_policy

    return make_policy("lru")
