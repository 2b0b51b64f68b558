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
| ... but not the leaf its insert creates | | `_insert_tail_step` |
| an unlocked node is accessed | `reclaim`, `release` | `_touch_node`, `_match_post_processor` |
| full-attention lock 0 -> 1 / 1 -> 0 | `reclaim` / `release` | `KVPlugFullComponent` |
| a node's full-attention KV is freed | `remove` | `KVPlugFullComponent.evict_component` |

Invariants (`check_invariants` audits them):

- every non-root node with full-attention device KV has exactly one record, and no other
  node has one; a record is evictable exactly while its node's full lock count is 0;
- the policy's candidates are exactly SGLang's ``evictable_device_leaves``, so the
  victim kvplug names is always one SGLang may evict;
- a record is `held_elsewhere` exactly while its node's full-attention KV has a host
  copy; the `host` members are exactly the host-only nodes (host KV, no device KV).

Recency. SGLang's own ``lru`` orders leaves by ``last_access_time``, which node creation,
its match and insert walks (parents older than children) and a split (the lower part)
stamp, held or not. kvplug reports every such stamp to the core (`touch`, in the order
SGLang stamped them, root first); a record is released when its lock count drops to 0,
and released again (re-ranked) when SGLang stamps it while it is unlocked. kvplug's
``lru`` takes a touched node's place from its latest touch, so a node held across newer
insertions keeps the older place SGLang gives it: ``kvplug-lru`` evicts exactly as
SGLang's ``lru`` (tested operation for operation). Other policies ignore touches and see
each release, the moment SGLang considers the node used or let go.
Hits. SGLang's ``hit_count`` counts the requests whose insert passed a node, the one
that created it included (it drives HiCache's write-through threshold); a reuse is every
later one, so kvplug's `hit` skips the creating insert's count. Counting it would make
every node look reused once and close every trial as a reuse.

Value per byte. A node spans many pages and is evicted whole; what keeping it saves per
page is the mean of its pages' values, and a page's value is affine in its position, so
a node's ``depth`` is the page index at the middle of its span, not of its last page
(which would price a long unique suffix as its deepest page). A split gives each part
the middle of its own span.

Partial eviction. SGLang frees a victim node whole, however few pages the allocation
needs; kvplug's own cache evicts one block at a time from a chain's tail. Under a policy
that values position (`values_position`: ``cost``, ``gdsf``), the kvplug component
splits a victim leaf that spans more pages than the walk still needs (SGLang's own
`_split_node`, as a match splits) and evicts the tail part only; the head stays cached,
a leaf ranked on its own. Only where a split touches the full-attention component alone
(no sliding-window, Mamba or HiCache state to split); ``lru`` keeps SGLang's whole-node
order.

What the request knew. When a finished request hands its KV to the tree (SGLang's
``checkpoint_into_tree``, then the lock release), the records it releases learn what
kvplug's own cache tells its policy at a release (`kvplug.policies.base`): the pages of
that request after the node (``from_end``: 0 for its leaf), whether it reused the cache
(SGLang's ``req.cached_tokens``), and how many tokens it generated.
`KVPlugRadixCache` opens the `ReleasingRequest` and closes it at ``on_release``.

Keys and returns. A record is keyed by its prefix (`kvplug.sglang.prefix_keys`): the same
tokens give the same key however the tree splits them. The device policy is told that
its nodes span pages (``spans_blocks``, each record's ``blocks``), so `cost` weighs what a
node teaches by its pages and sizes its ghost history in pages, as kvplug's own cache
does per block; and a new node looks up the keys of its pages where a recent victim
ended (`VictimEnds`), so a victim's prefix that comes back inside a longer node (a
conversation's next turn, or one re-inserted over different boundaries) counts as its
return. Both tree cores key and look up alike.

Tiers (``--enable-hierarchical-cache``). SGLang's HiCache copies device KV to a host pool
(write-through on hits, or write-back at eviction) and *demotes* a device leaf whose KV
the host holds: its device KV is freed, the node stays in the tree, host-only, and a
later hit loads it back. kvplug follows every tier change:

- a device node's KV is backed up to the host: its record is `held_elsewhere`
  (`_update_duplicate_tracking`, the full component's backup commit);
- a device node's host copy is freed: not `held_elsewhere` any more
  (`_release_full_host_duplicate`);
- a node is demoted (device KV freed, host copy kept): its record leaves and a `host`
  member joins (`forget`);
- a host-only node's KV is loaded back, or re-inserted: a record joins, held if the node
  is locked, and the member leaves (`gain_device`);
- a host leaf is evicted: its member leaves (`forget_host`).

So a device node the host holds is priced by the policy as a reload (`cost` values it
at ``min(recompute, reload)``, `kvplug.policies.reload`) and demoted before an equally
valuable node held nowhere else. The host tier is ranked by its own instance of the
same policy (bound to the host pool's size): `host` is a `RankedSet` of the host-only
nodes, carrying each node's hits over from its device record, and the full component's
host eviction takes its victims from it, the lowest-ranked of SGLang's
``evictable_host_leaves`` first.

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

from sglang.srt.mem_cache.unified_cache.component_type import ComponentType
from sglang.srt.mem_cache.unified_cache.unified_tree_core import UnifiedTreeCore

from kvplug.core.eviction import EvictionCore, live_parent
from kvplug.core.ranked_set import RankedSet
from kvplug.errors import ConfigError
from kvplug.policies.base import EvictionPolicy
from kvplug.sglang.prefix_keys import (
    Prefix,
    VictimEnds,
    chunk_tokens,
    extend,
    node_prefix,
    root_prefix,
)
from kvplug.sglang.ranked_lru import RankedLRUList, StateRecord
from kvplug.sglang.stats import CacheStats
from kvplug.sglang.strategy import kvplug_tree_core_building

FULL, SWA, MAMBA = ComponentType.FULL, ComponentType.SWA, ComponentType.MAMBA
RANKED_COMPONENTS = (SWA, MAMBA)  # components whose state kvplug ranks in a `RankedSet`


def last_page(end: int, page_size: int) -> int:
    """The index of the page holding the token before `end`."""
    return max((end + page_size - 1) // page_size - 1, 0)


def span_depth(start: int, end: int, page_size: int) -> int:
    """The page index at the middle of the tokens ``[start, end)``: the depth that prices
    a node holding them at the mean value of its pages (see the module doc)."""
    first = start // page_size
    return (first + max(last_page(end, page_size), first)) // 2


def page_count(start: int, end: int, page_size: int) -> int:
    """The pages that the tokens ``[start, end)`` touch (at least 1)."""
    return max(last_page(end, page_size) - start // page_size + 1, 1)


def spanning(policy: EvictionPolicy) -> VictimEnds | None:
    """Tell the device tree's `policy` (bound) that its nodes span pages (``blocks``);
    returns where to note victims' ends if it remembers victims (`VictimEnds`)."""
    policy.spans_blocks = True
    capacity = policy.ghost_capacity
    return VictimEnds(capacity) if capacity > 0 else None


class ReleasingRequest:
    """A finished request while SGLang hands its KV to the tree: what each record it
    releases learns about it (see the module doc)."""

    __slots__ = ("page_size", "last_page", "hit", "output", "session")

    def __init__(
        self, tokens: int, page_size: int, hit: bool, output: int, session: bool = False
    ) -> None:
        self.page_size = page_size
        self.last_page = last_page(tokens, page_size)
        self.hit = hit
        self.output = output
        self.session = session  # it named a session (`kvplug.core.sessions`)

    def stamp(self, record: NodeRecord) -> None:
        """`record`, on this request's path, is released by it."""
        record.from_end = max(self.last_page - last_page(record.end, self.page_size), 0)
        record.request_hit = self.hit
        record.request_output = self.output
        record.request_session = self.session


def device_pages(params: Any) -> int:
    """The pages of full-attention KV SGLang's `CacheInitParams` give the device pool (at
    least 1): what the tree's policy is bound to."""
    allocator = params.token_to_kv_pool_allocator
    tokens = getattr(allocator, "size", 0) if allocator is not None else 0
    return max(tokens // params.page_size, 1)


def accessed(eviction: EvictionCore[Any], record: NodeRecord) -> None:
    """SGLang stamped the node as accessed now: the core hears of it (`touch`), and an
    evictable node is ranked again, as if released now; a held one keeps the access for
    its release (recency-ordered policies rank it from there)."""
    eviction.touch(record)
    if record.evictable:
        eviction.reclaim(record)
        eviction.release(record)


def released_with(upper: NodeRecord, lower: NodeRecord, page_size: int) -> None:
    """`upper`, split off above `lower`, was released with it, by the same request: it
    learns what `lower` learned of that request (`ReleasingRequest.stamp`)."""
    upper.from_end = (
        lower.from_end + last_page(lower.end, page_size) - last_page(upper.end, page_size)
    )
    upper.request_hit, upper.request_output = lower.request_hit, lower.request_output
    upper.request_session = lower.request_session


class NodeRecord:
    """One tree node's record while it holds full-attention KV on the device: a
    `kvplug.core.eviction.TreeNode`. ``end`` is the token count from the root to the
    node's last token; ``depth`` the middle page of its span (`span_depth`)."""

    __slots__ = (
        "serial", "key", "depth", "hits", "from_end", "request_hit", "request_output",
        "request_session", "held_elsewhere",
        "parent", "parent_serial", "cached_children", "evictable", "node", "end",
        "prefix", "blocks",
    )  # fmt: skip

    def __init__(
        self,
        serial: int,
        node: Any,
        key: bytes,
        start: int,
        end: int,
        page_size: int,
        prefix: Prefix | None = None,
    ) -> None:
        self.serial = serial
        self.node = node
        self.key = key  # its prefix's key at its last token (`kvplug.sglang.prefix_keys`)
        self.prefix = prefix  # its prefix's hash there, which its children continue
        self.end = end
        self.depth = span_depth(start, end, page_size)
        self.blocks = page_count(start, end, page_size)  # a `SpanningNode`
        self.hits = 0
        self.from_end = 0
        self.request_hit = False
        self.request_output = 0
        self.request_session = False
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
        self.num_pages = device_pages(params)
        swa_tokens = getattr(allocator, "size_swa", 0) if allocator is not None else 0
        mamba_pool = getattr(params.req_to_token_pool, "mamba_pool", None)
        self.state_capacity = {  # what each ranked component's policy is bound to
            SWA: max(swa_tokens // params.page_size, 1),
            MAMBA: max(getattr(mamba_pool, "size", 0), 1),
        }
        self.stats = CacheStats()  # kept across `reset`: counters since start-up
        self.releasing: ReleasingRequest | None = None  # set by `KVPlugRadixCache`
        self._creating: Any = None  # the leaf an insert creates, while it ends
        self.evict_goal: int | None = None  # tokens an allocation's eviction must free
        with kvplug_tree_core_building():  # SGLang's constructor builds the strategy
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
        self.victim_ends = spanning(self.eviction.policy)
        self.keyed = self.eviction.policy.reads_keys
        # partial eviction (module doc), where a split touches the full component only
        self.splits_victims = (
            self.eviction.policy.values_position
            and tuple(self.component_types) == (FULL,)  # type: ignore[attr-defined]
            and not self.enable_hicache  # type: ignore[attr-defined]
        )
        self._splitting_victim = False
        self.records = {}
        self.last_matched: list[NodeRecord] = []  # the device path of the latest match
        self.host: RankedSet[StateRecord] | None = None  # built at the first demotion
        self.host_records: dict[int, StateRecord] = {}  # node id -> host-only member
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
        record, inside = self._new_record(node, parent_record, end, new=True)
        self.eviction.insert(record, parent_record, inside)
        self.eviction.touch(record)  # SGLang stamps a new node as accessed
        if self.releasing is not None:  # inserted by a finished request: on its path
            self.releasing.stamp(record)
        self.eviction.release(record)  # SGLang adds it unlocked; a lock may follow
        return node

    def _split_node(self, key: Any, child: Any, split_len: int) -> Any:
        result = super()._split_node(key, child, split_len)  # type: ignore[misc]
        upper_node = result[0]
        lower = self.records.get(child.id)
        if lower is None:  # a node without device KV: host-only, or nothing ranked
            lower_host = self.host_records.get(child.id)
            if lower_host is not None and self.host is not None:
                key, depth = self.describe(upper_node)
                upper_host = StateRecord(next(self._serials), upper_node, key, depth)
                upper_host.hits = lower_host.hits
                self.host_records[upper_node.id] = upper_host
                self.host.add_before(upper_host, lower_host, None)
            return result
        parent = live_parent(lower)
        upper = self._new_record(upper_node, parent, lower.end - len(child.key))[0]  # type: ignore[arg-type]
        lower.depth = span_depth(upper.end, lower.end, self.page_size)
        lower.blocks = page_count(upper.end, lower.end, self.page_size)
        released_with(upper, lower, self.page_size)
        self.eviction.touch(upper)  # stamped at its creation, before the lower part
        self.eviction.split(upper, lower)
        self._sync_held(upper_node)
        if not self._splitting_victim:  # the lower part of a victim keeps its rank
            self._accessed(lower)  # SGLang stamps the lower part as accessed now
        return result

    def split_victim(self, node: Any, tokens: int, cache_actions: list[Any]) -> None:
        """Split the victim leaf `node` so that it keeps its last `tokens` tokens (whole
        pages) and a new parent the rest: the eviction then frees only those."""
        self._splitting_victim = True
        try:
            _, action = self._split_node(node.key, node, len(node.key) - tokens)
        finally:
            self._splitting_victim = False
        if action is not None:
            cache_actions.append(action)

    def _touch_node(self, node: Any) -> None:
        super()._touch_node(node)  # type: ignore[misc]
        record = self.records.get(node.id)
        if record is not None:
            self._accessed(record)
        elif self.host is not None and node.id in self.host_records:
            self.host.touch(self.host_records[node.id])

    def _match_post_processor(
        self, params: Any, value: Any, best_match_node: Any, *args: Any, **kwargs: Any
    ) -> Any:
        result = super()._match_post_processor(  # type: ignore[misc]
            params, value, best_match_node, *args, **kwargs
        )
        records, root, touched = self.records, self.root_node, []
        node = best_match_node
        host_members = self.host_records
        while node is not None and node is not root:
            record = records.get(node.id)
            if record is not None:
                touched.append(record)
            elif node.id in host_members:
                touched.append(host_members[node.id])
            node = node.parent
        matched = []
        for record in reversed(touched):  # root first: SGLang stamps parents older
            if isinstance(record, NodeRecord):
                self._accessed(record)
                matched.append(record)
            elif self.host is not None:
                self.host.touch(record)
        self.last_matched = matched
        return result

    def holds(self, record: NodeRecord) -> bool:
        """Whether `record` is still its node's, the node holding device KV."""
        return self.records.get(record.node.id) is record

    def _accessed(self, record: NodeRecord) -> None:
        accessed(self.eviction, record)

    def _insert_tail_step(self, state: Any) -> None:
        self._creating = state.target_node if state.is_new_leaf else None
        try:
            super()._insert_tail_step(state)  # type: ignore[misc]
        finally:
            self._creating = None

    def _inc_hit_count_and_check(self, node: Any) -> bool:
        if node is self._creating:  # SGLang counts an insert, not a reuse
            return super()._inc_hit_count_and_check(node)  # type: ignore[misc]
        record = self.records.get(node.id)
        if record is not None:
            self.eviction.hit(record)
            self.stats.block_hits += 1
        elif self.host is not None and node.id in self.host_records:
            self.host.hit(self.host_records[node.id])
        for ct in RANKED_COMPONENTS:
            lru = self.lru_lists.get(ct)  # type: ignore[attr-defined]
            if isinstance(lru, RankedLRUList):
                lru.hit(node)
        return super()._inc_hit_count_and_check(node)  # type: ignore[misc]

    # -- called by the components ---------------------------------------------------------
    def forget(self, node: Any, keep_host: bool = False) -> None:
        """`node`'s full-attention device KV is being freed: its record leaves. With
        `keep_host` its host copy stays (a demotion): the node joins the host tier."""
        record = self.records.pop(node.id, None)
        if record is not None:
            if self.victim_ends is not None:
                self.victim_ends.add(record.end, node.key.token_ids[len(node.key) - 1])
            self.eviction.remove(record)
            self.stats.evictions += 1
            record.serial = -1  # records naming it as parent see a dead link
            if keep_host:
                member = StateRecord(next(self._serials), node, record.key, record.depth)
                member.hits = record.hits
                self.host_records[node.id] = member
                self._host_tier().add(member)

    def forget_host(self, node: Any) -> None:
        """`node`'s full-attention host KV is being freed: a host-only member leaves."""
        member = self.host_records.pop(node.id, None)
        if member is not None and self.host is not None:
            self.host.remove(member)

    def gain_device(self, node: Any) -> None:
        """`node` holds full-attention device KV again (loaded back from the host, or
        re-inserted over its host copy): a record joins below its parent's, counted as
        accessed now, held if the node is locked; its host member leaves."""
        if node is self.root_node or node.id in self.records:
            return
        parent = self.records.get(node.parent.id)
        end = (parent.end if parent is not None else 0) + len(node.key)
        record, inside = self._new_record(node, parent, end, new=True)
        member = self.host_records.pop(node.id, None)
        if member is not None and self.host is not None:
            record.hits = member.hits
            self.host.remove(member)
        self.eviction.insert(record, parent, inside)
        self.eviction.touch(record)
        self._sync_held(node)
        if node.component_data[FULL].lock_ref == 0:
            if self.releasing is not None:  # re-inserted by a finished request
                self.releasing.stamp(record)
            self.eviction.release(record)

    def _sync_held(self, node: Any) -> None:
        """The record of `node` is `held_elsewhere` exactly while the host holds its KV."""
        record = self.records.get(node.id)
        if record is not None:
            held = node.component_data[FULL].host_value is not None
            self.eviction.held_elsewhere(record, held)

    def next_host_victim(self) -> Any:
        """The host-only node kvplug's policy evicts from the host next (one of SGLang's
        ``evictable_host_leaves``), or None."""
        if self.host is None:
            return None
        leaves = self.evictable_host_leaves  # type: ignore[attr-defined]
        member = self.host.first(lambda member: member.node in leaves)
        if member is None:
            return None
        self.host.policy.chosen = member.serial  # a victim: `cost`'s inflation rises to it
        return member.node

    def _host_tier(self) -> RankedSet[StateRecord]:
        if self.host is None:
            controller = getattr(self.components_by_type[FULL].cache, "cache_controller", None)  # type: ignore[attr-defined]
            host_pool = getattr(controller, "mem_pool_host", None)
            pages = getattr(host_pool, "size", 0) // self.page_size or self.num_pages
            self.host = RankedSet(self.eviction_strategy.new_policy(self.page_size, pages))
        return self.host

    # -- SGLang's tier changes --------------------------------------------------------------
    def _unevict_node_on_insert(self, node: Any, *args: Any, **kwargs: Any) -> None:
        super()._unevict_node_on_insert(node, *args, **kwargs)  # type: ignore[misc]
        self.gain_device(node)

    def _update_duplicate_tracking(self, node: Any) -> None:
        super()._update_duplicate_tracking(node)  # type: ignore[misc]
        self._sync_held(node)

    def _release_full_host_duplicate(self, node: Any, *args: Any, **kwargs: Any) -> None:
        super()._release_full_host_duplicate(node, *args, **kwargs)  # type: ignore[misc]
        self._sync_held(node)

    def insert_host(self, node_id: Any, *args: Any, **kwargs: Any) -> Any:
        result = super().insert_host(node_id, *args, **kwargs)  # type: ignore[misc]
        node_id = getattr(result, "inserted_host_node", None)
        node = None if node_id is None else self.node_by_id(node_id)  # type: ignore[attr-defined]
        path = []
        while node is not None and node is not self.root_node:
            path.append(node)
            node = node.parent
        for node in reversed(path):  # a host path refilled from storage: root first
            data = node.component_data[FULL]
            if data.value is None and data.host_value is not None:
                if node.id not in self.host_records:
                    key, depth = self.describe(node)
                    member = StateRecord(next(self._serials), node, key, depth)
                    self.host_records[node.id] = member
                    self._host_tier().add(member)
            else:
                self._sync_held(node)
        return result

    def next_victim(self) -> Any:
        """The node kvplug's policy evicts next, or None."""
        record = self.eviction.next_victim()
        return None if record is None else record.node

    # -- helpers ----------------------------------------------------------------------------
    def _new_record(
        self, node: Any, parent: NodeRecord | None, end: int, new: bool = False
    ) -> tuple[NodeRecord, list[bytes]]:
        """`node`'s record, filed, keyed by its prefix; with `new` (its pages were not in
        the tree), also the keys of its pages where a recent victim ended."""
        radix_key = node.key
        start = end - len(radix_key)
        prefix, key, inside = None, b"", []  # a policy that reads no key gets none
        if self.keyed:
            prefix, inside = node_prefix(
                self._prefix_before(node, parent),
                start,
                radix_key.token_ids[: len(radix_key)],
                self.page_size,
                self.victim_ends if new else None,
            )
            key = prefix.key
        record = NodeRecord(next(self._serials), node, key, start, end, self.page_size, prefix)
        self.records[node.id] = record
        return record, inside

    def _prefix_before(self, node: Any, parent: NodeRecord | None) -> Prefix:
        """The hash of `node`'s prefix before its first token: its device `parent`'s,
        else continued from the nearest ancestor with a device record (or the root)."""
        if parent is not None and parent.prefix is not None:
            return parent.prefix
        above: list[Any] = []
        cur, root = node.parent, self.root_node
        record = None
        while cur is not None and cur is not root:
            record = self.records.get(cur.id)
            if record is not None:
                break
            above.append(cur)
            cur = cur.parent
        radix_key = node.key
        prefix = (
            record.prefix
            if record is not None and record.prefix is not None
            else root_prefix(radix_key.extra_key, radix_key.cache_salt)
        )
        chunk = chunk_tokens(self.page_size)
        for ancestor in reversed(above):
            prefix = extend(prefix, ancestor.key.token_ids[: len(ancestor.key)], chunk)
        return prefix

    def describe(self, node: Any) -> tuple[bytes, int]:
        """(prefix key, depth) of a node, for the ranked components' records: those of
        its full-attention record if it has one yet, else derived from its parent's (a
        node split off a moment ago)."""
        record = self.records.get(node.id) or self.host_records.get(node.id)
        if record is not None:
            return record.key, record.depth
        parent: Any = None
        if node.parent is not None:
            parent = self.records.get(node.parent.id) or self.host_records.get(node.parent.id)
        start = self._start(node)
        depth = span_depth(start, start + len(node.key), self.page_size)
        if not self.keyed:
            return b"", depth
        before = self._prefix_before(node, parent if isinstance(parent, NodeRecord) else None)
        tokens = node.key.token_ids[: len(node.key)]
        return extend(before, tokens, chunk_tokens(self.page_size)).key, depth

    def _start(self, node: Any) -> int:
        """The token count from the root to `node`'s first token: its parent's ``end``
        where the parent has a device record, else the sum of the keys above it."""
        start, cur, root = 0, node.parent, self.root_node
        while cur is not None and cur is not root:
            record = self.records.get(cur.id)
            if record is not None:
                return start + record.end
            start += len(cur.key)
            cur = cur.parent
        return start

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
            assert record.end == self._start(node) + len(node.key), f"node {node.id}: end"
            span = span_depth(record.end - len(node.key), record.end, self.page_size)
            assert record.depth == span, f"node {node.id}: depth is not its span's middle"
            start = record.end - len(node.key)
            assert record.blocks == page_count(start, record.end, self.page_size), node.id
            if self.keyed:  # its key is its prefix's, whatever the splits since
                expected = self._prefix_before(node, None)
                tokens = node.key.token_ids[: len(node.key)]
                assert record.prefix == extend(expected, tokens, chunk_tokens(self.page_size))
                assert record.key == record.prefix.key, f"node {node.id}: key"
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
        for record in self.records.values():
            held = record.node.component_data[FULL].host_value is not None
            assert record.held_elsewhere == held, f"node {record.node.id}: held_elsewhere"
        host_only = {
            node.id
            for node in nodes
            if node is not self.root_node
            and node.component_data[FULL].value is None
            and node.component_data[FULL].host_value is not None
        }
        assert set(self.host_records) == host_only, f"host members != {host_only}"
        if self.host is not None:
            self.host.check()
            assert {member.node.id for member in self.host} == host_only
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
