"""The hybrid rules of kvplug's vLLM pool: one decision across groups, and anchors.

A hybrid model's KV cache groups share one tracked pool (the record pool,
`kvplug.vllm.block_pool.KVPlugBlockPool`, or the dense `kvplug.vllm.dense_pool.DenseCostPool`).
A hit is the junction every group serves: at block position a, every full-attention block
before a and, in each sliding-window group, the window of W blocks before a (W =
``cdiv(sliding_window - 1, block_size)``). `HybridRules` holds what the pool does about
that; the pool owns one when it is tracked and has a sliding-window group, and calls it
at its hook points (`on_cached`, `on_touch`, `release_n`, `next_victim`). The rules work
on block ids and read and tell the pool's eviction state through its `BlockNodes` (the
record pool's records, or the dense core's arrays), so both pools run the same rules.

**Cross-group retiring.** When the policy evicts a full-attention block (a leaf) or one
group's sliding-window block, the other sliding-window groups' blocks at that position
serve no junction any more: they are retired (evicted next, before the policy's next
choice) while the victim's hash is not cached again (`dependents`).

**Anchors** (with each sliding-window group's window known, and a full-attention group).
vLLM caches every sliding-window block a request computed, but later requests are served
at a few positions only, the *anchors*; a sliding-window record is marked ``anchored``
(`BlockNodes.anchor`, for the block's current identity) when it lies in the window before
one:

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

- an unanchored sliding-window block is never one of the policy's candidates
  (`is_unranked`);
- every evictable unanchored sliding-window block has a live entry (its current serial)
  in the evicted-first queue, so it goes before the policy's choice.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any, Protocol

from kvplug.core.dense import all_held, held_by_another, holders_at, is_held
from kvplug.core.groups import GroupKind
from kvplug.vllm.compat import copy_index, map_entries

if TYPE_CHECKING:
    from vllm.v1.core.kv_cache_utils import KVCacheBlock

    from kvplug.vllm.block_pool import KVPlugBlockPool

# a group's class in the hybrid rules' release (`BlockNodes.release_hybrid`), by group id
OTHER, WINDOW, FULL = 0, 1, 2

# victims whose position's sliding-window blocks in other groups are retired with them
RETIRING_KINDS = (GroupKind.FULL, GroupKind.SLIDING_WINDOW)


def _suffix(group: int) -> bytes:
    """The bytes vLLM appends to a block hash for KV cache group `group`."""
    return group.to_bytes(4, "big")


class BlockNodes(Protocol):
    """A tracked pool's eviction state by block id, as the hybrid rules read and change
    it: each block's current identity (its serial, -1: none), its tree links and whether
    it is evictable, a candidate (evictable, no cached children) or anchored; releases
    ranked by the policy or not, or as the hybrid rules sort them (`release_hybrid`:
    a block of a group whose class, ``group_classes[group]``, is `WINDOW` goes first
    unranked unless anchored; one of a `FULL` group is ranked, and goes first too while
    another block holds its key (`kvplug.core.dense.held_by_another`, reading `copies`,
    vLLM's map's copy index: `kvplug.vllm.compat.copy_index`); any other is ranked);
    `anchor_blocks` anchors the current identities of those blocks that belong to a
    `WINDOW` group (`anchor_windows`: of ``blocks[max(e - window, start) : min(e, end)]``
    for each position `e` of `ends`); the policy's next victim (-1: none); and the rules'
    evicted-first queue, whose entries name a block's identity (its serial at queueing)
    and whether it is a full-attention copy.
    `next_first` pops entries until one whose identity is live, a candidate and still
    first (a window: unanchored; a copy: while another block holds its key) and returns
    it (-1: none left)."""

    def serial_of(self, node: int) -> int: ...
    def is_evictable(self, node: int) -> bool: ...
    def is_candidate(self, node: int) -> bool: ...
    def live_parent(self, node: int) -> int: ...
    def cached_children(self, node: int) -> int: ...
    def depth_of(self, node: int) -> int: ...
    def is_anchored(self, node: int) -> bool: ...
    def anchor_blocks(self, blocks: Sequence[KVCacheBlock], group_classes: bytes) -> None: ...
    def anchor_windows(
        self,
        blocks: list[KVCacheBlock],
        start: int,
        end: int,
        window: int,
        ends: tuple[int, ...],
        group_classes: bytes,
    ) -> None:
        for e in ends:  # (the dense core compiles its own)
            self.anchor_blocks(blocks[max(e - window, start) : min(e, end)], group_classes)

    def release_ranked(self, nodes: list[int]) -> None: ...
    def release_unranked(self, nodes: list[int]) -> None: ...
    def next_victim(self) -> int: ...

    def release_hybrid(
        self, nodes: list[int], group_classes: bytes, copies: tuple[dict[Any, Any], bool]
    ) -> None: ...

    # the evicted-first queue: ``(node, serial, copy)`` entries, first in first out
    def queue_first(self, node: int, copy: bool) -> None: ...
    def first_entries(self) -> list[tuple[int, int, bool]]: ...
    def next_first(self, copies: tuple[dict[Any, Any], bool]) -> int: ...


class HybridRules:
    """The cross-group and anchor rules (module doc) of one tracked pool.

    Made by the pool's `use_policy` for a model with a sliding-window group, with the
    pool's `BlockNodes` (`nodes`), after its statistics and key list (``_keys``, by block
    id), which it keeps references to (the pool never replaces them while these rules are
    in use; vLLM replaces its hash map on a prefix-cache reset, so that is read through
    the pool). It keeps two queues of ``(block id, serial)`` entries; an entry whose block
    has another identity by now is stale and skipped.
    """

    def __init__(
        self,
        pool: KVPlugBlockPool,
        nodes: BlockNodes,
        group_kinds: Mapping[int, GroupKind],
        windows: Mapping[int, int],
    ) -> None:
        self.pool = pool
        self.nodes = nodes
        self._stats = pool.stats
        self._keys = pool._keys  # the pool's, by block id
        self.group_kinds = dict(group_kinds)
        # dependents to evict next: (block id, its serial, the victim's key they depend on)
        self.retiring: deque[tuple[int, int, Any]] = deque()
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
        self._widest = max(self.windows.values(), default=0)
        # the hash suffixes of the groups whose victims retire other groups' blocks
        self._retiring_suffixes = {
            _suffix(g) for g, kind in self.group_kinds.items() if kind in RETIRING_KINDS
        }
        self._full_suffixes = full if self.windows else set()
        # what a compiled core needs to choose victims as `next_victim` does
        # (`kvplug.core.dense.DenseCostCore.take_hybrid`)
        self.victim_rules = (
            self._sliding_suffixes,
            self._retiring_suffixes,
            self._full_suffixes,
            self._suffix_windows,
            self._widest,
            bool(self.windows),
        )
        # each group's class in a release, by group id (`BlockNodes.release_hybrid`)
        classes = [OTHER] * (max(self.group_kinds, default=0) + 1)
        for group in self.windows:
            classes[group] = WINDOW
        for group, kind in self.group_kinds.items():
            if kind is GroupKind.FULL and self.windows:
                classes[group] = FULL
        self.group_classes = bytes(classes)

    # -- anchors -----------------------------------------------------------------------
    def anchor(self, blocks: Sequence[KVCacheBlock]) -> None:
        """`blocks` (one sliding-window group's) lie in the window before an anchor: a
        position a later request is likely served at. Released, they are ranked by the
        policy; other released sliding-window blocks are evicted first."""
        self.nodes.anchor_blocks(blocks, self.group_classes)

    def on_touch(self, blocks: Sequence[KVCacheBlock]) -> None:
        """A lookup was served with `blocks`: its sliding-window blocks are the window
        before the junction, an anchor."""
        if self.windows:
            self.nodes.anchor_blocks(blocks, self.group_classes)

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
        prompt = request.num_prompt_tokens
        ends = (
            prompt // block_size,
            (prompt - 1) // block_size,
            getattr(request, "kvplug_branch", 0) // block_size,
        )
        self.nodes.anchor_windows(
            blocks, num_cached_blocks, num_full_blocks, window, ends, self.group_classes
        )

    def canonical(self, node: int) -> int:
        """The block vLLM's map names first for `node`'s key (vLLM caches duplicates): a
        request that recomputed cached blocks continues below the first copy, so its own
        copies stay leaves. The pool calls it only when `windows` is set."""
        key = self._keys[node]
        block = self.pool.cached_block_hash_to_block.get_one_block(key)
        if block is None or block.block_id == node or self._keys[block.block_id] != key:
            return node
        return block.block_id

    # -- release and eviction ------------------------------------------------------------
    def release_n(self, nodes: list[int]) -> None:
        """Release `nodes` (in order) for hybrid pools: ranked and offered
        (`BlockNodes.release_ranked`), but unanchored sliding-window blocks are queued to
        be evicted first and offered unranked, and full-attention copies are ranked and
        also queued to be evicted first."""
        if self.windows:
            copies = copy_index(self.pool.cached_block_hash_to_block)
            self.nodes.release_hybrid(nodes, self.group_classes, copies)
        else:
            self.nodes.release_ranked(nodes)

    def queued_first(self) -> list[int]:
        """The blocks `next_victim` takes before the policy's choice as things stand
        (retiring dependents, then the evicted-first queue), without changing anything."""
        nodes = self.nodes
        serial_of, is_candidate, found = nodes.serial_of, nodes.is_candidate, []
        for node, serial, needed in self.retiring:
            if not self._is_cached(needed) and serial_of(node) == serial and is_candidate(node):
                found.append(node)
        for node, serial, copy in nodes.first_entries():
            if serial_of(node) != serial or not is_candidate(node) or node in found:
                continue
            if self._still_copy(node) if copy else not nodes.is_anchored(node):
                found.append(node)
        return found

    def next_victim(self) -> int:
        """The block to evict next, or -1 if there is none; the pool forgets it and hands
        it out. In order: a retiring dependent whose victim's hash is still gone (its own
        dependents queued next), the oldest live entry of the evicted-first queue, else
        the policy's choice (with the blocks it retires queued)."""
        nodes = self.nodes
        retiring, serial_of, is_candidate = self.retiring, nodes.serial_of, nodes.is_candidate
        while retiring:
            node, serial, needed = retiring.popleft()
            # still dead: the victim's block was not cached again since (vLLM's map keeps
            # the victim itself until it is handed out; the pool forgot it already)
            if self._is_cached(needed):
                continue
            if serial_of(node) == serial and is_candidate(node):
                self._stats.retired += 1
                if self._keys[node][-4:] in self._full_suffixes:  # a dead leaf: its path's turn
                    retiring.extend(self.dependents(node))
                    self._retire_dead_parent(node)
                return node
        node = nodes.next_first(copy_index(self.pool.cached_block_hash_to_block))
        if node >= 0:
            return node
        victim = nodes.next_victim()
        if victim >= 0:
            retiring.extend(self.dependents(victim))
            if self._keys[victim][-4:] in self._full_suffixes:
                self._retire_dead_parent(victim)
        return victim

    def _still_copy(self, node: int) -> bool:
        """Whether full-attention `node` in the evicted-first queue still goes first: while
        another block holds its key (else the other went first, and this one is ranked)."""
        return self._cached_elsewhere(self._keys[node], node)

    def dependents(self, victim: int) -> list[tuple[int, int, Any]]:
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
        keys = self._keys
        key = keys[victim]
        if key[-4:] not in self._retiring_suffixes:
            return []
        if self.windows and self._cached_elsewhere(key, victim):
            return []  # another copy still serves the position
        nodes = self.nodes
        entries = map_entries(self.pool.cached_block_hash_to_block)
        return [
            (node, nodes.serial_of(node), key)
            for node in holders_at(entries, keys, key[:-4], self._sliding_suffixes, key)
            if nodes.is_evictable(node)
        ]

    def _retire_dead_parent(self, victim: int) -> None:
        """When full-attention `victim` goes, its parent may become a leaf that ends a
        path no junction can use (the window before the position after it is missing
        in some sliding-window group): retire it too, which cascades up the path."""
        nodes, keys = self.nodes, self._keys
        parent = nodes.live_parent(victim)
        if parent < 0 or nodes.cached_children(parent) != 1 or not nodes.is_evictable(parent):
            return
        hashes, node = [], parent
        for _ in range(min(self._widest, nodes.depth_of(parent) + 1)):
            if node < 0:
                return  # cannot tell
            hashes.append(keys[node][:-4])
            node = nodes.live_parent(node)
        hash_map = self.pool.cached_block_hash_to_block
        entries, copies = map_entries(hash_map), copy_index(hash_map)
        for suffix, window in self._suffix_windows:
            if not all_held(entries, copies, keys, hashes, suffix, window):
                self.retiring.append((parent, nodes.serial_of(parent), keys[victim]))
                return

    # -- vLLM's hash map, as the pool accounts for it --------------------------------------
    def _is_cached(self, key: Any) -> bool:
        """Whether a block holds `key` as the pool accounts for it (vLLM's map keeps a
        victim's hash until the block is handed out)."""
        hash_map = self.pool.cached_block_hash_to_block
        return is_held(map_entries(hash_map), copy_index(hash_map), self._keys, key)

    def _cached_elsewhere(self, key: Any, block_id: int) -> bool:
        """Whether a block other than `block_id` holds `key` (vLLM caches duplicates; its
        map's layout differs by release: `kvplug.vllm.compat.copy_index`)."""
        return held_by_another(
            copy_index(self.pool.cached_block_hash_to_block), self._keys, key, block_id
        )

    # -- audit ---------------------------------------------------------------------------
    def is_unranked(self, node: int) -> bool:
        """Whether `node` is released unranked when freed (an unanchored window)."""
        key = self._keys[node]
        return (
            key is not None
            and key[-4:] in self._window_suffixes
            and not self.nodes.is_anchored(node)
        )

    def check_invariants(self) -> None:
        """Raise AssertionError if an unanchored window is evictable but not queued first
        (the pool checks the policy's candidates)."""
        nodes = self.nodes
        queued = {(node, serial) for node, serial, _ in nodes.first_entries()}
        for node, key in enumerate(self._keys):
            if key is not None and nodes.is_evictable(node) and self.is_unranked(node):
                assert (node, nodes.serial_of(node)) in queued, (
                    f"block {node}: unanchored window, not queued first"
                )
