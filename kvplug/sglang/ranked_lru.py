"""SGLang's LRU list of one component's device state, reporting every move to kvplug.

SGLang's sliding-window and Mamba components keep the nodes that hold their device state
in a `UnifiedLRUList` (``tree_core.lru_lists[component_type]``) and move a node to its
most-recent end when they consider it accessed. A locked node stays in the list, at its
place; SGLang's eviction walk skips it. `RankedLRUList` is that list (SGLang still
keeps it, audits it and walks it) that also reports each change to a kvplug
`RankedSet`, which the kvplug components ask for their victims:

| list operation | ranked set |
|---|---|
| `insert_mru` (state stored) | `add` |
| `insert_after(prev, node)` (a split) | `add_before(node, prev, its older neighbour)` |
| `reset_node_mru` | `touch` |
| `reset_node_and_(parents / window_ancestors)_mru` | `touch` each moved node, oldest first |
| `remove_node` (state freed) | `remove` |

(At a split, SGLang places the new upper part right older than the part it split from.)

So the ranked set's members are exactly the list's nodes, ranked at each access in the
order SGLang stamped them; with ``lru`` its order is the list's order. Each member is a
`StateRecord`, the policy's view of that node's state. SGLang's session partitions of
the list (the session radix cache, which the kvplug backend refuses) are not mirrored.
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Iterator
from typing import Any

from sglang.srt.mem_cache.unified_cache.unified_tree_core import UnifiedLRUList

from kvplug.core.ranked_set import RankedSet


class StateRecord:
    """One node's device state of one component, as a policy sees it (a `CachedNode`)."""

    __slots__ = (
        "serial", "key", "depth", "hits", "from_end", "request_hit", "request_output",
        "request_session", "held_elsewhere", "node",
    )  # fmt: skip

    def __init__(self, serial: int, node: Any, key: bytes, depth: int) -> None:
        self.serial = serial
        self.node = node
        self.key = key
        self.depth = depth
        self.hits = 0
        self.from_end = 0
        self.request_hit = False
        self.request_output = 0
        self.request_session = False
        self.held_elsewhere = False


class RankedLRUList(UnifiedLRUList):
    """SGLang's LRU list that keeps a kvplug `RankedSet` of its nodes (see the module doc).

    `describe` gives a node's prefix key and depth; `serials` numbers the records.
    """

    def __init__(
        self,
        component_type: Any,
        tree_components: tuple[Any, ...],
        ranked: RankedSet[StateRecord],
        describe: Callable[[Any], tuple[bytes, int]],
        serials: Iterator[int],
        is_referenced: Callable[[Any], bool] | None = None,
    ) -> None:
        super().__init__(component_type, tree_components, is_referenced=is_referenced)
        self.ranked = ranked
        self.records: dict[int, StateRecord] = {}  # node id -> record
        self._describe = describe
        self._serials = serials

    # -- SGLang's list operations, reported ----------------------------------------------
    def insert_mru(self, node: Any) -> None:
        super().insert_mru(node)
        self.ranked.add(self._new_record(node))

    def insert_after(self, prev_node: Any, node: Any) -> None:
        super().insert_after(prev_node, node)
        record = self._new_record(node)
        self.ranked.add_before(record, self.records[prev_node.id], self._older_member(node))

    def remove_node(self, node: Any) -> None:
        super().remove_node(node)
        self.ranked.remove(self.records.pop(node.id))

    def reset_node_mru(self, node: Any) -> None:
        super().reset_node_mru(node)
        self.ranked.touch(self.records[node.id])

    def reset_node_and_parents_mru(self, node: Any, root_node: Any, should_include: Any) -> None:
        moved, include = self._recording(should_include)
        super().reset_node_and_parents_mru(node, root_node, include)
        self._touch_oldest_first(moved)

    def reset_node_and_window_ancestors_mru(
        self, node: Any, root_node: Any, window_size: int, should_include: Any
    ) -> None:
        moved, include = self._recording(should_include)
        super().reset_node_and_window_ancestors_mru(node, root_node, window_size, include)
        self._touch_oldest_first(moved)

    # -- for the tree core and the components ----------------------------------------------
    def hit(self, node: Any) -> None:
        """A lookup reused `node`; counted if it holds this component's state."""
        record = self.records.get(node.id)
        if record is not None:
            self.ranked.hit(record)

    def first_unlocked(self, passed: Collection[int] = ()) -> Any:
        """The node kvplug's policy evicts next: the lowest-ranked one not locked for this
        component (the nodes SGLang's walk skips) and not in `passed` (node ids), or None."""
        ct = self.component_type

        def evictable(record: StateRecord) -> bool:
            node = record.node
            return node.component_data[ct].lock_ref == 0 and node.id not in passed

        record = self.ranked.first(evictable)
        return None if record is None else record.node

    def order_from_lru(self) -> list[Any]:
        """SGLang's own order of the list's nodes, the least recent first (for audits)."""
        pt, nodes = self._pt, []
        cur = self.tail.lru_prev[pt]
        while cur is not self.head:
            if cur.id in self.cache:  # not a sentinel
                nodes.append(cur)
            cur = cur.lru_prev[pt]
        return nodes

    # -- helpers ---------------------------------------------------------------------------
    def _new_record(self, node: Any) -> StateRecord:
        key, depth = self._describe(node)
        record = StateRecord(next(self._serials), node, key, depth)
        self.records[node.id] = record
        return record

    def _older_member(self, node: Any) -> StateRecord | None:
        """The record of the nearest node older than `node` in the list, skipping
        sentinels; None if there is none."""
        pt = self._pt
        cur = node.lru_next[pt]
        while cur is not self.tail:
            record = self.records.get(cur.id)
            if record is not None:
                return record
            cur = cur.lru_next[pt]
        return None

    @staticmethod
    def _recording(should_include: Any) -> tuple[list[Any], Callable[[Any], bool]]:
        moved: list[Any] = []

        def include(node: Any) -> bool:
            if should_include(node):
                moved.append(node)
                return True
            return False

        return moved, include

    def _touch_oldest_first(self, moved: list[Any]) -> None:
        # SGLang moved them deepest first, each placed right older than the one before,
        # so the node the walk started from is the newest and its ancestors age upwards.
        for node in reversed(moved):
            self.ranked.touch(self.records[node.id])
