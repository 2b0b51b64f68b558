"""The hybrid rules of kvplug's vLLM pool: one decision across groups, and anchors.

A hybrid model's KV cache groups share one `kvplug.vllm.block_pool.KVPlugBlockPool`. A hit
is the junction every group serves: at block position a, every full-attention block
before a and, in each sliding-window group, the window of W blocks before a (W =
``cdiv(sliding_window - 1, block_size)``). `HybridRules` holds what the pool does about
that; the pool owns one when it is tracked and has a sliding-window group, and calls it
at its hook points (`on_cached`, `on_touch`, `release_n`, `next_victim`).

**Cross-group retiring.** When the policy evicts a full-attention block (a leaf) or one
group's sliding-window block, the other sliding-window groups' blocks at that position
serve no junction any more: they are retired (evicted next, before the policy's next
choice) while the victim's hash is not cached again (`dependents`).

**Anchors** (with each sliding-window group's window known, and a full-attention group).
vLLM caches every sliding-window block a request computed, but later requests are served
at a few positions only, the *anchors*; a sliding-window record is marked ``anchored``
when it lies in the window before one:

- a position a lookup was served at (the blocks `touch` reuses are that window);
- a prompt's end, and the longest hit a resend of it can get (vLLM leaves the last token
  to compute), both in `on_cached`;
- where a request left the cached tree (its full-attention hit at its first lookup, when
  longer than the junction it got: vLLM's shared-prefix boundary, ``kvplug_branch``, set
  by the manager);
- the request's end (the manager marks it as the request is freed).

A released sliding-window block that is not anchored is evicted before the policy's
choice, in release order, and is never ranked (no policy learns from it); so is a
full-attention block whose hash another block holds (vLLM caches duplicates: a request
served a shorter junction than the full-attention hit recomputes those blocks), and a
request's blocks after such a copy are recorded below the first copy (`canonical`), so
the copies stay leaves. When a full-attention block goes, a parent left as a leaf whose
next position has an incomplete window in some group serves no junction, and is retired
too, up the path. Evictions still go through vLLM's hand-out path (the pool forgets and
hands out every block these rules name), so KV events stay exact.

Invariants (the pool's ``check_invariants`` checks both, the second through this
class's `check_invariants`):

- an unanchored sliding-window record is never one of the policy's candidates
  (`is_unranked`);
- every evictable unanchored sliding-window record has a live entry (its current serial)
  in the evicted-first queue, so it goes before the policy's choice.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any

from kvplug.core.eviction import live_parent
from kvplug.core.groups import GroupKind
from kvplug.vllm.compat import cached_blocks

if TYPE_CHECKING:
    from vllm.v1.core.kv_cache_utils import KVCacheBlock

    from kvplug.vllm.block_pool import CachedBlock, KVPlugBlockPool

# victims whose position's sliding-window blocks in other groups are retired with them
RETIRING_KINDS = (GroupKind.FULL, GroupKind.SLIDING_WINDOW)


def _suffix(group: int) -> bytes:
    """The bytes vLLM appends to a block hash for KV cache group `group`."""
    return group.to_bytes(4, "big")


class HybridRules:
    """The cross-group and anchor rules (module doc) of one tracked `KVPlugBlockPool`.

    Made by the pool's `use_policy` for a model with a sliding-window group, after the
    pool's eviction core, statistics and per-block lists (``_keys``, ``_slots``), which
    it keeps references to (the pool never replaces them while these rules are in use;
    vLLM replaces its hash map on a prefix-cache reset, so that is read through the pool).
    It keeps two queues of ``(record, serial)`` entries; an entry whose record has another
    serial by now is stale and skipped.
    """

    def __init__(
        self,
        pool: KVPlugBlockPool,
        group_kinds: Mapping[int, GroupKind],
        windows: Mapping[int, int],
    ) -> None:
        self.pool = pool
        self._eviction = pool.eviction
        self._stats = pool.stats
        self._keys, self._slots = pool._keys, pool._slots  # the pool's, by block id
        self.group_kinds = dict(group_kinds)
        # dependents to evict next: (record, its serial, the victim's key they depend on)
        self._retiring: deque[tuple[CachedBlock, int, Any]] = deque()
        # sliding-window groups with a known window (blocks a hit needs before it), by
        # group id; with a full-attention group, they turn on the anchor rules
        full = {_suffix(g) for g, kind in self.group_kinds.items() if kind is GroupKind.FULL}
        self.windows: dict[int, int] = {
            group: window
            for group, window in windows.items()
            if full and window > 0 and self.group_kinds.get(group) is GroupKind.SLIDING_WINDOW
        }
        self._window_suffixes = {_suffix(group) for group in self.windows}
        # the hash suffixes of every sliding-window group, and of those with a window
        # (with it), in group order
        self._sliding_suffixes = [
            _suffix(g) for g, kind in self.group_kinds.items() if kind is GroupKind.SLIDING_WINDOW
        ]
        self._suffix_windows = [(_suffix(group), window) for group, window in self.windows.items()]
        self._full_suffixes = full if self.windows else set()
        # released blocks evicted before the policy's choice, in release order (unanchored
        # sliding-window blocks, full-attention copies): (record, its serial)
        self._first: deque[tuple[CachedBlock, int]] = deque()

    # -- anchors -----------------------------------------------------------------------
    def anchor(self, blocks: Sequence[KVCacheBlock]) -> None:
        """`blocks` (one sliding-window group's) lie in the window before an anchor: a
        position a later request is likely served at. Released, they are ranked by the
        policy; other released sliding-window blocks are evicted first."""
        keys, slots = self._keys, self._slots
        for block in blocks:
            key = keys[block.block_id]
            if key is not None and key == block._block_hash:
                slots[block.block_id].anchored = True

    def on_touch(self, blocks: Sequence[KVCacheBlock]) -> None:
        """A lookup was served with `blocks`: its sliding-window blocks are the window
        before the junction, an anchor."""
        windowed = self._window_suffixes
        if not windowed:
            return
        keys, slots = self._keys, self._slots
        for block in blocks:
            key = keys[block.block_id]
            if key is not None and key == block._block_hash and key[-4:] in windowed:
                slots[block.block_id].anchored = True

    def on_cached(
        self,
        request: Any,
        blocks: Sequence[KVCacheBlock],
        num_cached_blocks: int,
        num_full_blocks: int,
        block_size: int,
        kv_cache_group_id: int,
    ) -> None:
        """The pool cached ``blocks[num_cached_blocks:num_full_blocks]`` of group
        `kv_cache_group_id` for `request`: for a sliding-window group, anchor the windows
        before its prompt's end, the longest hit a resend of it can get (vLLM leaves its
        last token to compute), and where it left the cached tree."""
        window = self.windows.get(kv_cache_group_id)
        if not window:
            return
        ends = (
            request.num_prompt_tokens // block_size,
            (request.num_prompt_tokens - 1) // block_size,
            getattr(request, "kvplug_branch", 0) // block_size,
        )
        for end in ends:
            start = max(end - window, num_cached_blocks)
            self.anchor(blocks[start : min(end, num_full_blocks)])

    def canonical(self, record: CachedBlock) -> CachedBlock:
        """The record vLLM's map names first for `record`'s key (vLLM caches duplicates):
        a request that recomputed cached blocks continues below the first copy, so its
        own copies stay leaves. The pool calls it only when `windows` is set."""
        block = self.pool.cached_block_hash_to_block.get_one_block(record.key)
        if block is None or block is record.block or self._keys[block.block_id] != record.key:
            return record
        return self._slots[block.block_id]

    # -- release and eviction ------------------------------------------------------------
    def release_n(self, records: list[CachedBlock]) -> None:
        """The pool's `EvictionCore.release_n` for hybrid pools: `records` (released, in
        order) are ranked and offered, but unanchored sliding-window records are queued to
        be evicted first and offered unranked, and full-attention copies are ranked and
        also queued to be evicted first."""
        windowed = self._window_suffixes
        eviction = self._eviction
        if not windowed:
            eviction.release_n(records)
            return
        full, first = self._full_suffixes, self._first
        ranked: list[CachedBlock] = []
        unranked: list[CachedBlock] = []  # evicted first, and never ranked
        for record in records:
            group = record.key[-4:]
            if group in windowed and not record.anchored:
                first.append((record, record.serial))
                unranked.append(record)
                continue
            if group in full and self._cached_elsewhere(record.key, record.block.block_id):
                first.append((record, record.serial))  # a copy: the other one serves
            ranked.append(record)
        if ranked:
            eviction.release_n(ranked)
        if unranked:
            eviction.release_unranked(unranked)

    def queued_first(self) -> list[CachedBlock]:
        """The records `next_victim` takes before the policy's choice as things stand
        (retiring dependents, then the evicted-first queue), without changing anything."""
        is_candidate, found = self._eviction.is_candidate, []
        for record, serial, needed in self._retiring:
            if not self._is_cached(needed) and record.serial == serial and is_candidate(record):
                found.append(record)
        for record, serial in self._first:
            if record.serial != serial or not is_candidate(record) or record in found:
                continue
            if record.key[-4:] in self._full_suffixes:
                if not self._cached_elsewhere(record.key, record.block.block_id):
                    continue
            elif record.anchored:
                continue
            found.append(record)
        return found

    def next_victim(self) -> CachedBlock | None:
        """The record to evict next, or None if there is none; the pool forgets it and
        hands its block out. In order: a retiring dependent whose victim's hash is still
        gone (its own dependents queued next), the oldest live entry of the evicted-first
        queue, else the policy's choice (with the blocks it retires queued)."""
        retiring, is_candidate = self._retiring, self._eviction.is_candidate
        while retiring:
            record, serial, needed = retiring.popleft()
            # still dead: the victim's block was not cached again since (vLLM's map keeps
            # the victim itself until it is handed out; the pool forgot it already)
            if self._is_cached(needed):
                continue
            if record.serial == serial and is_candidate(record):
                self._stats.retired += 1
                if record.key[-4:] in self._full_suffixes:  # a dead leaf: its path's turn
                    retiring.extend(self.dependents(record))
                    self._retire_dead_parent(record)
                return record
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
            return record
        victim = self._eviction.next_victim()
        if victim is not None:
            retiring.extend(self.dependents(victim))
            if victim.key[-4:] in self._full_suffixes:
                self._retire_dead_parent(victim)
        return victim

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
        if self.group_kinds.get(int.from_bytes(key[-4:], "big")) not in RETIRING_KINDS:
            return []
        if self.windows and self._cached_elsewhere(key, victim.block.block_id):
            return []  # another copy still serves the position
        position = key[:-4]
        lookup = self.pool.cached_block_hash_to_block.get_one_block
        keys, slots = self._keys, self._slots
        found = []
        for suffix in self._sliding_suffixes:
            other = position + suffix
            if other == key:
                continue
            block = lookup(other)
            if block is not None and keys[block.block_id] == other:
                record = slots[block.block_id]
                if record.evictable:
                    found.append((record, record.serial, key))
        return found

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
        for suffix, window in self._suffix_windows:
            if not all(self._is_cached(position + suffix) for position in hashes[:window]):
                self._retiring.append((parent, parent.serial, victim.key))
                return

    # -- vLLM's hash map, as the pool accounts for it --------------------------------------
    def _is_cached(self, key: Any) -> bool:
        """Whether a block holds `key` as the pool accounts for it (vLLM's map keeps a
        victim's hash until the block is handed out)."""
        block = self.pool.cached_block_hash_to_block.get_one_block(key)
        if block is None:
            return False
        return self._keys[block.block_id] == key or self._cached_elsewhere(key, block.block_id)

    def _cached_elsewhere(self, key: Any, block_id: int) -> bool:
        """Whether a block other than `block_id` holds `key` (vLLM caches duplicates; its
        map's layout differs by release: `kvplug.vllm.compat.cached_blocks`)."""
        blocks = cached_blocks(self.pool.cached_block_hash_to_block, key)
        if len(blocks) < 2:
            return False
        keys = self._keys
        return any(b.block_id != block_id and keys[b.block_id] == key for b in blocks)

    # -- audit ---------------------------------------------------------------------------
    def is_unranked(self, record: CachedBlock) -> bool:
        """Whether `record` is released unranked when freed (an unanchored window)."""
        return record.key[-4:] in self._window_suffixes and not record.anchored

    def check_invariants(self, records: Sequence[CachedBlock]) -> None:
        """Raise AssertionError if an unanchored window is evictable but not queued first;
        `records` are the pool's live records (the pool checks the policy's candidates)."""
        queued = {(id(record), serial) for record, serial in self._first}
        for record in records:
            if record.evictable and self.is_unranked(record):
                assert (id(record), record.serial) in queued, (
                    f"block {record.block.block_id}: unanchored window, not queued first"
                )
