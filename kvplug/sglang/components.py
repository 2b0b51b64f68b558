"""SGLang tree components that evict by kvplug's decision.

SGLang's unified radix tree delegates each kind of state to a `TreeComponent`; kvplug
hands its own through ``CacheInitParams.component_registry_override``, one per kind of
state SGLang 0.5.23 evicts, so one kvplug policy decides for all of them.

`KVPlugFullComponent` is SGLang's `FullComponent` with three changes:

- its device-eviction walk takes each victim from the kvplug tree core's eviction core
  (`KVPlugTreeCore.next_victim`: the policy's lowest-ranked evictable leaf) instead of
  building a heap of every leaf per eviction call, and, under a policy that values
  position, frees only the tail pages it still needs of it (`split_victim`);
- its lock walks report the nodes whose lock count leaves or reaches 0 (`reclaim`,
  `release`), the latter root first, each learning what the finished request releasing
  it knew (`kvplug.sglang.tree_core.ReleasingRequest`);
- freeing a node's device KV drops its record, unless the host tier keeps a copy
  (SGLang's HiCache): then the node is *demoted* and joins the tree core's host ranking
  with its hits; a load-back (`commit_hicache_transfer`) returns it to the device
  ranking, and a host write-back marks it held elsewhere, priced as a reload;
- with HiCache its host-eviction walk (`drive_host_eviction`) takes each victim from the
  tree core's host ranking (`KVPlugTreeCore.next_host_victim`) among SGLang's own
  evictable host leaves, and SGLang's code frees the host pages.

`KVPlugSWAComponent` and `KVPlugMambaComponent` are SGLang's sliding-window and Mamba
components whose device-eviction walk takes each victim from the component's kvplug
`RankedSet` (`kvplug.sglang.ranked_lru`: every node holding that state, leaves and
internal nodes, ranked by the policy at each access SGLang records) instead of SGLang's
LRU end: the lowest-ranked node not locked for the component. What is done with the
victim is SGLang's code: a device leaf is handed to the tree to evict whole, an internal
node's state is tombstoned, and the cascade runs as in SGLang.

Everything else (sizes, leaf sets, events, cascades, the tree's deletion of tombstone
ancestors) is SGLang's code. Each kind of state has its own policy instance, bound to
its own pool's size: the policies rank, they do not share one budget.
"""

from __future__ import annotations

from typing import Any

from sglang.srt.mem_cache.unified_cache.components.base import CacheTransferPhase, EvictLayer
from sglang.srt.mem_cache.unified_cache.components.full import FullComponent
from sglang.srt.mem_cache.unified_cache.components.mamba import MambaComponent
from sglang.srt.mem_cache.unified_cache.components.swa import SWAComponent

from kvplug.sglang.tree_core import FULL, MAMBA, SWA


class KVPlugFullComponent(FullComponent):
    """SGLang's full-attention component, evicting by kvplug's policy (see the module doc)."""

    def acquire_component_lock(self, node: Any, result: Any, lock_host: bool = False) -> Any:
        if lock_host:
            return super().acquire_component_lock(node, result, lock_host)
        root, records = self.tree_core.root_node, self.tree_core.records
        unlocked = []  # path locks: the unlocked nodes are a bottom segment of the path
        cur = node
        while cur is not root and cur.component_data[FULL].lock_ref == 0:
            unlocked.append(cur)
            cur = cur.parent
        result = super().acquire_component_lock(node, result, lock_host)
        reclaim = self.tree_core.eviction.reclaim
        for locked in unlocked:
            record = records.get(locked.id)
            if record is not None:
                reclaim(record)
        return result

    def release_component_lock(self, node: Any, params: Any, lock_host: bool = False) -> None:
        super().release_component_lock(node, params, lock_host)
        if lock_host:
            return
        root, records = self.tree_core.root_node, self.tree_core.records
        freed = []
        cur = node
        while cur is not root and cur.component_data[FULL].lock_ref == 0:
            record = records.get(cur.id)
            if record is not None:
                freed.append(record)
            cur = cur.parent
        release = self.tree_core.eviction.release
        releasing = self.tree_core.releasing
        for record in reversed(freed):  # root first: the order SGLang stamped them
            if releasing is not None:  # a finished request lets its path go
                releasing.stamp(record)
            release(record)

    def evict_component(
        self,
        node: Any,
        device_frees: Any,
        host_frees: Any,
        cache_actions: Any,
        target: EvictLayer = EvictLayer.DEVICE,
    ) -> tuple[int, int]:
        data = node.component_data[FULL]
        if EvictLayer.DEVICE in target and data.value is not None:
            keep_host = EvictLayer.HOST not in target and data.host_value is not None
            self.tree_core.forget(node, keep_host=keep_host)
        elif EvictLayer.HOST in target and data.host_value is not None:
            self.tree_core.forget_host(node)
        return super().evict_component(node, device_frees, host_frees, cache_actions, target)

    def commit_hicache_transfer(
        self, node: Any, phase: Any, transfers: Any = (), **kwargs: Any
    ) -> None:
        super().commit_hicache_transfer(node, phase, transfers, **kwargs)
        tree = self.tree_core
        if phase == CacheTransferPhase.BACKUP_HOST:
            tree._sync_held(node)  # the host holds it now: a reload, not a recompute
        elif phase == CacheTransferPhase.LOAD_BACK and transfers:
            for node_id in transfers[0].nodes_to_load or ():  # root first
                loaded = tree.node_by_id(node_id)
                if loaded.component_data[FULL].value is not None:
                    tree.gain_device(loaded)

    def drive_host_eviction(
        self, num_tokens: int, tracker: Any, device_frees: Any, host_frees: Any, cache_actions: Any
    ) -> None:
        """Free host KV for `num_tokens` tokens, evicting the host leaves kvplug's policy
        ranks lowest (SGLang's walk, with the victim named by kvplug)."""
        tree = self.tree_core
        while tracker[self.component_type] < num_tokens:
            victim = tree.next_host_victim()
            if victim is None:
                return
            tree._evict_host_leaf(
                victim, tracker, device_frees, host_frees, cache_actions=cache_actions
            )

    # -- the device-eviction walk ---------------------------------------------------------
    def _evict_device_start(self, request_cnt: int) -> None:
        self._evict_device_request_cnt = request_cnt
        self._evict_device_named: set[int] = set()

    def _evict_device_next_node(
        self, tracker: Any, device_frees: Any, host_frees: Any, cache_actions: Any
    ) -> Any:
        tracker_goal = self._evict_device_request_cnt
        if tracker[self.component_type] >= tracker_goal:
            return None
        victim = self.tree_core.next_victim()
        named = self._evict_device_named
        if victim is not None and victim.id in named:
            # a leaf named before in this walk stayed (its write-back found no host
            # room): as in SGLang's walk, the next one in the policy's order is named
            victim = next(
                (r.node for r in self.tree_core.eviction.iter_victims() if r.node.id not in named),
                None,
            )
        if victim is None:
            return None
        assert victim in self.tree_core.evictable_device_leaves, (
            f"kvplug named node {victim.id}, which SGLang cannot evict"
        )
        tree = self.tree_core
        if tree.splits_victims:
            goal = tree.evict_goal if tree.evict_goal is not None else tracker_goal
            page = tree.page_size
            needed = -(-(goal - tracker[self.component_type]) // page) * page
            if 0 < needed < len(victim.key):
                tree.split_victim(victim, needed, cache_actions)
        named.add(victim.id)
        return victim.id

    def _evict_device_end(self) -> None:
        self._evict_device_request_cnt = 0
        self._evict_device_named = set()


class RankedWalkMixin:
    """The device-eviction walk of a component whose state kvplug ranks (see the module
    doc): SGLang's step, with the victim named by kvplug instead of SGLang's LRU cursor.

    SGLang's step evicts its cursor node and sets the cursor to the next unlocked node
    toward the list's most-recent end; here the cursor is set to kvplug's victim before
    each step, so SGLang's own step handles it (leaf or tombstone, host backup, cascade).
    As SGLang's cursor never returns to a node it passed, a walk names a node once: a
    leaf the cache then keeps (a failed write-back) cannot be named again and again.
    """

    component_type: Any
    tree_core: Any
    _evict_device_cursor: Any
    _evict_device_request_cnt: int
    _evict_device_named: set[int]

    def _evict_device_start(self, request_cnt: int) -> None:
        self._evict_device_request_cnt = request_cnt
        self._evict_device_cursor = None
        self._evict_device_named = set()

    def _evict_device_next_node(
        self, tracker: Any, device_frees: Any, host_frees: Any, cache_actions: Any
    ) -> Any:
        ct = self.component_type
        if tracker[ct] >= self._evict_device_request_cnt:
            return None
        victim = self.tree_core.ranked_lru(ct).first_unlocked(self._evict_device_named)
        if victim is None:
            return None
        self._evict_device_named.add(victim.id)
        data = victim.component_data[ct]
        assert data.value is not None and data.lock_ref == 0, (
            f"kvplug named node {victim.id}, whose {ct} state SGLang cannot evict"
        )
        self._evict_device_cursor = victim
        return super()._evict_device_next_node(  # type: ignore[misc]
            tracker, device_frees, host_frees, cache_actions=cache_actions
        )

    def _evict_device_end(self) -> None:
        super()._evict_device_end()  # type: ignore[misc]
        self._evict_device_named = set()


class KVPlugSWAComponent(RankedWalkMixin, SWAComponent):
    """SGLang's sliding-window component, evicting by kvplug's policy (see the module doc)."""


class KVPlugMambaComponent(RankedWalkMixin, MambaComponent):
    """SGLang's Mamba component, evicting by kvplug's policy (see the module doc)."""


def kvplug_components() -> dict[Any, type]:
    """The component registry override a kvplug cache is built with."""
    return {FULL: KVPlugFullComponent, SWA: KVPlugSWAComponent, MAMBA: KVPlugMambaComponent}
