"""SGLang's Python radix tree with kvplug's eviction core kept beside it.

`KVPlugTreeCore` is SGLang's `UnifiedTreeCore` (registered as the tree-core backend
``kvplug``). SGLang keeps its tree, values, sizes, locks, leaf sets, events and metrics;
kvplug keeps, in the shared `kvplug.core.eviction.EvictionCore`, one `NodeRecord` per
tree node that holds full-attention KV on the device, and the policy's candidates among
them. The components (`kvplug.sglang.components`) ask the core for the next victim.

What the tree tells the core, and where:

| SGLang event | core call | hook |
|---|---|---|
| a node is added (insert) | `insert` below its parent's record; `release` | `_add_new_node` |
| a node is split | `split`: the new upper node takes the lower's place | `_split_node` |
| a request counts a hit on a node | `hit` | `_inc_hit_count_and_check` |
| an unlocked node is accessed | `reclaim`, `release` | `_touch_node`, `_match_post_processor` |
| full-attention lock 0 -> 1 / 1 -> 0 | `reclaim` / `release` | `KVPlugFullComponent` |
| a node's full-attention KV is freed | `remove` | `KVPlugFullComponent.evict_component` |

Invariants (`check_invariants` audits them):

- every non-root node with full-attention device KV has exactly one record, and no other
  node has one; a record is evictable exactly while its node's full lock count is 0;
- the policy's candidates are exactly SGLang's ``evictable_device_leaves``, so the
  victim kvplug names is always one SGLang may evict.

Recency. SGLang's own ``lru`` orders leaves by ``last_access_time``, which node creation,
its match and insert walks (parents older than children) and a split (the lower part)
stamp, held or not. kvplug reports every such stamp to the core (`touch`, in the order
SGLang stamped them, root first); a record is released when its lock count drops to 0,
and released again (re-ranked) when SGLang stamps it while it is unlocked. kvplug's
``lru`` takes a touched node's place from its latest touch, so a node held across newer
insertions keeps the older place SGLang gives it: ``kvplug-lru`` evicts exactly as
SGLang's ``lru`` (tested operation for operation). Other policies ignore touches and see
each release, the moment SGLang considers the node used or let go.
A node's ``depth`` is the page index of its last page (a split does not change it).

Sliding-window and Mamba state. `reset` replaces SGLang's LRU lists of those components
with `RankedLRUList`s (`kvplug.sglang.ranked_lru`), each keeping a kvplug `RankedSet`
with its own policy from the strategy, bound to its own pool's size; the kvplug
components take their victims from it. `check_invariants` audits that each ranked set's
members are exactly the nodes holding that state, its candidates exactly those not locked
for it, and, with ``lru``, that its order is SGLang's list order.
"""

from __future__ import annotations

from itertools import count
from typing import Any

import xxhash
from sglang.srt.mem_cache.unified_cache.component_type import ComponentType
from sglang.srt.mem_cache.unified_cache.unified_tree_core import UnifiedTreeCore

from kvplug.core.eviction import EvictionCore, live_parent
from kvplug.core.keys import encode_fields
from kvplug.core.ranked_set import RankedSet
from kvplug.errors import ConfigError
from kvplug.sglang.ranked_lru import RankedLRUList
from kvplug.sglang.stats import CacheStats

FULL, SWA, MAMBA = ComponentType.FULL, ComponentType.SWA, ComponentType.MAMBA
RANKED_COMPONENTS = (SWA, MAMBA)  # components whose state kvplug ranks in a `RankedSet`


class NodeRecord:
    """One tree node's record while it holds full-attention KV on the device: a
    `kvplug.core.eviction.TreeNode`. ``end`` is the token count from the root to the
    node's last token."""

    __slots__ = (
        "serial", "key", "depth", "hits", "from_end", "request_hit", "request_output",
        "held_elsewhere",
        "parent", "parent_serial", "cached_children", "evictable", "node", "end",
    )  # fmt: skip

    def __init__(self, serial: int, node: Any, key: bytes, end: int, page_size: int) -> None:
        self.serial = serial
        self.node = node
        self.key = key
        self.end = end
        self.depth = max((end + page_size - 1) // page_size - 1, 0)
        self.hits = 0
        self.from_end = 0
        self.request_hit = False
        self.request_output = 0
        self.held_elsewhere = False
        self.parent: NodeRecord | None = None
        self.parent_serial = -1
        self.cached_children = 0
        self.evictable = False


class KVPlugTreeCoreMixin:
    """The kvplug part of the tree core; placed before SGLang's class in the MRO."""

    eviction: EvictionCore[NodeRecord]
    records: dict[int, NodeRecord]  # node id -> record
    eviction_strategy: Any
    page_size: int
    root_node: Any

    def __init__(self, params: Any, components: dict[Any, Any]) -> None:
        allocator = params.token_to_kv_pool_allocator
        tokens = getattr(allocator, "size", 0) if allocator is not None else 0
        self.num_pages = max(tokens // params.page_size, 1)
        swa_tokens = getattr(allocator, "size_swa", 0) if allocator is not None else 0
        mamba_pool = getattr(params.req_to_token_pool, "mamba_pool", None)
        self.state_capacity = {  # what each ranked component's policy is bound to
            SWA: max(swa_tokens // params.page_size, 1),
            MAMBA: max(getattr(mamba_pool, "size", 0), 1),
        }
        self.stats = CacheStats()  # kept across `reset`: counters since start-up
        super().__init__(params, components)  # type: ignore[call-arg]

    def reset(self) -> None:
        super().reset()  # type: ignore[misc]
        strategy = self.eviction_strategy
        if not hasattr(strategy, "new_policy"):
            raise ConfigError(
                "the kvplug tree core ranks with kvplug's policies only: select one with "
                "--radix-eviction-policy kvplug-<name>"
            )
        self.eviction = EvictionCore(strategy.new_policy(self.page_size, self.num_pages))
        self.records = {}
        self._serials = count()
        for ct in RANKED_COMPONENTS:
            if ct not in self.lru_lists:
                continue
            policy = strategy.new_policy(self.page_size, self.state_capacity[ct])
            self.lru_lists[ct] = RankedLRUList(
                ct,
                self.component_types,  # type: ignore[attr-defined]
                RankedSet(policy),
                self.describe,
                self._serials,
                is_referenced=self._session_lru_predicate(ct),  # type: ignore[attr-defined]
            )

    def ranked_lru(self, component_type: Any) -> RankedLRUList:
        """The LRU list, with its ranked set, of a component kvplug ranks (SWA, Mamba)."""
        lru = self.lru_lists[component_type]  # type: ignore[attr-defined]
        assert isinstance(lru, RankedLRUList), f"{component_type} state is not ranked by kvplug"
        return lru

    # -- tree events ----------------------------------------------------------------------
    def _add_new_node(self, parent: Any, key: Any, value: Any, *args: Any, **kwargs: Any) -> Any:
        node = super()._add_new_node(parent, key, value, *args, **kwargs)  # type: ignore[misc]
        parent_record = self.records.get(parent.id)
        end = (parent_record.end if parent_record is not None else 0) + len(key)
        record = self._new_record(node, parent_record, end)
        self.eviction.insert(record, parent_record)
        self.eviction.touch(record)  # SGLang stamps a new node as accessed
        self.eviction.release(record)  # SGLang adds it unlocked; a lock may follow
        return node

    def _split_node(self, key: Any, child: Any, split_len: int) -> Any:
        result = super()._split_node(key, child, split_len)  # type: ignore[misc]
        lower = self.records.get(child.id)
        if lower is None:  # a node without device KV (host only): nothing is ranked
            return result
        upper_node = result[0]
        parent = live_parent(lower)
        upper = self._new_record(upper_node, parent, lower.end - len(child.key))  # type: ignore[arg-type]
        self.eviction.touch(upper)  # stamped at its creation, before the lower part
        self.eviction.split(upper, lower)
        self._accessed(lower)  # SGLang stamps the lower part as accessed now
        return result

    def _touch_node(self, node: Any) -> None:
        super()._touch_node(node)  # type: ignore[misc]
        record = self.records.get(node.id)
        if record is not None:
            self._accessed(record)

    def _match_post_processor(
        self, params: Any, value: Any, best_match_node: Any, *args: Any, **kwargs: Any
    ) -> Any:
        result = super()._match_post_processor(  # type: ignore[misc]
            params, value, best_match_node, *args, **kwargs
        )
        records, root, touched = self.records, self.root_node, []
        node = best_match_node
        while node is not None and node is not root:
            record = records.get(node.id)
            if record is not None:
                touched.append(record)
            node = node.parent
        for record in reversed(touched):  # root first: SGLang stamps parents older
            self._accessed(record)
        return result

    def _accessed(self, record: NodeRecord) -> None:
        """SGLang stamped the node as accessed now: the core hears of it (`touch`), and
        an evictable node is ranked again, as if released now; a held one keeps the
        access for its release (recency-ordered policies rank it from there)."""
        self.eviction.touch(record)
        if record.evictable:
            self.eviction.reclaim(record)
            self.eviction.release(record)

    def _inc_hit_count_and_check(self, node: Any) -> bool:
        record = self.records.get(node.id)
        if record is not None:
            self.eviction.hit(record)
            self.stats.block_hits += 1
        for ct in RANKED_COMPONENTS:
            lru = self.lru_lists.get(ct)  # type: ignore[attr-defined]
            if isinstance(lru, RankedLRUList):
                lru.hit(node)
        return super()._inc_hit_count_and_check(node)  # type: ignore[misc]

    # -- called by the components ---------------------------------------------------------
    def forget(self, node: Any) -> None:
        """`node`'s full-attention device KV is being freed: its record leaves."""
        record = self.records.pop(node.id, None)
        if record is not None:
            self.eviction.remove(record)
            self.stats.evictions += 1
            record.serial = -1  # records naming it as parent see a dead link

    def next_victim(self) -> Any:
        """The node kvplug's policy evicts next, or None."""
        record = self.eviction.next_victim()
        return None if record is None else record.node

    # -- helpers ----------------------------------------------------------------------------
    def _new_record(self, node: Any, parent: NodeRecord | None, end: int) -> NodeRecord:
        digest = self._prefix_key(node, parent)
        record = NodeRecord(next(self._serials), node, digest, end, self.page_size)
        self.records[node.id] = record
        return record

    @staticmethod
    def _prefix_key(node: Any, parent: NodeRecord | None) -> bytes:
        """The digest of the node's tokens after its parent's key (the policies' `key`)."""
        radix_key = node.key
        tokens = radix_key.token_ids[: len(radix_key)].tobytes()
        extra = encode_fields((radix_key.extra_key or "", radix_key.cache_salt or ""))
        parent_key: bytes = parent.key if parent is not None else b""  # type: ignore[assignment]
        return xxhash.xxh3_64_digest(parent_key + extra + tokens)

    def describe(self, node: Any) -> tuple[bytes, int]:
        """(prefix key, depth) of a node, for the ranked components' records: those of
        its full-attention record if it has one yet, else derived from its parent's (a
        node split off a moment ago)."""
        record = self.records.get(node.id)
        if record is not None:
            return record.key, record.depth
        parent = self.records.get(node.parent.id) if node.parent is not None else None
        end = (parent.end if parent is not None else 0) + len(node.key)
        depth = max((end + self.page_size - 1) // self.page_size - 1, 0)
        return self._prefix_key(node, parent), depth

    def check_invariants(self) -> None:
        """Raise AssertionError if a module-level invariant does not hold."""
        nodes = self._collect_all_nodes()  # type: ignore[attr-defined]
        holding = {
            node.id
            for node in nodes
            if node is not self.root_node and node.component_data[FULL].value is not None
        }
        assert holding == set(self.records), "records do not match the nodes holding KV"
        for node in nodes:
            record = self.records.get(node.id)
            if record is None:
                continue
            assert record.node is node
            assert record.evictable == (node.component_data[FULL].lock_ref == 0), node.id
            parent = live_parent(record)
            parent_node = None if parent is None else parent.node
            expected = node.parent if node.parent is not self.root_node else None
            assert parent_node is expected, f"node {node.id}: parent link is stale"
            children = sum(1 for child in node.children.values() if child.id in self.records)
            assert record.cached_children == children, f"node {node.id}: child count"
        candidates = {
            record.node.id for record in self.records.values() if self.eviction.is_candidate(record)
        }
        leaves = {node.id for node in self.evictable_device_leaves}  # type: ignore[attr-defined]
        assert candidates == leaves, f"candidates {candidates} != SGLang's leaves {leaves}"
        assert len(self.eviction) == len(candidates)
        for ct in RANKED_COMPONENTS:
            lru = self.lru_lists.get(ct)  # type: ignore[attr-defined]
            if isinstance(lru, RankedLRUList):
                self._check_ranked(ct, lru, nodes)

    def _check_ranked(self, ct: Any, lru: RankedLRUList, nodes: list[Any]) -> None:
        """A ranked component's members are exactly the nodes holding its device state,
        its candidates exactly those of them not locked for it; with ``lru`` its order is
        SGLang's list order."""
        lru.ranked.check()
        root = self.root_node
        holding = {n.id for n in nodes if n is not root and n.component_data[ct].value is not None}
        members = {record.node.id for record in lru.ranked}
        assert members == holding == set(lru.records), f"{ct}: members {members} != {holding}"
        for node_id, record in lru.records.items():
            assert record.node.id == node_id and record in lru.ranked
        unlocked = {n.id for n in nodes if n.id in holding and n.component_data[ct].lock_ref == 0}
        candidates = {r.node.id for r in lru.ranked if r.node.component_data[ct].lock_ref == 0}
        assert candidates == unlocked, f"{ct}: candidates {candidates} != {unlocked}"
        if lru.ranked.policy.name == "lru":
            ranked = [record.node.id for record in lru.ranked.ordered()]
            listed = [node.id for node in lru.order_from_lru()]
            assert ranked == listed, f"{ct}: kvplug-lru order {ranked} != SGLang's {listed}"


class KVPlugTreeCore(KVPlugTreeCoreMixin, UnifiedTreeCore):
    """SGLang's Python `UnifiedTreeCore` with kvplug's eviction core (see the module doc)."""


def kvplug_tree_core_factory(params: Any, components: dict[Any, Any]) -> KVPlugTreeCore:
    """The ``kvplug`` entry of SGLang's tree-core registry."""
    return KVPlugTreeCore(params, components)
