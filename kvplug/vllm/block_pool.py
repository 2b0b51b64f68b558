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

**Hybrid models with a sliding-window group.** A hit is the junction every group serves,
so one eviction can retire other groups' blocks, and sliding-window blocks no later
request is likely served at (not *anchored*) are evicted first: the *hybrid rules* of
`kvplug.vllm.anchors` (`HybridRules`, which a tracked pool owns, ``rules``, and calls at
its hook points). Evictions still go through vLLM's hand-out path, so KV events stay
exact.

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
  record names as its live parent, less those the hybrid rules release unranked
  (unanchored sliding-window records, evicted first); when not, the policy has no
  candidates. The hybrid rules' own invariants are in `kvplug.vllm.anchors`.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from itertools import count
from typing import Any, ClassVar

from vllm.v1.core.block_pool import BlockPool
from vllm.v1.core.kv_cache_utils import FreeKVCacheBlockQueue, KVCacheBlock

from kvplug.core.dense import (
    VictimHistory,
    count_keyed,
    count_new_keys,
    held_by_another,
    keys_of,
    recent_sampling,
)
from kvplug.core.eviction import EvictionCore, live_parent
from kvplug.core.groups import GroupKind
from kvplug.errors import ConfigError
from kvplug.policies import make_policy
from kvplug.policies.base import EvictionPolicy, RankedPolicy
from kvplug.vllm.anchors import FULL, OTHER, WINDOW, BlockNodes, HybridRules
from kvplug.vllm.free_queue import PolicyFreeQueue
from kvplug.vllm.stats import PoolStats


@dataclass(slots=True)
class Release:
    """What the scheduler knows about the request whose blocks are being freed."""

    output_tokens: int = 0
    request_hit: bool = False
    session: bool = False  # it named a session (`kvplug.core.sessions`)


@dataclass(frozen=True, slots=True)
class BlockStanding:
    """What a tracked pool knows of one cached block: whether it is evictable, whether
    another tier holds a copy, its hits since it was cached, the output length of the
    request that released it last, and its rank at that release (None: not ranked)."""

    evictable: bool
    held_elsewhere: bool
    hits: int
    request_output: int
    rank: float | None


class CachedBlock:
    """One block's record while it holds a hash: a `kvplug.core.eviction.TreeNode`.

    Each physical block has one record, made with the pool and renewed (`reset`, new
    serial) for each hash the block holds, so serving allocates nothing per cached block.
    A record whose block lost its hash has serial -1, so records naming it as parent see
    that the link is dead.
    """

    __slots__ = (
        "serial", "key", "depth", "hits", "from_end", "request_hit", "request_output",
        "request_session", "held_elsewhere",
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
        self.request_session = False
        self.held_elsewhere = False
        self.parent_serial = -1
        self.cached_children = 0
        self.evictable = False
        self.anchored = False  # sliding window: before an anchor (`kvplug.vllm.anchors`)


class RecordNodes(BlockNodes):
    """The record pool's eviction state by block id (`kvplug.vllm.anchors.BlockNodes`):
    each block's `CachedBlock` and the generic eviction core, for the hybrid rules."""

    def __init__(
        self, slots: list[CachedBlock], eviction: EvictionCore[CachedBlock], keys: list[Any]
    ) -> None:
        self._slots = slots
        self._eviction = eviction
        self._keys = keys  # the pool's, by block id
        self._first: deque[tuple[int, int, bool]] = deque()  # (block id, serial, copy)

    def serial_of(self, node: int) -> int:
        return self._slots[node].serial

    def is_evictable(self, node: int) -> bool:
        return self._slots[node].evictable

    def is_candidate(self, node: int) -> bool:
        record = self._slots[node]
        return record.evictable and record.cached_children == 0

    def live_parent(self, node: int) -> int:
        parent = live_parent(self._slots[node])
        return -1 if parent is None else parent.block.block_id

    def cached_children(self, node: int) -> int:
        return self._slots[node].cached_children

    def depth_of(self, node: int) -> int:
        return self._slots[node].depth

    def is_anchored(self, node: int) -> bool:
        return self._slots[node].anchored

    def anchor_blocks(self, blocks: Sequence[KVCacheBlock], group_classes: bytes) -> None:
        slots = self._slots
        for block in blocks:
            record = slots[block.block_id]
            key = block._block_hash
            if record.serial >= 0 and key is not None and record.key == key:
                group = int.from_bytes(key[-4:], "big")
                if group < len(group_classes) and group_classes[group] == WINDOW:
                    record.anchored = True

    def release_ranked(self, nodes: list[int]) -> None:
        slots = self._slots
        self._eviction.release_n([slots[node] for node in nodes])

    def release_unranked(self, nodes: list[int]) -> None:
        slots = self._slots
        self._eviction.release_unranked([slots[node] for node in nodes])

    def next_victim(self) -> int:
        victim = self._eviction.next_victim()
        return -1 if victim is None else victim.block.block_id

    def release_hybrid(
        self, nodes: list[int], group_classes: bytes, copies: tuple[dict[Any, Any], bool]
    ) -> None:
        slots, first, keys = self._slots, self._first, self._keys
        ranked: list[CachedBlock] = []
        unranked: list[CachedBlock] = []  # evicted first, and never ranked
        for node in nodes:
            record = slots[node]
            group = int.from_bytes(record.key[-4:], "big")
            kind = group_classes[group] if group < len(group_classes) else OTHER
            if kind == WINDOW and not record.anchored:
                first.append((node, record.serial, False))
                unranked.append(record)
                continue
            if kind == FULL and held_by_another(copies, keys, keys[node], node):
                first.append((node, record.serial, True))  # a copy: the other one serves
            ranked.append(record)
        if ranked:
            self._eviction.release_n(ranked)
        if unranked:
            self._eviction.release_unranked(unranked)

    def queue_first(self, node: int, copy: bool) -> None:
        first, slots = self._first, self._slots
        if len(first) > 2 * len(slots) + 64:  # drop what can never go first, as the dense core
            kept = [
                (n, serial, c)
                for n, serial, c in first
                if slots[n].serial == serial and (c or not slots[n].anchored)
            ]
            first.clear()
            first.extend(kept)
        first.append((node, slots[node].serial, copy))

    def first_entries(self) -> list[tuple[int, int, bool]]:
        return list(self._first)

    def next_first(self, copies: tuple[dict[Any, Any], bool]) -> int:
        first, slots, keys = self._first, self._slots, self._keys
        while first:
            node, serial, copy = first.popleft()
            record = slots[node]
            if record.serial != serial or not record.evictable or record.cached_children:
                continue
            if held_by_another(copies, keys, keys[node], node) if copy else not record.anchored:
                return node
        return -1


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
    # the eviction core ranks every cached block (a policy not in release order)
    tracked: ClassVar[bool] = True
    rules: HybridRules | None  # a tracked hybrid pool's cross-group and anchor rules
    counts_handed_out = False  # evictions counted in get_new_blocks (else by the queue)
    touch_counts_hits = True  # kvplug's manager: True only while vLLM takes a prefix hit

    def __init__(self, *args: Any, policy: EvictionPolicy | None = None, **kwargs: Any) -> None:
        """vLLM's arguments, and the policy the pool serves (`pool_class` chose the class
        for it; default: the class's own, ``lru`` or ``cost``)."""
        super().__init__(*args, **kwargs)
        # vLLM's constructor built its own queue and took the null block from it;
        # `use_policy` sets the queue this pool's policy needs.
        # per-block state of a tracked pool, made by `use_policy` (an lru pool keeps none)
        self._slots: list[CachedBlock] = []  # by block id
        self._keys: list[Any] = []  # by block id
        self._num_keys = 0  # blocks whose _keys entry is set
        # free cached blocks another tier took (touched outside allocate_slots) to copy
        self._tier_copies: set[int] = set()
        self._serials = count()
        self.releasing = Release()
        # the latest num_gpu_blocks victims' hashes, for churn: an ordered mapping whose
        # values are None, of a sample of the keys in a large pool, each key found
        # counting the record's weight (a dense pool's is its core's, beside the ghosts)
        self._evicted: VictimHistory = VictimHistory(0, *recent_sampling(self.num_gpu_blocks))
        self.use_policy(policy or make_policy("lru" if not self.tracked else "cost"), PoolStats())

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

        `group_kinds` (a hybrid model's groups, by id) and `windows` (each sliding-window
        group's window in blocks) are the hybrid rules' (`kvplug.vllm.anchors`): a tracked
        pool with a sliding-window group gets a `HybridRules` (``rules``), others None.

        A policy in release order (kvplug's `LRUPolicy`: vLLM's own order, least recently
        released first, a request's tail first) releases a cached child before its
        parent, so the leaf rule never changes its choice: it runs on a `ReleaseOrderPool`,
        which keeps no records (``tracked`` is False). The pool's class must fit the
        policy (`pool_class`)."""
        if self._num_keys:
            raise RuntimeError("the policy can only be chosen while nothing is cached")
        if policy.release_order == self.tracked:
            raise TypeError(
                f"{type(self).__name__} cannot serve policy {policy.name!r}: build the pool "
                f"as pool_class(policy), {pool_class(policy).__name__}"
            )
        policy.bind(self.hash_block_size, self.num_gpu_blocks)
        self.eviction = EvictionCore(policy)
        self.stats = stats
        self.tree_groups = tree_groups
        self.group_kinds = dict(group_kinds or {})
        self.rules = None
        free = [b for b in self.blocks if not b.is_null]  # nothing cached: all held or free
        if self.tracked:
            self.free_block_queue = PolicyFreeQueue(self, free)
            if not self._slots:
                self._slots = [CachedBlock(block) for block in self.blocks]
                self._keys = [None] * len(self.blocks)
            # without a sliding-window group no victim retires anything (module doc there)
            if GroupKind.SLIDING_WINDOW in self.group_kinds.values():
                nodes = RecordNodes(self._slots, self.eviction, self._keys)
                self.rules = HybridRules(self, nodes, self.group_kinds, windows or {})
        else:  # vLLM's own queue and order; `ReleaseOrderPool` only counts
            self.free_block_queue = FreeKVCacheBlockQueue(free)
            self._partial_entries = False  # whether vLLM registered a partial entry

    def num_cached_blocks(self) -> int:
        """Blocks holding a reusable hash, held or free."""
        return self._num_keys

    def standing(self, block: KVCacheBlock) -> BlockStanding | None:
        """What the pool knows of `block` under its current hash (None: it holds none the
        pool accounts for). A tracked pool only."""
        if self._keys[block.block_id] is None:
            return None
        record = self._slots[block.block_id]
        policy = self.policy
        ranked = isinstance(policy, RankedPolicy) and policy.has_rank(record)
        return BlockStanding(
            record.evictable,
            record.held_elsewhere,
            record.hits,
            record.request_output,
            policy.rank_of(record) if ranked else None,
        )

    def protect_n(self, block_ids: list[int], levels: list[int]) -> None:
        """Give each cached block of `block_ids` its protection level (0: none): a waiting
        request will hit it (`kvplug.vllm.queue_protection`). A block holding no hash the
        pool accounts for is skipped."""
        keys, slots = self._keys, self._slots
        nodes, kept = [], []
        for block_id, level in zip(block_ids, levels, strict=True):
            if keys[block_id] is not None:
                nodes.append(slots[block_id])
                kept.append(level)
        self.eviction.protect_n(nodes, kept)

    def num_protected(self) -> int:
        """Cached blocks a waiting request claims."""
        return self.eviction.num_protected

    # -- vLLM's entry points -------------------------------------------------------------
    def touch(self, blocks: Sequence[KVCacheBlock]) -> None:
        """Take a reference to `blocks`; a request reusing them (prefix hits, taken inside
        the call kvplug's manager wraps, or any touch of a pool used without kvplug's manager)
        counts a hit first. Another tier copying them out only holds them: a free cached
        block it takes keeps its standing when the tier frees it (`on_free_n`)."""
        if not self.touch_counts_hits:
            keys, copies = self._keys, self._tier_copies
            for block in blocks:
                if block.ref_cnt == 0 and keys[block.block_id] is not None:
                    copies.add(block.block_id)
            super().touch(blocks)
            return
        keys, slots, copies = self._keys, self._slots, self._tier_copies
        hit: list[CachedBlock] = []
        for block in blocks:
            key = keys[block.block_id]
            if key is not None and key == block._block_hash:
                hit.append(slots[block.block_id])
                if copies:
                    copies.discard(block.block_id)  # a use: ranked anew when released
        if hit:
            self.eviction.hit_n(hit)
            self.stats.block_hits += len(hit)
        if self.rules is not None:
            self.rules.on_touch(blocks)
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
        if num_cached_blocks >= num_full_blocks:  # vLLM's own no-op, made per request
            return
        super().cache_full_blocks(
            request, blocks, num_cached_blocks, num_full_blocks, block_size,
            kv_cache_group_id, block_mask,
        )  # fmt: skip
        keys, rules = self._keys, self.rules
        # with anchors, a copy's children go below the first copy (`kvplug.vllm.anchors`)
        canonical = rules.canonical if rules is not None and rules.windows else None
        tree = self.tree_groups is None or kv_cache_group_id in self.tree_groups
        parent = None
        if tree and num_cached_blocks > 0:
            before = blocks[num_cached_blocks - 1]
            if keys[before.block_id] is not None:
                parent = self._slots[before.block_id]
                if canonical is not None:
                    parent = self._slots[canonical(before.block_id)]
        if tree and canonical is None:
            self._record_chain(blocks, num_cached_blocks, num_full_blocks, parent)
        else:
            for i in range(num_cached_blocks, num_full_blocks):
                block = blocks[i]
                if block.is_null or block._block_hash is None:
                    parent = None
                    continue
                record = self._record(block, parent)
                if not tree:
                    parent = None
                elif canonical is not None:
                    parent = self._slots[canonical(block.block_id)]
                else:
                    parent = record
        if rules is not None:
            rules.on_cached(
                request, blocks, num_cached_blocks, num_full_blocks, block_size,
                kv_cache_group_id,
            )  # fmt: skip

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
        return taken

    def reset_prefix_cache(self) -> bool:
        if not super().reset_prefix_cache():
            return False
        self.free_block_queue.make_all_fresh()
        for block in self.blocks:
            if self._keys[block.block_id] is not None:
                self.forget(block)
        return True

    def _maybe_evict_cached_block(self, block: KVCacheBlock) -> bool:
        """vLLM drops a block's hashes when it is handed out or evicted on request."""
        if self._keys[block.block_id] is None:
            return super()._maybe_evict_cached_block(block)
        queue = self.free_block_queue
        free = queue.is_cached(block)
        if free:  # evicted on request while free: fresh from now on
            queue.remove(block)
        self.forget(block)
        evicted = super()._maybe_evict_cached_block(block)
        if free:  # its hash is gone now, so it goes back as a fresh block
            queue.prepend_n([block])
        return evicted

    def cache_partial_block(self, *args: Any, **kwargs: Any) -> Any:
        """vLLM's (0.34+): a partial entry may give `block` its first hash, or replace its
        hashes; the pool then accounts for its current one."""
        block: KVCacheBlock = kwargs["block"] if "block" in kwargs else args[1]
        key = super().cache_partial_block(*args, **kwargs)
        self._sync_keys((block,))
        return key

    def move_block_hashes(self, src_block: KVCacheBlock, dst_block: KVCacheBlock) -> None:
        """vLLM's (0.34+, copy-on-write): `src_block`'s hashes move to its private copy."""
        super().move_block_hashes(src_block, dst_block)
        self._sync_keys((src_block, dst_block))

    def _sync_keys(self, blocks: Iterable[KVCacheBlock]) -> None:
        """vLLM changed the hashes of `blocks` outside `cache_full_blocks`: account for
        each block's current hash (a new one as a record with no parent: vLLM names none)
        and, for a free block, move it to the set of free blocks its hash puts it in."""
        queue = self.free_block_queue
        for block in blocks:
            key = block._block_hash
            if block.is_null or self._keys[block.block_id] == key:
                continue
            free = queue.is_cached(block) or queue.is_fresh(block)
            if free:
                queue.remove(block)
            if key is None:
                self.forget(block)
            else:
                self._record(block, None)
            if free:
                queue.append_n([block])

    # -- called by PolicyFreeQueue ------------------------------------------------------
    def on_free_n(
        self, released: list[tuple[int, KVCacheBlock]], held_elsewhere: bool = False
    ) -> None:
        """Blocks (with a hash) lost their last holder, each with its `from_end` (blocks
        of the releasing request after it): rank them and offer them for eviction; with
        `held_elsewhere`, as blocks another tier holds (vLLM's ``evict_first``)."""
        keys, slots, rules = self._keys, self._slots, self.rules
        copies = self._tier_copies
        if copies and not held_elsewhere:
            # a tier gave back what it took while free (its copy is done, or abandoned):
            # the hold was no use, so those blocks keep their standing (vLLM 0.32 and
            # 0.33's lazy offloader frees them without evict_first)
            returned = [item for item in released if item[1].block_id in copies]
            if returned:
                released = [item for item in released if item[1].block_id not in copies]
                self._restore(returned)
        # a hybrid pool's rules rank some released blocks, and queue some to go first
        release_n = self.eviction.release_n if rules is None else self._release_by_rules
        if held_elsewhere and rules is None:
            # a tier's copy held them, not a request: they keep their last release's
            # standing (and what it knew), lowered to a reload's price
            release_n = self.eviction.restore_n
        records: list[CachedBlock] = []
        request_hit = self.releasing.request_hit
        output_tokens = self.releasing.output_tokens
        session = self.releasing.session
        for from_end, block in released:
            if copies:
                copies.discard(block.block_id)
            if keys[block.block_id] == block._block_hash:
                record = slots[block.block_id]
            else:  # a hash not cached through cache_full_blocks: record it now
                if records:  # rank the blocks before it first, as one at a time would
                    release_n(records)
                    records = []
                record = self._record(block, None)
            if held_elsewhere:
                if not record.held_elsewhere:
                    self.eviction.held_elsewhere(record)  # not evictable yet: sets the flag
            else:
                record.from_end = from_end
                record.request_hit = request_hit
                record.request_output = output_tokens
                record.request_session = session
            records.append(record)
        if records:
            release_n(records)

    def _release_by_rules(self, records: list[CachedBlock]) -> None:
        assert self.rules is not None
        self.rules.release_n([record.block.block_id for record in records])

    def _restore(self, returned: list[tuple[int, KVCacheBlock]]) -> None:
        """Blocks a tier took while free and gave back: evictable again with the standing
        of their last release (`EvictionCore.restore_n`); a block whose hash changed
        meanwhile, and any block of a hybrid pool (whose rules rank releases), is
        released anew."""
        keys, slots, copies = self._keys, self._slots, self._tier_copies
        kept: list[CachedBlock] = []
        anew: list[tuple[int, KVCacheBlock]] = []
        for item in returned:
            block = item[1]
            copies.discard(block.block_id)
            if self.rules is None and keys[block.block_id] == block._block_hash:
                kept.append(slots[block.block_id])
            else:
                anew.append(item)
        if kept:
            self.eviction.restore_n(kept)
        if anew:
            self.on_free_n(anew)

    def mark_held_elsewhere(self, blocks: Iterable[KVCacheBlock]) -> None:
        """Another tier holds a copy of `blocks` (a connector loaded them from there):
        those cached here are valued as a reload from now on, until their hash goes."""
        if not self.tracked:
            return
        keys, slots, core = self._keys, self._slots, self.eviction
        for block in blocks:
            if keys[block.block_id] is not None and keys[block.block_id] == block._block_hash:
                core.held_elsewhere(slots[block.block_id])

    def on_unfree(self, block: KVCacheBlock) -> None:
        """`block` left the queue's cached set without being evicted (a prefix hit)."""
        self.eviction.reclaim(self._slots[block.block_id])

    def evict_n(self, n: int) -> list[KVCacheBlock]:
        """`evict_next` `n` times (the queue holds that many cached blocks): the eviction
        core's victims in order, forgotten. Without a hybrid model's rules, the core
        removes the victims as it names them (`EvictionCore.pop_victims`)."""
        if self.rules is not None:
            taken: list[KVCacheBlock] = []
            for _ in range(n):
                taken.append(self.evict_next(taken))
            return taken
        keys = self._keys
        victims: list[KVCacheBlock] = []
        for record in self.eviction.pop_victims(n):
            block = record.block
            record.serial = -1  # `forget`, less the core's part, which is done
            keys[block.block_id] = None
            victims.append(block)
        self._num_keys -= len(victims)
        while len(victims) < n:  # unreachable while the child counts are exact
            block = self.free_block_queue.any_cached(victims)
            self.forget(block)
            victims.append(block)
        return victims

    def iter_victims(self, gone: Sequence[KVCacheBlock] = ()) -> Iterator[KVCacheBlock]:
        """The cached free blocks in the order `evict_n` would take them once `gone` (the
        queue's evict-first lane) has left first, changing nothing. A hybrid pool's rules
        retire other groups' blocks as it goes: its order is the policy's, after the
        rules' own first-out queue, and not exact where a victim retires a window."""
        slots = self._slots
        records = [slots[block.block_id] for block in gone]
        if self.rules is not None:
            first = [slots[node] for node in self.rules.queued_first()]
            records += first
            for record in first:
                yield record.block
        for record in self.eviction.iter_victims(records):
            yield record.block

    def evict_next(self, taken: Sequence[KVCacheBlock] = ()) -> KVCacheBlock:
        """Forget the next victim (its hash goes when vLLM hands the block out) and return
        its block, never one of `taken` (victims already chosen with it); the queue then
        calls `on_evicted`. Tracked only. A hybrid pool's rules choose it (theirs first,
        else the policy's); others, the eviction core."""
        rules = self.rules
        if rules is None:
            victim = self.eviction.next_victim()
            node = -1 if victim is None else victim.block.block_id
        else:
            node = rules.next_victim()
        if node >= 0:
            block: KVCacheBlock = self.blocks[node]
        else:  # unreachable while the child counts are exact; never strand a free block
            block = self.free_block_queue.any_cached(taken)
        self.forget(block)
        return block

    def on_evicted(self, blocks: list[KVCacheBlock]) -> None:
        """The queue evicted `blocks` (their hashes go when vLLM hands them out): forget
        them (`evict_next` did), count them and remember their hashes, for churn (the
        record keeps the latest `num_gpu_blocks` itself)."""
        self.stats.evictions += len(blocks)
        self._evicted.file_recent(blocks, "_block_hash")

    # -- helpers ---------------------------------------------------------------------------
    def _adopt(self, block: KVCacheBlock, key: Any) -> None:
        """`block` holds `key`, which the pool does not account for yet: count it."""
        if self._keys[block.block_id] is not None:  # the block holds another hash now
            self.forget(block)
        if self._evicted.pop(key, 0) is None:
            self.stats.churn += self._evicted.weight
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

    def _record_chain(
        self, blocks: list[KVCacheBlock], start: int, end: int, parent: CachedBlock | None
    ) -> None:
        """`_record` for each block of ``blocks[start:end]`` that holds a hash, each below
        the one before it (the first below `parent`; a block without a hash breaks the
        chain), the new records inserted into the eviction core a run at a time
        (`EvictionCore.insert_chain`): the same records and links in fewer calls."""
        keys, slots, evicted, serials = self._keys, self._slots, self._evicted, self._serials
        insert_chain = self.eviction.insert_chain
        size = self.hash_block_size
        run: list[CachedBlock] = []  # new records not inserted yet, each below the one before
        recorded = churn = 0
        for i in range(start, end):
            block = blocks[i]
            key = block._block_hash
            if block.is_null or key is None:
                insert_chain(run, parent)
                run, parent = [], None
                continue
            block_id = block.block_id
            if keys[block_id] is not None:  # recorded already, or under another hash
                insert_chain(run, parent)
                parent = self._record(block, run[-1] if run else parent)
                run = []
                continue
            # `_adopt` and `_record`, inlined
            if evicted.pop(key, 0) is None:
                churn += evicted.weight
            keys[block_id] = key
            depth = (block._block_hash_num_tokens or size) // size - 1
            record = slots[block_id]
            record.reset(next(serials), key, depth if depth > 0 else 0)
            run.append(record)
            recorded += 1
        insert_chain(run, parent)
        self._num_keys += recorded
        self.stats.churn += churn

    def forget(self, block: KVCacheBlock) -> None:
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
        for block_id in self._tier_copies:
            assert self.blocks[block_id].ref_cnt > 0, f"block {block_id}: a tier's copy, free"
        records = [self._slots[i] for i, key in enumerate(self._keys) if key is not None]
        children: dict[int, int] = {}
        for record in records:
            parent = live_parent(record)
            if parent is not None:
                children[parent.serial] = children.get(parent.serial, 0) + 1
        rules = self.rules
        leaves = 0
        for record in records:
            found = children.get(record.serial, 0)
            assert record.cached_children == found, (
                f"block {record.block.block_id}: {record.cached_children} cached children "
                f"counted, {found} found"
            )
            unranked = rules is not None and rules.is_unranked(record.block.block_id)
            leaves += record.evictable and found == 0 and not unranked
        assert len(self.eviction) == leaves, "the candidates are not the cached leaves"
        self.eviction.check_protection(records)
        if rules is not None:
            rules.check_invariants()


class ReleaseOrderPool(KVPlugBlockPool):
    """The pool with kvplug's ``lru``: vLLM's own free queue and code, kvplug counting.

    kvplug's lru is vLLM's order (see the module doc), so this pool ranks nothing and
    keeps no per-block record: it is vLLM's `BlockPool` with its `FreeKVCacheBlockQueue`,
    counting hits, evictions, churn and cached blocks as a tracked pool does (a test
    checks them against tracked lru, operation by operation). `pool_class` builds this
    class for a policy whose order is the release order (`EvictionPolicy.release_order`).

    Its evictions are counted as `get_new_blocks` hands the blocks out
    (`counts_handed_out`): a wrapper of `_maybe_evict_cached_block` would cost a call for
    every block.
    """

    counts_handed_out = True
    tracked: ClassVar[bool] = False

    def touch(self, blocks: Sequence[KVCacheBlock]) -> None:
        if self.touch_counts_hits:
            keyed = blocks if isinstance(blocks, list) else list(blocks)
            self.stats.block_hits += count_keyed(keyed, "_block_hash")
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
        if num_cached_blocks >= num_full_blocks:  # vLLM's own no-op, made per request
            return
        before = None
        if self._partial_entries:
            before = keys_of(blocks, num_cached_blocks, num_full_blocks, "_block_hash")
        BlockPool.cache_full_blocks(
            self, request, blocks, num_cached_blocks, num_full_blocks, block_size,
            kv_cache_group_id, block_mask,
        )  # fmt: skip
        # a key popped from the recent victims is cached again after an eviction
        cached, churn = count_new_keys(
            blocks, num_cached_blocks, num_full_blocks, "_block_hash", self._evicted, before
        )
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
                self.stats.churn += self._evicted.weight
        return key

    def move_block_hashes(self, src_block: KVCacheBlock, dst_block: KVCacheBlock) -> None:
        """vLLM's: the hashes move from one block to another; the count stays."""
        BlockPool.move_block_hashes(self, src_block, dst_block)

    def reset_prefix_cache(self) -> bool:
        if not BlockPool.reset_prefix_cache(self):
            return False
        self._num_keys = 0
        return True

    def _maybe_evict_cached_block(self, block: KVCacheBlock) -> bool:
        """Evicted on request (a KV connector): not counted as an eviction."""
        self._num_keys -= block._block_hash is not None
        return BlockPool._maybe_evict_cached_block(self, block)

    def protect_n(self, block_ids: list[int], levels: list[int]) -> None:
        raise ConfigError(
            f"queue protection needs a policy kvplug ranks itself, not {self.policy.name!r} "
            "(which keeps vLLM's own free queue); use cost or learned, or set "
            "queue_protection.requests to 0"
        )

    def num_protected(self) -> int:
        return 0

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


def pool_class(
    policy: EvictionPolicy, group_kinds: Mapping[int, GroupKind] | None = None
) -> type[KVPlugBlockPool]:
    """The pool class that serves `policy` on a model of `group_kinds` (None or empty: one
    kind), chosen before vLLM builds the pool: vLLM's own queue for a policy in release
    order (`ReleaseOrderPool`); for `cost`, the dense core where it is wanted and serves
    the model (`kvplug.vllm.dense_pool`); kvplug's record-based ranking otherwise."""
    if policy.release_order:
        return ReleaseOrderPool
    from kvplug.vllm.dense_pool import DenseCostPool, dense_core_wanted, dense_serves

    if dense_serves(policy, group_kinds) and dense_core_wanted():
        return DenseCostPool
    return KVPlugBlockPool
