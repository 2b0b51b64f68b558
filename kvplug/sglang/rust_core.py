"""kvplug's decisions on SGLang's Rust tree core.

SGLang's default tree core is Rust (`RustUnifiedTreeCore`): the tree, its values, locks,
KV events, sizes and evictions live in Rust, and it ranks with SGLang's own strategies
only. `KVPlugRustTreeCore` is that core (tree-core backend ``kvplug-rust``) with one
change: in the full-attention eviction walk, the leaf it names next
(`evict_device_next_node`) is kvplug's policy's choice. SGLang's walk hands that leaf to
Rust's `evict_device_leaf`, which evicts it as it evicts its own choices (frees, events,
sizes); SGLang's components are its own.

To choose, kvplug keeps a mirror of the tree: one `MirrorRecord` per node, in the same
`EvictionCore` the Python core (`kvplug.sglang.tree_core`) keeps, with the same keys,
depths, hits and releases, learned from the calls the core already serves:

- `match_prefix`: the matched path (`collect_path_info` of its last node): a node the
  match split; the path accessed, root first;
- `begin_insert` / `resume_insert` (its last step): the inserted path: each node walked
  accessed, and hit past the request's earlier inserts; a split; the new leaf, released
  (and stamped by a finishing request);
- `inc_lock_ref`, `inc_full_pin`: lock counts along the path; a node leaving 0 is
  reclaimed; `dec_lock_ref`, `dec_full_pin`: a node reaching 0 is released, root first;
- `evict_device_leaf`: the record leaves; `reset`: nothing is cached.

That is one Rust call per match and per insert, and no Python per tree node walked but
the path's own records. A split's lower part is found by its parent and first page (the
key a radix tree files a child under). The mirror makes the Python core's decisions: the
same events reach the same `EvictionCore` in the same order (tested victim for victim
against it). Partial eviction (`KVPlugTreeCore.split_victim`) splits a victim with a
match of its path up to the split point, as SGLang splits any node a match ends inside;
each record keeps the key it was inserted with (`source`) for that.

Served: full-attention models without a host tier (HiCache) and without EAGLE's bigram
keys; elsewhere kvplug's backend runs the Python core (`rust_core_refusal` says why).

Invariants (`check_invariants` audits them against Rust): the records are exactly the
tree's nodes, each with Rust's parent, span and child count; a record is evictable
exactly while its lock count is 0; the policy's candidates are exactly the unlocked
leaves; the evictable and protected token counts equal Rust's.
"""

from __future__ import annotations

import dataclasses
from itertools import count
from typing import Any

from sglang.srt.mem_cache.radix_cache import RadixKey
from sglang.srt.mem_cache.rust_tree_core.adapter import RustUnifiedTreeCore
from sglang.srt.mem_cache.unified_cache.unified_tree_core_interface import (
    EvictDeviceNextNodeResult,
)
from sglang.srt.mem_cache.utils import get_eviction_strategy

from kvplug.core.eviction import EvictionCore, live_parent
from kvplug.errors import ConfigError
from kvplug.sglang.backend import TREE_CORE_ENV, rust_core_refusal
from kvplug.sglang.prefix_keys import Prefix, node_prefix, root_prefix
from kvplug.sglang.stats import CacheStats
from kvplug.sglang.strategy import kvplug_tree_core_building
from kvplug.sglang.tree_core import (
    FULL,
    NodeRecord,
    ReleasingRequest,
    accessed,
    device_pages,
    page_count,
    released_with,
    span_depth,
    spanning,
)

STOCK_POLICY = "lru"  # what Rust's own (unused) strategy is built with


class MirrorRecord(NodeRecord):
    """A tree node as the mirror keeps it: a `NodeRecord` (``node`` is SGLang's node id)
    with its first token (``start``), its full-attention lock count and the key it was
    inserted with (``source``, whose tokens cover ``[0, end)``)."""

    __slots__ = ("start", "lock", "source", "filed")

    def __init__(
        self,
        serial: int,
        node: int,
        key: bytes,
        start: int,
        end: int,
        page_size: int,
        prefix: Prefix | None = None,
    ) -> None:
        super().__init__(serial, node, key, start, end, page_size, prefix)
        self.start = start
        self.lock = 0
        self.source: RadixKey | None = None
        self.filed: tuple[Any, ...] = ()  # its entry in the mirror's child index


class KVPlugRustTreeCore(RustUnifiedTreeCore):
    """SGLang's Rust tree core, its full-attention victims named by kvplug (module doc)."""

    def __init__(self, params: Any) -> None:
        reason = rust_core_refusal(params, hybrid=False, hicache=False)
        if reason is not None:
            raise ConfigError(
                f"kvplug cannot rank on SGLang's Rust tree core here: {reason}; set "
                f"{TREE_CORE_ENV}=python (or auto)"
            )
        with kvplug_tree_core_building():
            strategy = get_eviction_strategy(params.eviction_policy, params.eviction_policy_config)
        if not hasattr(strategy, "new_policy"):
            raise ConfigError(
                "the kvplug tree core ranks with kvplug's policies only: select one with "
                "--radix-eviction-policy kvplug-<name>"
            )
        self.eviction_strategy = strategy
        self.num_pages = device_pages(params)
        self.stats = CacheStats()  # kept across `reset`: counters since start-up
        self.releasing: ReleasingRequest | None = None  # set by `KVPlugRadixCache`
        self.evict_goal: int | None = None  # tokens an allocation's eviction must free
        super().__init__(
            dataclasses.replace(params, eviction_policy=STOCK_POLICY, eviction_policy_config=None)
        )
        self._start_mirror()

    def _start_mirror(self) -> None:
        self.eviction: EvictionCore[MirrorRecord] = EvictionCore(
            self.eviction_strategy.new_policy(self.page_size, self.num_pages)
        )
        self.splits_victims = self.eviction.policy.values_position
        self.victim_ends = spanning(self.eviction.policy)
        self.keyed = self.eviction.policy.reads_keys
        self.records: dict[int, MirrorRecord] = {}  # node id -> record
        self.last_matched: list[MirrorRecord] = []  # the path of the latest match
        self._children: dict[tuple[Any, ...], MirrorRecord] = {}  # child index
        self._serials = count()
        self._inserting: Any = None  # an insert's params, until its last step
        self._walk_quota = 0
        self._named: set[int] = set()

    def reset(self) -> None:
        super().reset()
        self._start_mirror()

    def set_hicache_enabled(self) -> None:
        raise ConfigError(
            "kvplug ranks a host tier (HiCache) on SGLang's Python tree core only; set "
            f"{TREE_CORE_ENV}=python (or auto)"
        )

    # -- what the tree tells the mirror --------------------------------------------------
    def match_prefix(self, params: Any) -> Any:
        result = super().match_prefix(params)
        record = self.records.get(result.last_device_node)
        if record is not None:  # nothing split: the mirror knows the path
            touched = self._path(record)
        else:
            touched = []
            (path,) = self._binding.collect_path_info([result.last_device_node])
            records = self.records
            for info in path:
                found = records.get(info[0])
                if found is None:  # a node the match split
                    found = self._split_seen(info, params.key, splitting_victim=False)
                touched.append(found)
        for found in touched:  # root first: SGLang stamps parents older
            self._accessed(found)
        self.last_matched = touched
        return result

    def holds(self, record: NodeRecord) -> bool:
        """Whether `record` is still its node's."""
        return self.records.get(record.node) is record

    def begin_insert(self, params: Any) -> Any:
        self._inserting = params
        step = super().begin_insert(params)
        if step.result is not None:
            self._inserted(params, step.result.last_device_node)
        return step

    def resume_insert(self) -> Any:
        step = super().resume_insert()
        if step.result is not None:
            self._inserted(self._inserting, step.result.last_device_node)
        return step

    def _inserted(self, params: Any, node_id: int) -> None:
        """The insert of `params` ended at `node_id`: the path it walked, root first."""
        self._inserting = None
        inserted_len = params.inserted_len or 0
        eviction = self.eviction
        known = self.records.get(node_id)
        if known is not None:  # it created and split nothing: the mirror knows the path
            for record in self._path(known):
                self._accessed(record)  # SGLang stamps each node its insert walks
                if record.end > inserted_len:  # this request's earlier inserts counted
                    eviction.hit(record)
                    self.stats.block_hits += 1
            return
        (path,) = self._binding.collect_path_info([node_id])
        records = self.records
        for info in path:
            record = records.get(info[0])
            if record is not None:
                self._accessed(record)
            elif info[5]:  # new, with a child: the upper part of a node this insert split
                lower = self._filed_under(info[1], params.key, info[2])
                self._accessed(lower)  # stamped before the split, as a whole
                record = self._split(info, lower, params.key, splitting_victim=False)
            else:  # the leaf this insert created: counted as its insert, not a reuse
                self._new_leaf(info, params.key)
                continue
            if info[3] > inserted_len:
                eviction.hit(record)
                self.stats.block_hits += 1

    def _new_leaf(self, info: tuple[Any, ...], key: RadixKey) -> MirrorRecord:
        node_id, parent_id, start, end = info[0], info[1], info[2], info[3]
        parent = self.records.get(parent_id)
        tokens = key.raw_token_ids()
        record, inside = self._record(node_id, parent, key, start, end, tokens, new=True)
        self._file(record, parent_id, tokens)
        eviction = self.eviction
        eviction.insert(record, parent, inside)
        eviction.touch(record)  # SGLang stamps a new node as accessed
        if self.releasing is not None:  # inserted by a finished request: on its path
            self.releasing.stamp(record)
        eviction.release(record)  # SGLang adds it unlocked; a lock may follow
        return record

    def _split_seen(
        self, info: tuple[Any, ...], key: RadixKey, *, splitting_victim: bool
    ) -> MirrorRecord:
        """A node the mirror does not know, on a path: the upper part of a split."""
        lower = self._filed_under(info[1], key, info[2])
        return self._split(info, lower, key, splitting_victim=splitting_victim)

    def _split(
        self,
        info: tuple[Any, ...],
        lower: MirrorRecord,
        key: RadixKey,
        *,
        splitting_victim: bool,
    ) -> MirrorRecord:
        """`lower` was split: node ``info[0]`` holds its first part ``[info[2], info[3])``
        (what `KVPlugTreeCore._split_node` tells the core, in its order)."""
        node_id, parent_id, start, end = info[0], info[1], info[2], info[3]
        page_size = self.page_size
        parent = live_parent(lower)
        source = lower.source
        assert source is not None
        tokens = source.raw_token_ids()
        upper = self._record(node_id, parent, source, start, end, tokens)[0]
        upper.lock = lower.lock
        del self._children[lower.filed]
        self._file(upper, parent_id, tokens)
        lower.start = end
        lower.depth = span_depth(end, lower.end, page_size)
        lower.blocks = page_count(end, lower.end, page_size)
        self._file(lower, node_id, tokens)
        released_with(upper, lower, page_size)
        self.eviction.touch(upper)  # stamped at its creation, before the lower part
        self.eviction.split(upper, lower)
        if not splitting_victim:  # the lower part of a victim keeps its rank
            self._accessed(lower)  # SGLang stamps the lower part as accessed now
        return upper

    def _accessed(self, record: MirrorRecord) -> None:
        accessed(self.eviction, record)

    def inc_lock_ref(self, node_id: int, skip_lock_components: Any = ()) -> Any:
        result = super().inc_lock_ref(node_id, skip_lock_components)
        self._lock(node_id)
        return result

    def inc_full_pin(self, node_id: int) -> None:
        super().inc_full_pin(node_id)
        self._lock(node_id)

    def dec_lock_ref(self, node_id: int, params: Any, skip_swa: bool = False) -> Any:
        result = super().dec_lock_ref(node_id, params, skip_swa)
        self._unlock(node_id)
        return result

    def dec_full_pin(self, node_id: int) -> None:
        super().dec_full_pin(node_id)
        self._unlock(node_id)

    def _lock(self, node_id: int) -> None:
        """SGLang locked the path from `node_id` to the root: the nodes that were unlocked
        (a bottom segment of the path) are reclaimed, bottom first."""
        record = self.records.get(node_id)
        reclaim = self.eviction.reclaim
        while record is not None:
            record.lock += 1
            if record.lock == 1:
                reclaim(record)
            parent = record.parent  # live_parent(record), inlined: a walk per request
            record = (
                parent if parent is not None and parent.serial == record.parent_serial else None
            )  # type: ignore[assignment]

    def _unlock(self, node_id: int) -> None:
        """SGLang unlocked the path from `node_id`: the nodes left unlocked are released,
        root first, each learning what a finishing request knew."""
        record = self.records.get(node_id)
        freed = []
        while record is not None:
            record.lock -= 1
            if record.lock == 0:
                freed.append(record)
            parent = record.parent
            record = (
                parent if parent is not None and parent.serial == record.parent_serial else None
            )  # type: ignore[assignment]
        release = self.eviction.release
        releasing = self.releasing
        for record in reversed(freed):
            if releasing is not None:
                releasing.stamp(record)
            release(record)

    @staticmethod
    def _path(record: MirrorRecord) -> list[MirrorRecord]:
        """The records from the root's child down to `record`."""
        path = [record]
        while True:
            parent = record.parent
            if parent is None or parent.serial != record.parent_serial:
                break
            record = parent  # type: ignore[assignment]
            path.append(record)
        path.reverse()
        return path

    # -- the full-attention eviction walk -----------------------------------------------
    def evict_device_start(self, component_type: Any, request_cnt: int) -> None:
        super().evict_device_start(component_type, request_cnt)
        if component_type == FULL:
            self._walk_quota = request_cnt
            self._named = set()

    def evict_device_next_node(self, component_type: Any, tracker: Any) -> Any:
        if component_type != FULL:
            return super().evict_device_next_node(component_type, tracker)
        if tracker[FULL] >= self._walk_quota:
            return EvictDeviceNextNodeResult()
        victim = self.eviction.next_victim()
        named = self._named
        if victim is not None and victim.node in named:
            # a leaf named before in this walk stayed: the next one in the policy's order
            victim = next((r for r in self.eviction.iter_victims() if r.node not in named), None)
        if victim is None:
            return EvictDeviceNextNodeResult()
        if self.splits_victims:
            goal = self.evict_goal if self.evict_goal is not None else self._walk_quota
            page = self.page_size
            needed = -(-(goal - tracker[FULL]) // page) * page
            if 0 < needed < victim.end - victim.start:
                self._split_victim(victim, needed)
        named.add(victim.node)
        return EvictDeviceNextNodeResult(node_id=victim.node, made_progress=True)

    def _split_victim(self, victim: MirrorRecord, tokens: int) -> None:
        """Split the victim leaf so that it keeps its last `tokens` tokens and a new
        parent the rest, by a match of its path up to there (Rust splits the node a match
        ends inside); the eviction then frees only those."""
        source = victim.source
        assert source is not None
        cut = victim.end - tokens
        key = RadixKey(source.raw_token_ids()[:cut], source.extra_key, cache_salt=source.cache_salt)
        result = self._binding.match_prefix(
            self._bindings.MatchParamsBinding(
                key=key.token_ids, extra_key=key.extra_key, cache_salt=key.cache_salt
            )
        )
        (path,) = self._binding.collect_path_info([result.last_device_node_id])
        info = path[-1]
        assert info[0] not in self.records and info[3] == cut, "the victim did not split"
        self._split(info, victim, source, splitting_victim=True)

    def evict_device_leaf(self, node_id: int, is_write_back: bool) -> Any:
        result = super().evict_device_leaf(node_id, is_write_back)
        record = self.records.pop(node_id)
        del self._children[record.filed]
        if self.victim_ends is not None and record.source is not None:
            self.victim_ends.add(record.end, record.source.raw_token_ids()[record.end - 1])
        self.eviction.remove(record)
        self.stats.evictions += 1
        record.serial = -1  # records naming it as parent see a dead link
        return result

    def next_victim(self) -> int | None:
        """The node id kvplug's policy evicts next, or None."""
        record = self.eviction.next_victim()
        return None if record is None else record.node

    # -- helpers ------------------------------------------------------------------------
    def _record(
        self,
        node_id: int,
        parent: MirrorRecord | None,
        source: RadixKey,
        start: int,
        end: int,
        tokens: Any,
        new: bool = False,
    ) -> tuple[MirrorRecord, list[bytes]]:
        """Node `node_id`'s record, filed, keyed by its prefix (`KVPlugTreeCore._new_record`);
        with `new`, also the keys of its pages where a recent victim ended."""
        prefix, key, inside = None, b"", []  # a policy that reads no key gets none
        if self.keyed:
            before = (
                parent.prefix
                if parent is not None and parent.prefix is not None
                else root_prefix(source.extra_key, source.cache_salt)
            )
            prefix, inside = node_prefix(
                before, start, tokens[start:end], self.page_size, self.victim_ends if new else None
            )
            key = prefix.key
        record = MirrorRecord(next(self._serials), node_id, key, start, end, self.page_size, prefix)
        record.source = source
        self.records[node_id] = record
        return record, inside

    def _file(self, record: MirrorRecord, parent_id: int, tokens: Any) -> None:
        """File `record` under its parent by its first page, as the tree files it."""
        source = record.source
        assert source is not None
        entry = (
            parent_id,
            source.extra_key,
            source.cache_salt,
            tokens[record.start : record.start + self.page_size].tobytes(),
        )
        record.filed = entry
        self._children[entry] = record

    def _filed_under(self, parent_id: int, key: RadixKey, start: int) -> MirrorRecord:
        tokens = key.raw_token_ids()
        entry = (
            parent_id,
            key.extra_key,
            key.cache_salt,
            tokens[start : start + self.page_size].tobytes(),
        )
        return self._children[entry]

    def check_invariants(self) -> None:
        """Raise AssertionError if a module-level invariant does not hold."""
        records = self.records
        ids = list(records)
        paths = self._binding.collect_path_info(ids) if ids else ()
        for node_id, path in zip(ids, paths, strict=True):
            record = records[node_id]
            info = path[-1]
            assert info[0] == node_id
            assert (info[2], info[3]) == (record.start, record.end), f"node {node_id}: span"
            assert record.depth == span_depth(record.start, record.end, self.page_size)
            assert record.blocks == page_count(record.start, record.end, self.page_size)
            if self.keyed:  # its key is its whole prefix's, whatever the splits since
                assert record.source is not None and record.prefix is not None
                tokens = record.source.raw_token_ids()
                whole = node_prefix(
                    root_prefix(record.source.extra_key, record.source.cache_salt),
                    0,
                    tokens[: record.end],
                    self.page_size,
                )[0]
                assert record.prefix == whole and record.key == whole.key, node_id
            parent = live_parent(record)
            if parent is None:  # below a root
                assert info[1] not in records, f"node {node_id}: parent link is stale"
            else:
                assert parent.node == info[1], f"node {node_id}: parent"
            assert record.cached_children == info[5], f"node {node_id}: child count"
            assert record.evictable == (record.lock == 0), f"node {node_id}: evictable"
            assert self._children[record.filed] is record, f"node {node_id}: child index"
        assert len(self._children) == len(records)
        evictable = sum(r.end - r.start for r in records.values() if r.lock == 0)
        protected = sum(r.end - r.start for r in records.values() if r.lock > 0)
        assert evictable == self.full_evictable_size(), "evictable tokens differ from Rust's"
        assert protected == self.full_protected_size(), "protected tokens differ from Rust's"
        candidates = {r.node for r in records.values() if self.eviction.is_candidate(r)}
        leaves = {r.node for r in records.values() if r.lock == 0 and r.cached_children == 0}
        assert candidates == leaves and len(self.eviction) == len(leaves)
        assert sum(1 for r in records.values() if r.evictable) == self.eviction.num_evictable


__all__ = ["KVPlugRustTreeCore", "MirrorRecord"]
