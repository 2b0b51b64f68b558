"""kvplug's hybrid cache: every state group in one byte budget, one decision across them.

The reference for hybrid models, as `kvplug.core.cache.KVCache` is for full attention:
the replay runs it beside the engines' own hybrid caches. A prefix tree of units (one
unit = `block_tokens` tokens); each node may hold, for the unit ending at its depth,

- ``kv``: the full-attention groups' KV (a node exists only while it holds it);
- ``window_kv``: the sliding-window groups' KV;
- ``checkpoint``: the Mamba groups' state at its end.

All groups of one kind are decided together: they serve the same positions and differ
only in which layers they page.

**Junctions.** A hit is the junction (`kvplug.hybrid.junction`). kvplug keeps junctions
at *anchors*: the end of each prompt's full units, the branch point where a request left
the cached tree (Marconi's rule), and any position a lookup was served at. A Mamba
checkpoint is taken at anchors only. A junction record ties what its anchor needs: the
full-attention path above it, the window of sliding-window KV before it, its checkpoint.

**Speculative windows.** Sliding-window KV that a request computed and no junction needs
is kept too, as *speculative* state, evictable at once and ranked on its own, as an
engine keeps freed sliding-window blocks: if a later request diverges there, the window
is already present, the position is served, and becomes an anchor.

**What goes first.** One kvplug policy ranks both kinds of record (`lru`: by release;
`cost`: GreedyDual with the FLOPs the record saves beyond the junction above it, per byte
its removal frees, learned reuse odds and decay). Removing a junction frees its
checkpoint, the window KV no other junction needs, and, at a leaf, the full-attention path
up to the next junction or branch; removing a speculative window frees that window.
State no junction can use is freed at once: a tail of nodes below the last junction.

Invariants (`check_invariants`): a node's parent holds KV (prefixes stay whole); the used,
pinned and per-kind bytes are the sums over nodes and running requests; a request's nodes
are held, their KV and checkpoints never evicted, nor the window it computes with; a
junction record exists exactly at anchors where every group is served, a speculative
record exactly on window KV no record and no running request needs; every junction
candidate is unheld; the policy's candidates are exactly the records marked so.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass, field
from itertools import count

from kvplug.core.groups import GroupKind
from kvplug.errors import ConfigError
from kvplug.hybrid.junction import Hits, longest_hits
from kvplug.hybrid.policy import HybridRecord, make_hybrid_policy
from kvplug.hybrid.spec import HybridSpec

MARGINAL_REACH = 64  # units a record's worth looks up for the junction above it


class HybridNode:
    __slots__ = (
        "unit", "parent", "children", "depth", "key", "window_kv", "speculative",
        "checkpoint", "anchor", "holders", "live", "record", "window_record",
    )  # fmt: skip

    kv = True  # a node exists only while it holds full-attention KV

    def __init__(self, unit: int, parent: HybridNode | None, depth: int, key: int) -> None:
        self.unit = unit
        self.parent = parent
        self.children: dict[int, HybridNode] = {}
        self.depth = depth
        self.key = key
        self.window_kv = False
        self.speculative = False  # its window KV is kept on speculation
        self.checkpoint = False
        self.anchor = False  # a junction is kept here when every group is served
        self.holders = 0  # running requests whose path holds it
        self.live = 0  # running requests computing with its window KV
        self.record: HybridRecord | None = None  # its junction
        self.window_record: HybridRecord | None = None  # its speculative window


@dataclass
class RunningRequest:
    path: list[HybridNode]
    hit: bool
    live_bytes: int  # the Mamba state it runs with
    output_units: int = 0


@dataclass
class HybridMetrics:
    lookups: int = 0
    junction_units: int = 0
    kind_units: dict[GroupKind, int] = field(default_factory=dict)
    retired: int = 0  # junctions evicted
    windows_evicted: int = 0  # speculative windows evicted
    freed_bytes: int = 0


class HybridCache:
    """One byte budget for every group of `spec`; see the module docstring."""

    def __init__(
        self, spec: HybridSpec, capacity_bytes: int, block_tokens: int, policy: str = "cost"
    ) -> None:
        kinds = spec.kinds()
        if GroupKind.FULL not in kinds:
            raise ConfigError(
                f"kvplug's hybrid cache needs a full-attention group; {spec.name} has "
                f"{', '.join(sorted(kind.value for kind in kinds))}"
            )
        self.spec = spec
        self.block_tokens = block_tokens
        self.capacity = capacity_bytes
        self.kinds = kinds
        self.window = max((g.window_units(block_tokens) for g in spec.groups), default=0)
        self.kv_bytes = spec.kind_unit_bytes(GroupKind.FULL, block_tokens)
        self.window_bytes = spec.kind_unit_bytes(GroupKind.SLIDING_WINDOW, block_tokens)
        self.checkpoint_bytes = spec.kind_unit_bytes(GroupKind.MAMBA, block_tokens)
        self.mamba = GroupKind.MAMBA in kinds
        self.every_node_anchors = kinds == {GroupKind.FULL}  # any position is served
        self.policy = make_hybrid_policy(policy, block_tokens)
        self.policy.bind(1, max(1, capacity_bytes // spec.page_bytes(block_tokens)))
        self.root = HybridNode(-1, None, 0, 0)
        self.used = 0
        self.pinned = 0  # bytes no eviction may free: held state and live Mamba states
        self.cached_by_kind = {kind: 0 for kind in self.kinds}  # reusable, evictable bytes
        self.node_count = 0
        self.requests: dict[int, RunningRequest] = {}
        self.metrics = HybridMetrics()
        self._serials = count()
        # FLOPs of one unit at position 0 per full-attention unit byte: scales worth to ~1
        self._worth_scale = self.kv_bytes / max(spec.prefill_flops(0, block_tokens), 1.0)

    # ------------------------------------------------------------------ lookups

    def walk(self, units: list[int]) -> list[HybridNode]:
        """The cached nodes along `units`, from the first unit."""
        node, path = self.root, []
        for unit in units:
            node = node.children.get(unit)
            if node is None:
                break
            path.append(node)
        return path

    def hits(self, units: list[int], limit: int | None = None) -> Hits:
        return longest_hits(self.walk(units), self.kinds, self.window, limit)

    # ------------------------------------------------------------------ requests

    def admit(
        self, req_id: int, prompt: list[int], compute: int, cacheable: int, output_units: int = 0
    ) -> int | None:
        """Start a request; the junction it is served, or None (nothing changed) if its
        state does not fit. `cacheable`: the prompt's full units (its end is an anchor)."""
        if req_id in self.requests:
            raise ValueError(f"request {req_id} is already running")
        matched = self.walk(prompt)
        hits = longest_hits(matched, self.kinds, self.window, len(prompt) - 1)
        junction = hits.junction
        length = max(compute, junction)
        held = matched[:length]
        anchors = {depth for depth in (min(cacheable, length),) if depth > junction}
        branch = len(matched)
        if junction < branch < length and matched[-1].children:
            anchors.add(branch)  # the tree branches here: later requests resume at it
        computed = range(junction + 1, length + 1)  # units this request computes
        # window KV it keeps whatever the policy says: the window it computes with, and
        # the window before each anchor; the rest is offered to the policy (`_offer`)
        kept = self._kept_windows(length, anchors) & set(computed)
        needed = (length - len(held)) * self.kv_bytes
        # kept windows already cached: held like the window it computes with (no eviction
        # may take them), which pins those now speculative
        protected = [held[d - 1] for d in kept if d <= len(held) and held[d - 1].window_kv]
        missing = sum(1 for d in kept if d > len(held) or not held[d - 1].window_kv)
        needed += missing * self.window_bytes
        if self.mamba:
            missing = sum(1 for d in anchors if d > len(held) or not held[d - 1].checkpoint)
            needed += missing * self.checkpoint_bytes
        live = self.checkpoint_bytes
        freeable_held = sum(self._held_bytes(node) for node in held if not node.holders)
        freeable_held += sum(node.speculative for node in protected) * self.window_bytes
        if junction:  # the served junction's speculative windows stop being evictable
            served = matched[junction - 1]
            speculative = sum(step.speculative for step in self._window_nodes(served))
            freeable_held += speculative * self.window_bytes
        if needed + live + freeable_held > self.capacity - self.pinned:
            return None
        for node in held:
            self._hold(node)
        for node in protected:
            node.live += 1
            self._refresh_window(node)
        self.pinned += live
        self.used += live
        self._count_hit(matched, hits)
        if junction:
            self._refresh(matched[junction - 1])
        self._make_room(needed)
        path = held
        parent = held[-1] if held else self.root
        for unit in prompt[len(held) : length]:
            parent = self._add_node(parent, unit)
            self._hold(parent)
            path.append(parent)
        for node in path[-self.window :] if self.window_bytes and self.window else ():
            node.live += 1
        for depth in kept:
            self._set_window(path[depth - 1], True)
        for node in protected:
            node.live -= 1
        for depth in anchors:
            self._set_checkpoint(path[depth - 1], True)
            path[depth - 1].anchor = True
        self.requests[req_id] = RunningRequest(path, junction > 0, live, output_units)
        start = max(min(junction, *anchors) if anchors else junction, 1)
        self._refresh_around(path[start - 1 :])
        for depth in sorted(set(computed) - kept, reverse=True):
            self._offer(path[depth - 1], junction > 0)
        return junction

    def _kept_windows(self, length: int, anchors: set[int]) -> set[int]:
        if not self.window_bytes:
            return set()
        ends = {length, *anchors}
        return {d for end in ends for d in range(max(end - self.window + 1, 1), end + 1)}

    def _offer(self, node: HybridNode, request_hit: bool) -> None:
        """Keep `node`'s freshly computed window KV on speculation if it passes the test
        every cached record passes: room for it, or a lowest-ranked record that ranks
        below it (evicted for it). A window that would be the next victim is not kept."""
        if not self.window_bytes or node.window_kv or not self._alive(node):
            return
        record = self._new_record(node, speculative=True)
        record.request_hit = request_hit
        record.worth = self._speculative_worth(node)
        policy = self.policy
        policy.release(record)
        while self.capacity - self.used < self.window_bytes:
            lowest = policy.first_candidate()
            if lowest is None or policy.entry_of(lowest) > policy.entry_of(record):
                policy.remove(record)
                return
            self._retire(lowest)
            if not self._alive(node):
                policy.remove(record)
                return
        self._set_window(node, True)  # held by the request, not live: speculative
        self._account(node, -1)
        node.speculative = True
        self._account(node, 1)
        node.window_record = record
        policy.add_candidate(record)
        record.candidate = True

    def _speculative_worth(self, node: HybridNode) -> float:
        # a speculative window serves a request leaving the path here rather than one
        # unit earlier, where the window before it is likely present too: it saves its
        # own unit's prefill
        bt = self.block_tokens
        unit = self.spec.prefill_flops((node.depth - 1) * bt, node.depth * bt)
        return unit / self.window_bytes * self._worth_scale

    def can_grow(self, req_id: int, units: int) -> bool:
        needed = units * (self.kv_bytes + self.window_bytes)
        return needed <= self.capacity - self.pinned

    def grow(self, req_id: int, units: list[int]) -> bool:
        """Append decode units; False, having changed nothing, if they do not fit."""
        if not units:
            return True
        if not self.can_grow(req_id, len(units)):
            return False
        request = self.requests[req_id]
        self._make_room(len(units) * (self.kv_bytes + self.window_bytes))
        path = request.path
        changed = []
        for unit in units:
            node = self._add_node(path[-1] if path else self.root, unit)
            self._hold(node)
            path.append(node)
            if self.window_bytes and self.window:
                node.live += 1
                self._set_window(node, True)
                if len(path) > self.window:  # the unit that left the window it computes with
                    out = path[-self.window - 1]
                    out.live -= 1
                    changed.append(out)
            changed.append(node)
        self._refresh_around(changed)
        return True

    def finish(self, req_id: int) -> None:
        """End the request: what it holds is released, kept where a junction can use it."""
        request = self.requests.pop(req_id)
        self.pinned -= request.live_bytes
        self.used -= request.live_bytes
        path = request.path
        for node in path[-self.window :] if self.window_bytes and self.window else ():
            node.live -= 1
        for node in path:
            self._release(node)
        below = 0  # junctions of this path below the node
        for node in reversed(path):
            for record in (node.record, node.window_record):
                if record is not None:
                    record.from_end = below
                    record.request_hit = request.hit
                    record.request_output = request.output_units
            below += node.record is not None
        self._refresh_around(path)

    def _count_hit(self, matched: list[HybridNode], hits: Hits) -> None:
        junction = hits.junction
        self.metrics.lookups += 1
        self.metrics.junction_units += junction
        for kind, units in hits.by_kind.items():
            self.metrics.kind_units[kind] = self.metrics.kind_units.get(kind, 0) + units
        if not junction:
            return
        served = matched[junction - 1]
        for step in self._window_nodes(served):  # speculative windows that paid off
            if step.window_record is not None:
                step.window_record.hits += 1
                self.policy.hit(step.window_record)
        if served.record is not None:
            served.record.hits += 1
            self.policy.hit(served.record)
        served.anchor = True  # served here: keep a junction here

    # ------------------------------------------------------------------ state changes

    def _account(self, node: HybridNode, sign: int) -> None:
        """Add (`sign` 1) or take away (-1) what `node` holds from the byte totals."""
        window = self.window_bytes if node.window_kv else 0
        checkpoint = self.checkpoint_bytes if node.checkpoint else 0
        self.used += sign * (self.kv_bytes + window + checkpoint)
        cached = self.cached_by_kind
        if node.holders:
            self.pinned += sign * (self.kv_bytes + checkpoint + (0 if node.speculative else window))
            if window and node.speculative:
                cached[GroupKind.SLIDING_WINDOW] += sign * window
            return
        cached[GroupKind.FULL] += sign * self.kv_bytes
        if window:
            cached[GroupKind.SLIDING_WINDOW] += sign * window
        if checkpoint:
            cached[GroupKind.MAMBA] += sign * checkpoint

    def _held_bytes(self, node: HybridNode) -> int:
        """What holding the unheld `node` pins."""
        window = self.window_bytes if node.window_kv and not node.speculative else 0
        return self.kv_bytes + window + (self.checkpoint_bytes if node.checkpoint else 0)

    def _add_node(self, parent: HybridNode, unit: int) -> HybridNode:
        node = HybridNode(unit, parent, parent.depth + 1, hash((parent.key, unit)))
        node.anchor = self.every_node_anchors
        parent.children[unit] = node
        self.node_count += 1
        self._account(node, 1)
        return node

    def _remove_node(self, node: HybridNode) -> None:
        self._drop_record(node)
        self._drop_window_record(node)
        self._account(node, -1)
        self.metrics.freed_bytes += self._held_bytes(node) + (
            self.window_bytes if node.speculative else 0
        )
        del node.parent.children[node.unit]
        self.node_count -= 1

    def _hold(self, node: HybridNode) -> None:
        if not node.holders:
            record = node.record
            if record is not None and record.candidate:
                record.candidate = False
                self.policy.discard_candidate(record)
            self._account(node, -1)
            node.holders = 1
            self._account(node, 1)
        else:
            node.holders += 1

    def _release(self, node: HybridNode) -> None:
        if node.holders == 1:
            self._account(node, -1)
            node.holders = 0
            self._account(node, 1)
        else:
            node.holders -= 1

    def _set_window(self, node: HybridNode, value: bool) -> None:
        if node.window_kv != value and self.window_bytes:
            self._account(node, -1)
            if not value:
                self.metrics.freed_bytes += self.window_bytes
                node.speculative = False
            node.window_kv = value
            self._account(node, 1)
            if not value:
                self._drop_window_record(node)

    def _set_checkpoint(self, node: HybridNode, value: bool) -> None:
        if node.checkpoint != value and self.mamba:
            self._account(node, -1)
            if not value:
                self.metrics.freed_bytes += self.checkpoint_bytes
            node.checkpoint = value
            self._account(node, 1)

    def _prune(self, node: HybridNode | None) -> HybridNode | None:
        """Remove the unheld leaf tail ending at `node` that no junction needs; return the
        node where it stopped."""
        while (
            node is not None
            and node.parent is not None
            and not node.children
            and not node.holders
            and node.record is None
            and not self._is_junction(node)
        ):
            parent = node.parent
            self._remove_node(node)
            node = parent
        return node

    # ------------------------------------------------------------------ records

    def _is_junction(self, node: HybridNode) -> bool:
        """An anchor where every group is served."""
        if not node.anchor or (self.mamba and not node.checkpoint):
            return False
        return all(step.window_kv for step in self._window_nodes(node))

    def _window_nodes(self, node: HybridNode) -> Iterator[HybridNode]:
        """The nodes whose window KV a junction at `node` needs, `node` first."""
        if not self.window_bytes:
            return
        step = node
        for _ in range(min(self.window, node.depth)):
            yield step
            step = step.parent

    def _alive(self, node: HybridNode) -> bool:
        return node.parent is not None and node.parent.children.get(node.unit) is node

    def _new_record(self, node: HybridNode, speculative: bool) -> HybridRecord:
        record = HybridRecord(next(self._serials), node.key, node.depth, node, speculative)
        self.policy.insert(record)
        return record

    def _forget(self, record: HybridRecord | None) -> None:
        """`record` leaves the policy (no-op for None)."""
        if record is not None:
            if record.candidate:
                self.policy.discard_candidate(record)
            self.policy.remove(record)

    def _drop_record(self, node: HybridNode) -> None:
        self._forget(node.record)
        node.record = None

    def _drop_window_record(self, node: HybridNode) -> None:
        self._forget(node.window_record)
        node.window_record = None

    def _refresh_around(self, nodes: list[HybridNode]) -> None:
        """Re-decide the records of each of `nodes` and of the nodes whose window reaches
        them, deepest first, then prune the tails no junction needs."""
        seen: set[int] = set()
        order = []
        for node in reversed(nodes):
            for near in self._window_neighbourhood(node):
                if id(near) not in seen:
                    seen.add(id(near))
                    order.append(near)
        for near in order:
            self._refresh(near)
        for near in order:
            self._refresh_window(near)
        for near in order:
            if self._alive(near) and not near.children:
                stop = self._prune(near)
                if stop is not near and stop is not None and stop.parent is not None:
                    self._refresh(stop)

    def _window_neighbourhood(self, node: HybridNode) -> Iterator[HybridNode]:
        yield node
        if self.window_bytes and self.window > 1:
            frontier = list(node.children.values())
            for _ in range(self.window - 1):
                yield from frontier
                frontier = [child for n in frontier for child in n.children.values()]

    def _refresh(self, node: HybridNode) -> None:
        """Make `node`'s junction record match its state, and rank it if it is a candidate."""
        if not self._alive(node):
            return
        if not self._is_junction(node):
            if node.record is not None:
                self._drop_record(node)
                for step in self._window_nodes(node):
                    self._refresh_window(step)
            return
        record = node.record
        if record is None:
            record = node.record = self._new_record(node, speculative=False)
            for step in self._window_nodes(node):
                self._refresh_window(step)
        if record.candidate:
            record.candidate = False
            self.policy.discard_candidate(record)
        if node.holders:
            return
        freed = self._retire_bytes(node)
        if not freed:
            return
        record.worth = self._marginal_flops(node) / freed * self._worth_scale
        self.policy.release(record)
        self.policy.add_candidate(record)
        record.candidate = True

    def _refresh_window(self, node: HybridNode) -> None:
        """Make `node`'s window KV speculative exactly when no junction and no running
        request needs it, with a ranked record while it is."""
        if not self._alive(node) or not node.window_kv:
            return
        speculative = not node.live and not self._window_needed(node, None)
        if speculative != node.speculative:
            self._account(node, -1)
            node.speculative = speculative
            self._account(node, 1)
        if not speculative:
            self._drop_window_record(node)
            return
        if node.window_record is None:
            record = node.window_record = self._new_record(node, speculative=True)
            record.worth = self._speculative_worth(node)
            self.policy.release(record)
            self.policy.add_candidate(record)
            record.candidate = True

    def _marginal_flops(self, node: HybridNode) -> float:
        """What a junction at `node` saves beyond the nearest junction above it (looking
        at most `MARGINAL_REACH` units up, to keep each call O(1))."""
        above, reach = node.parent, MARGINAL_REACH
        while above.parent is not None and above.record is None and reach:
            above, reach = above.parent, reach - 1
        bt = self.block_tokens
        return self.spec.prefill_flops(above.depth * bt, node.depth * bt)

    def _exclusive_windows(self, node: HybridNode) -> list[HybridNode]:
        """Window KV of the junction at `node` that nothing else needs."""
        return [
            step
            for step in self._window_nodes(node)
            if step.window_kv
            and not step.holders
            and not step.live
            and not self._window_needed(step, node)
        ]

    def _window_needed(self, step: HybridNode, besides: HybridNode | None) -> bool:
        """Whether a junction other than `besides` needs `step`'s window KV."""
        frontier = [step]
        for _ in range(self.window):
            for near in frontier:
                if near is not besides and near.record is not None:
                    return True
            frontier = [child for n in frontier for child in n.children.values()]
        return False

    def _retire_bytes(self, node: HybridNode) -> int:
        freed = node.checkpoint * self.checkpoint_bytes
        exclusive = self._exclusive_windows(node)
        freed += len(exclusive) * self.window_bytes
        step = node
        while step.parent is not None and not step.children and not step.holders:
            freed += self.kv_bytes
            if step is not node:
                freed += step.checkpoint * self.checkpoint_bytes
                freed += (step.window_kv and step not in exclusive) * self.window_bytes
            parent = step.parent
            if len(parent.children) > 1 or parent.record is not None:
                break
            step = parent
        return freed

    def _retire(self, record: HybridRecord) -> None:
        node = record.node
        if record.speculative:
            self.metrics.windows_evicted += 1
            self._set_window(node, False)
            self._refresh_around([node])
            return
        self.metrics.retired += 1
        for step in self._exclusive_windows(node):
            self._set_window(step, False)
        self._set_checkpoint(node, False)
        node.anchor = self.every_node_anchors and bool(node.children)
        self._drop_record(node)
        touched = [node]
        if not node.children and not node.holders:
            parent = node.parent
            self._remove_node(node)  # a leaf junction: its path goes with it
            touched = [parent] if parent.parent is not None else []
        ancestor = node.parent
        for _ in range(self.window):
            if ancestor is None or ancestor.parent is None:
                break
            touched.append(ancestor)
            ancestor = ancestor.parent
        self._refresh_around(touched)

    def _make_room(self, needed: int) -> None:
        policy = self.policy
        while self.capacity - self.used < needed:
            victim = policy.first_candidate()
            if victim is None:
                raise RuntimeError(
                    f"nothing evictable, {self.capacity - self.used} bytes free, "
                    f"{needed} needed; admission should have refused"
                )
            self._retire(victim)

    # ------------------------------------------------------------------ reading

    def nodes(self) -> Iterator[HybridNode]:
        stack = list(self.root.children.values())
        while stack:
            node = stack.pop()
            yield node
            stack.extend(node.children.values())

    def check_invariants(self) -> None:
        """Raise AssertionError if an invariant of the module docstring does not hold."""
        from kvplug.hybrid.audit import check_invariants

        check_invariants(self)


__all__ = ["HybridCache", "HybridNode"]
