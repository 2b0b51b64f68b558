"""SGLang tree components that evict by kvplug's decision.

SGLang's unified radix tree delegates each kind of state to a `TreeComponent`; kvplug
hands its own through ``CacheInitParams.component_registry_override``.

`KVPlugFullComponent` is SGLang's `FullComponent` with three changes:

- its device-eviction walk takes each victim from the kvplug tree core's eviction core
  (`KVPlugTreeCore.next_victim`: the policy's lowest-ranked evictable leaf) instead of
  building a heap of every leaf per eviction call;
- its lock walks report the nodes whose lock count leaves or reaches 0 (`reclaim`,
  `release`), the latter root first;
- freeing a node's device KV drops its record.

Everything else (sizes, leaf sets, events, cascade into SWA and Mamba state, the tree's
deletion of tombstone ancestors) is SGLang's code. The sliding-window and Mamba
components are SGLang's own: they evict their internal state from their own LRU lists
(see the README's known limits); a full-attention eviction chosen by kvplug cascades
into them as in SGLang.
"""

from __future__ import annotations

from typing import Any

from sglang.srt.mem_cache.unified_cache.components.base import EvictLayer
from sglang.srt.mem_cache.unified_cache.components.full import FullComponent

from kvplug.sglang.tree_core import FULL


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
        for record in reversed(freed):  # root first: the order SGLang stamped them
            release(record)

    def evict_component(
        self,
        node: Any,
        device_frees: Any,
        host_frees: Any,
        cache_actions: Any,
        target: EvictLayer = EvictLayer.DEVICE,
    ) -> tuple[int, int]:
        if EvictLayer.DEVICE in target and node.component_data[FULL].value is not None:
            self.tree_core.forget(node)
        return super().evict_component(node, device_frees, host_frees, cache_actions, target)

    # -- the device-eviction walk ---------------------------------------------------------
    def _evict_device_start(self, request_cnt: int) -> None:
        self._evict_device_request_cnt = request_cnt

    def _evict_device_next_node(
        self, tracker: Any, device_frees: Any, host_frees: Any, cache_actions: Any
    ) -> Any:
        if tracker[self.component_type] >= self._evict_device_request_cnt:
            return None
        victim = self.tree_core.next_victim()
        if victim is None:
            return None
        assert victim in self.tree_core.evictable_device_leaves, (
            f"kvplug named node {victim.id}, which SGLang cannot evict"
        )
        return victim.id

    def _evict_device_end(self) -> None:
        self._evict_device_request_cnt = 0


def kvplug_components() -> dict[Any, type]:
    """The component registry override a kvplug cache is built with."""
    return {FULL: KVPlugFullComponent}
