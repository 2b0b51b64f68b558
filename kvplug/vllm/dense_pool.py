"""kvplug's vLLM pool over the dense eviction core: `cost` and `learned` at a compiled price.

`DenseCostPool` is `kvplug.vllm.block_pool.KVPlugBlockPool` with its per-block records,
eviction core and policy heap replaced by one `kvplug.core.dense.DenseCostCore`, which
keeps every block's state in typed arrays indexed by vLLM's block id. It makes the
decisions the record-based pool makes with `cost` and with `learned`
(`kvplug.core.dense.DenseLearnedCore`): the same victims, in the same order, and the same
learning (a differential test runs both on the same operations). It serves them wherever
the record pool would: a model with a sliding-window group runs the same hybrid rules
(`kvplug.vllm.anchors.HybridRules`) over the dense core, which is their `BlockNodes`.
The rules' per-block bookkeeping is then compiled too (a release sorted into ranked and
evicted-first blocks, the evicted-first queue drained, windows anchored); what stays in
Python is where they read vLLM's hash map (a victim retiring other groups' blocks, the
test whether a full-attention copy's twin is still cached).

`pool_class` builds it for those policies when the dense core is compiled (it is
built as a C extension at install where a compiler is present). ``KVPLUG_DENSE_CORE``
overrides the choice: ``0`` keeps the record pool, ``1`` uses the dense core even as plain
Python (slower, for tests); the default, ``auto``, uses it only compiled.

Invariants (checked by `check_invariants`): those of `KVPlugBlockPool`, with the dense
core's identities in place of records (a block's key is set exactly while its identity is
live), the dense core's own (`kvplug.core.dense`) and the hybrid rules'.
"""

from __future__ import annotations

import os
from collections.abc import Iterable, Iterator, Mapping, Sequence
from typing import Any, ClassVar

from vllm.v1.core.block_pool import BlockPool
from vllm.v1.core.kv_cache_utils import KVCacheBlock

from kvplug.core.dense import COMPILED, DenseCostCore, DenseLearnedCore, any_copy, iter_victims
from kvplug.core.groups import GroupKind
from kvplug.errors import ConfigError
from kvplug.policies.base import EvictionPolicy
from kvplug.policies.cost import CostPolicy
from kvplug.policies.learned import LearnedPolicy
from kvplug.vllm.anchors import HybridRules
from kvplug.vllm.block_pool import BlockStanding, KVPlugBlockPool
from kvplug.vllm.compat import TOUCH_COUNTS_NULL, copy_index, map_entries
from kvplug.vllm.free_queue import PolicyFreeQueue
from kvplug.vllm.stats import PoolStats

CHOICE_VARIABLE = "KVPLUG_DENSE_CORE"
CHOICES = ("auto", "0", "1")


def dense_core_wanted() -> bool:
    """Whether `pool_class` may build a `DenseCostPool` (``KVPLUG_DENSE_CORE``)."""
    choice = os.environ.get(CHOICE_VARIABLE, "auto").strip().lower() or "auto"
    if choice not in CHOICES:
        raise ConfigError(
            f"{CHOICE_VARIABLE}={choice!r} is not a choice: use one of {', '.join(CHOICES)} "
            "(auto: the dense core where it is compiled; 1: always; 0: never)"
        )
    return choice == "1" or (choice == "auto" and COMPILED)


# the policies the dense core decides for, exactly these classes (a subclass may rank
# otherwise), and the core that does
DENSE_CORES: dict[type[EvictionPolicy], type[DenseCostCore]] = {
    CostPolicy: DenseCostCore,
    LearnedPolicy: DenseLearnedCore,
}


def dense_serves(policy: EvictionPolicy, group_kinds: Mapping[int, GroupKind] | None) -> bool:
    """Whether `DenseCostPool` makes `policy`'s decisions (for a model of any
    `group_kinds`): `cost` or `learned` itself."""
    return type(policy) in DENSE_CORES


class DenseCostPool(KVPlugBlockPool):
    """vLLM's `BlockPool` with `cost` or `learned` deciding evictions through the dense core
    (see the module doc). ``core`` is the `DenseCostCore`; ``_keys`` (by block id) is the hash the
    pool accounts for, as in `KVPlugBlockPool`."""

    core: DenseCostCore
    tracked: ClassVar[bool] = True

    @property
    def policy(self) -> EvictionPolicy:
        return self._policy

    def use_policy(
        self,
        policy: EvictionPolicy,
        stats: PoolStats,
        tree_groups: set[int] | None = None,
        group_kinds: Mapping[int, GroupKind] | None = None,
        windows: Mapping[int, int] | None = None,
    ) -> None:
        """`KVPlugBlockPool.use_policy`, for `cost` or `learned` (`dense_serves`)."""
        if self._num_keys:
            raise RuntimeError("the policy can only be chosen while nothing is cached")
        if not dense_serves(policy, group_kinds):
            raise TypeError(
                f"DenseCostPool serves kvplug's cost and learned policies, not policy "
                f"{policy.name!r}: build the pool as pool_class(policy, group_kinds)"
            )
        policy.bind(self.hash_block_size, self.num_gpu_blocks)
        self._policy = policy
        self.stats = stats
        self.tree_groups = tree_groups
        self.group_kinds = dict(group_kinds or {})
        self.rules = None
        if len(self._keys) != len(self.blocks):
            self._keys = [None] * len(self.blocks)
        core_class = DENSE_CORES[type(policy)]
        self.core = core_class(
            policy,
            len(self.blocks),
            self._keys,
            self.blocks,
            self.num_gpu_blocks,  # recent victims remembered, for churn
            # vLLM's slots behind the `block_hash` property, and the tokens it covers
            "_block_hash",
            "_block_hash_num_tokens",
        )
        # the pool's record of recent victims is the core's (kept beside its ghosts)
        self._evicted = self.core.history
        free = [b for b in self.blocks if not b.is_null]
        self.free_block_queue = DenseFreeQueue(self, free)
        # without a sliding-window group no victim retires anything (`kvplug.vllm.anchors`)
        if GroupKind.SLIDING_WINDOW in self.group_kinds.values():
            self.rules = HybridRules(self, self.core, self.group_kinds, windows or {})

    def standing(self, block: KVCacheBlock) -> BlockStanding | None:
        block_id = block.block_id
        if self._keys[block_id] is None:
            return None
        core = self.core
        return BlockStanding(
            core.is_evictable(block_id),
            core.is_held_elsewhere(block_id),
            core.hit_count(block_id),
            core.request_output_of(block_id),
            core.entry(block_id)[1] if core.is_ranked(block_id) else None,
        )

    def protect_n(self, block_ids: list[int], levels: list[int]) -> None:
        self.core.protect_n(block_ids, levels)  # (a block without an identity is skipped)

    def num_protected(self) -> int:
        return self.core.num_protected

    # -- vLLM's entry points -------------------------------------------------------------
    def get_num_free_blocks(self) -> int:
        # vLLM asks for every scheduled request: the queue's count, read without its calls
        return self.core.num_fresh + self.core.num_evictable

    def touch(self, blocks: Sequence[KVCacheBlock]) -> None:
        """`KVPlugBlockPool.touch`: a reuse counts a hit first; a tier's hold does not.
        A prefix hit with no tier copy, evict-first lane or metrics collector in play
        (the usual case) is one compiled pass (`DenseCostCore.touch_objects`)."""
        keys, copies = self._keys, self._tier_copies
        if (
            self.touch_counts_hits
            and not copies
            and not self.metrics_collector
            and not self.free_block_queue._first_entry
        ):
            objects = blocks if isinstance(blocks, list) else list(blocks)
            self.stats.block_hits += self.core.touch_objects(objects, TOUCH_COUNTS_NULL)
            if self.rules is not None:
                self.rules.on_touch(objects)
            return
        if not self.touch_counts_hits:
            for block in blocks:
                if block.ref_cnt == 0 and keys[block.block_id] is not None:
                    copies.add(block.block_id)
            BlockPool.touch(self, blocks)
            return
        hit: list[int] = []
        for block in blocks:
            key = keys[block.block_id]
            if key is not None and key == block._block_hash:
                hit.append(block.block_id)
                if copies:
                    copies.discard(block.block_id)
        if hit:
            self.core.hit_n(hit)
            self.stats.block_hits += len(hit)
        if self.rules is not None:
            self.rules.on_touch(blocks)
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
        """Cache blocks as vLLM does, then give each new block an identity below its
        parent (full attention) or alone (other groups); a hybrid model's rules see them
        (with anchors, a copy's children go below the first copy: `HybridRules.canonical`)."""
        if num_cached_blocks >= num_full_blocks:  # vLLM's own no-op, made per request
            return
        BlockPool.cache_full_blocks(
            self, request, blocks, num_cached_blocks, num_full_blocks, block_size,
            kv_cache_group_id, block_mask,
        )  # fmt: skip
        rules = self.rules
        if self.tree_groups is not None and kv_cache_group_id not in self.tree_groups:
            start, _, recorded, churn = self.core.record_objects(
                blocks, num_cached_blocks, num_full_blocks, -1, self.hash_block_size, True
            )  # (`_record_chain`'s first pass, which usually records them all)
            self._num_keys += recorded
            self.stats.churn += churn
            if start < num_full_blocks:
                self._record_chain(blocks, start, num_full_blocks, -1, loose=True)
        else:
            canonical = rules.canonical if rules is not None and rules.windows else None
            parent = -1
            if num_cached_blocks > 0:
                before = blocks[num_cached_blocks - 1]
                if self._keys[before.block_id] is not None:
                    parent = before.block_id if canonical is None else canonical(before.block_id)
            if canonical is None or not any_copy(
                blocks, num_cached_blocks, num_full_blocks, "_block_hash",
                *copy_index(self.cached_block_hash_to_block),
            ):  # (no copy among them: each is its own canonical block)  # fmt: skip
                self._record_chain(blocks, num_cached_blocks, num_full_blocks, parent)
            else:
                for i in range(num_cached_blocks, num_full_blocks):
                    block = blocks[i]
                    if block.is_null or block._block_hash is None:
                        parent = -1
                        continue
                    parent = canonical(self._record(block, parent))
        if rules is not None and kv_cache_group_id in rules.windows:
            rules.on_cached(
                request, blocks, num_cached_blocks, num_full_blocks, block_size,
                kv_cache_group_id,
            )  # fmt: skip

    # -- called by PolicyFreeQueue ------------------------------------------------------
    def on_free_n(
        self, released: list[tuple[int, KVCacheBlock]], held_elsewhere: bool = False
    ) -> None:
        """`KVPlugBlockPool.on_free_n`: rank the blocks a request released, each with its
        `from_end`; with `held_elsewhere`, as blocks another tier holds (they keep their
        last release's standing, lowered to a reload's price)."""
        keys, copies, core = self._keys, self._tier_copies, self.core
        if copies and not held_elsewhere:
            returned = [item for item in released if item[1].block_id in copies]
            if returned:
                released = [item for item in released if item[1].block_id not in copies]
                self._restore(returned)
        nodes: list[int] = []
        ends: list[int] = []
        for from_end, block in released:
            block_id = block.block_id
            if copies:
                copies.discard(block_id)
            if keys[block_id] != block._block_hash:  # a hash not cached by cache_full_blocks
                if nodes:  # rank the blocks before it first, as one at a time would
                    self._release(nodes, ends, held_elsewhere)
                    nodes, ends = [], []
                self._record(block, -1)
            if held_elsewhere:
                if not core.is_held_elsewhere(block_id):
                    core.held_elsewhere(block_id, True)
            else:
                ends.append(from_end)
            nodes.append(block_id)
        if nodes:
            self._release(nodes, ends, held_elsewhere)

    def _release(self, nodes: list[int], ends: list[int], held_elsewhere: bool) -> None:
        releasing, rules = self.releasing, self.rules
        if rules is not None:  # the rules rank what they rank (a tier's hold: anew)
            if not held_elsewhere:
                self.core.note_release(
                    nodes, ends, releasing.request_hit, releasing.output_tokens, releasing.session
                )
            rules.release_n(nodes)
        elif held_elsewhere:
            self.core.restore_n(nodes)
        else:
            self.core.release_n(
                nodes, ends, releasing.request_hit, releasing.output_tokens, releasing.session
            )

    def _restore(self, returned: list[tuple[int, KVCacheBlock]]) -> None:
        """Blocks a tier took while free and gave back keep the standing of their last
        release; a block whose hash changed meanwhile, and any block of a hybrid pool
        (whose rules rank releases), is released anew."""
        keys, copies = self._keys, self._tier_copies
        kept: list[int] = []
        anew: list[tuple[int, KVCacheBlock]] = []
        for item in returned:
            block = item[1]
            copies.discard(block.block_id)
            if self.rules is None and keys[block.block_id] == block._block_hash:
                kept.append(block.block_id)
            else:
                anew.append(item)
        if kept:
            self.core.restore_n(kept)
        if anew:
            self.on_free_n(anew)

    def mark_held_elsewhere(self, blocks: Iterable[KVCacheBlock]) -> None:
        keys, core = self._keys, self.core
        for block in blocks:
            if keys[block.block_id] is not None and keys[block.block_id] == block._block_hash:
                core.held_elsewhere(block.block_id, True)

    def on_unfree(self, block: KVCacheBlock) -> None:
        self.core.reclaim(block.block_id)

    def evict_n(self, n: int) -> list[KVCacheBlock]:
        """The dense core's next `n` victims, in order, forgotten and counted (the core
        clears their keys and notes them as recent victims, `on_evicted`'s work); a
        hybrid model's rules choose them as `HybridRules.next_victim` does, in one
        compiled call over the rules' queues (`DenseCostCore.take_hybrid`)."""
        rules = self.rules
        if rules is not None:  # the rules' choice, in one compiled call
            hash_map = self.cached_block_hash_to_block
            taken, retired = self.core.take_hybrid(
                n, rules.retiring, map_entries(hash_map), copy_index(hash_map), rules.victim_rules
            )
            self.stats.retired += retired
            while len(taken) < n:  # unreachable while the child counts are exact
                block = self.free_block_queue.any_cached(taken)
                self.core.remove(block.block_id)
                self._keys[block.block_id] = None
                taken.append(block)
            self._num_keys -= n
            self.stats.evictions += n  # (`on_evicted`)
            self._evicted.file_recent(taken, "_block_hash")
            return taken
        victims: list[KVCacheBlock] = self.core.pop_victims(n)
        self._num_keys -= len(victims)
        self.stats.evictions += len(victims)
        if len(victims) < n:  # unreachable while the child counts are exact
            stranded = []
            while len(victims) + len(stranded) < n:
                block = self.free_block_queue.any_cached(victims + stranded)
                self.forget(block)
                stranded.append(block)
            self.on_evicted(stranded)
            victims += stranded
        return victims

    def iter_victims(self, gone: Sequence[KVCacheBlock] = ()) -> Iterator[KVCacheBlock]:
        blocks = self.blocks
        nodes = [block.block_id for block in gone]
        if self.rules is not None:
            first = self.rules.queued_first()
            nodes += first
            for block_id in first:
                yield blocks[block_id]
        for block_id in iter_victims(self.core, nodes):
            yield blocks[block_id]

    def evict_next(self, taken: Sequence[KVCacheBlock] = ()) -> KVCacheBlock:
        rules = self.rules
        block_id = self.core.next_victim() if rules is None else rules.next_victim()
        # -1 is unreachable while the child counts are exact; never strand a free block
        block = self.blocks[block_id] if block_id >= 0 else self.free_block_queue.any_cached(taken)
        self.forget(block)
        return block

    # -- helpers ---------------------------------------------------------------------------
    def _record(self, block: KVCacheBlock, parent: Any) -> Any:  # type: ignore[override]
        """`block` under its current hash, given an identity below `parent` (a block id;
        -1 or None: none) if it has none yet; returns its block id."""
        key = block._block_hash
        block_id = block.block_id
        if self._keys[block_id] == key:
            return block_id
        self._adopt(block, key)
        size = self.hash_block_size
        depth = (block._block_hash_num_tokens or size) // size - 1
        self.core.insert_chain(
            [block_id], [depth if depth > 0 else 0], -1 if parent is None else parent
        )
        return block_id

    def _record_chain(  # type: ignore[override]
        self, blocks: list[KVCacheBlock], start: int, end: int, parent: int, loose: bool = False
    ) -> None:
        """`_record` for each block of ``blocks[start:end]`` that holds a hash, each below
        the one before it (the first below `parent`; a block without a hash breaks the
        chain), or with `loose` each below none: the new ones given identities a run at a
        time by the dense core (`DenseCostCore.record_objects`), a block holding another
        hash here."""
        record_objects, size = self.core.record_objects, self.hash_block_size
        while True:
            start, parent, recorded, churn = record_objects(blocks, start, end, parent, size, loose)
            self._num_keys += recorded
            self.stats.churn += churn
            if start >= end:
                return
            parent = self._record(blocks[start], parent)
            if loose:
                parent = -1
            start += 1

    def forget(self, block: KVCacheBlock) -> None:
        """`block` no longer holds the hash the pool accounts for."""
        self.core.remove(block.block_id)
        self._keys[block.block_id] = None
        self._num_keys -= 1

    def check_invariants(self) -> None:
        """Raise AssertionError if a module-level invariant does not hold."""
        queue, core = self.free_block_queue, self.core
        for block in self.blocks:
            if block.is_null:
                continue
            states = [block.ref_cnt > 0, queue.is_fresh(block), queue.is_cached(block)]
            assert sum(states) == 1, f"block {block.block_id}: held/fresh/cached = {states}"
            key = self._keys[block.block_id]
            if key is not None:
                assert key == block.block_hash, f"block {block.block_id}: stale key"
                assert core.is_live(block.block_id), f"block {block.block_id}: no identity"
                assert core.is_evictable(block.block_id) == queue.is_cached(block), block.block_id
            else:
                assert not queue.is_cached(block), f"block {block.block_id}: cached, no key"
                assert not core.is_live(block.block_id), f"block {block.block_id}: identity"
        assert queue.num_free_blocks == sum(
            1 for b in self.blocks if not b.is_null and b.ref_cnt == 0
        )
        assert self._num_keys == sum(1 for key in self._keys if key is not None)
        for block_id in self._tier_copies:
            assert self.blocks[block_id].ref_cnt > 0, f"block {block_id}: a tier's copy, free"
        core.check_invariants()
        if self.rules is not None:
            self.rules.check_invariants()


class DenseFreeQueue(PolicyFreeQueue):
    """`PolicyFreeQueue` kept in the dense core: its fresh blocks are the core's fresh
    list (`DenseCostCore.push_fresh`) and its cached blocks the core's evictable ones (an
    invariant both pools check), so freeing, handing out and taking back a block costs no
    Python object; the core's victims come out counted (`DenseCostPool.evict_n`). The
    evict-first lane stays the parent class's."""

    pool: DenseCostPool

    def __init__(self, pool: DenseCostPool, blocks: list[KVCacheBlock]) -> None:
        super().__init__(pool, [])
        self.core = pool.core
        self.core.push_fresh(blocks, True)

    @property
    def num_free_blocks(self) -> int:
        return self.core.num_fresh + self.core.num_evictable

    def popleft(self) -> KVCacheBlock:
        return self.popleft_n(1)[0]

    def popleft_n(self, n: int) -> list[KVCacheBlock]:
        core = self.core
        pool = self.pool
        if not self._first_entry:
            if core.num_fresh + core.num_evictable < n:
                raise ValueError("Not enough free blocks are available")
            if pool.rules is not None:  # fresh blocks, then the rules' victims
                taken = core.pop_fresh(n) if core.num_fresh else []
                if len(taken) < n:
                    taken += pool.evict_n(n - len(taken))
                return taken
            # one compiled call
            handed: list[KVCacheBlock] = core.take_n(n)
            evicted = core.last_victims
            if evicted:  # `DenseCostPool.evict_n`'s counts
                pool._num_keys -= evicted
                pool.stats.evictions += evicted
            if len(handed) < n:
                handed += pool.evict_n(n - len(handed))
            return handed
        taken: list[KVCacheBlock] = core.pop_fresh(n) if core.num_fresh else []
        if len(taken) < n:
            if len(taken) + core.num_evictable < n:
                raise ValueError("Not enough free blocks are available")
            taken += self._take_victims(n - len(taken))
        return taken

    def remove(self, block: KVCacheBlock) -> None:
        core = self.core
        if core.remove_fresh(block.block_id):
            return
        if self._first_entry.pop(block.block_id, None) is not None and not self._first_entry:
            self._first.clear()
        core.reclaim(block.block_id)

    def append_n(self, blocks: Iterable[KVCacheBlock], held_elsewhere: bool = False) -> None:
        """`PolicyFreeQueue.append_n`. A request's release (no tier involved, every hash
        the one its block was cached under: the usual case) goes to the dense core in one
        pass; anything else through `DenseCostPool.on_free_n`."""
        if not blocks:  # vLLM calls it on every free, with or without blocks
            return
        pool = self.pool
        caching = pool.enable_caching
        if held_elsewhere or pool._tier_copies or not caching:
            released = []
            for item in enumerate(blocks):
                block = item[1]
                if caching and block._block_hash is not None:
                    released.append(item)
                else:
                    self._push_fresh(block, first=False)
            if released:
                pool.on_free_n(released, held_elsewhere)
            return
        releasing = pool.releasing
        objects = blocks if isinstance(blocks, list) else list(blocks)
        rules = pool.rules
        if rules is not None:  # the same pass, sorted as the rules sort (`release_n`)
            odd = self.core.release_hybrid_objects(
                objects,
                releasing.request_hit,
                releasing.output_tokens,
                rules.group_classes,
                copy_index(pool.cached_block_hash_to_block),
                releasing.session,
            )
        else:
            odd = self.core.release_objects(
                objects, releasing.request_hit, releasing.output_tokens, releasing.session
            )
        if odd:  # from a hash the pool does not account for on: in order, as one at a time
            pool.on_free_n(odd)

    def prepend_n(self, blocks: Sequence[KVCacheBlock]) -> None:
        """`PolicyFreeQueue.prepend_n`: blocks holding no hash to the front of the fresh
        list, in one compiled pass; cached ones (another tier holds them) as that does."""
        if not blocks:  # vLLM calls it on every free, with or without blocks
            return
        if not self.pool.enable_caching:
            self.core.push_fresh(list(blocks), True)
            return
        lane = self.core.prepend_objects(blocks if isinstance(blocks, list) else list(blocks))
        if lane:
            super().prepend_n(lane)

    def is_fresh(self, block: KVCacheBlock) -> bool:
        return self.core.is_fresh(block.block_id)

    def is_cached(self, block: KVCacheBlock) -> bool:
        return self.core.is_evictable(block.block_id)

    def cached_blocks(self) -> list[KVCacheBlock]:
        """The cached blocks in the order they were freed (as `PolicyFreeQueue` keeps
        them), so that the fallback of `any_cached` picks what the record pool's would."""
        blocks = self.pool.blocks
        return [blocks[block_id] for block_id in self.core.evictable_nodes()]

    def any_cached(self, taken: Sequence[KVCacheBlock] = ()) -> KVCacheBlock:
        skip = {block.block_id for block in taken}
        return next(b for b in self.cached_blocks() if b.block_id not in skip)

    def make_all_fresh(self) -> None:
        for block in self.cached_blocks():
            self.remove(block)
            self._push_fresh(block, first=True)

    def _push_fresh(self, block: KVCacheBlock, first: bool) -> None:
        self.core.push_fresh([block], first)

    def _eviction_order(self) -> Iterator[KVCacheBlock]:
        blocks, lane = self.pool.blocks, self._first_entry
        for block_id in self.core.fresh_nodes():
            yield blocks[block_id]
        first = [block for block, serial in self._first if lane.get(block.block_id) == serial]
        yield from first
        yield from self.pool.iter_victims(first)

    def _take_victims(self, n: int) -> list[KVCacheBlock]:
        """Evict `n` cached blocks (there are that many): the lane's, then the core's."""
        pool = self.pool
        victims = self._take_lane(n)
        if victims:
            pool.on_evicted(victims)
        if len(victims) < n:
            victims += pool.evict_n(n - len(victims))
        return victims
