"""kvplug's hybrid cache: every state group in one byte budget, one decision across them.

The reference for hybrid models, as `kvplug.core.cache.KVCache` is for full attention:
the replay runs it beside the engines' own hybrid caches, and the adapters are checked
against its rules. A prefix tree of units (one unit = `block_tokens` tokens); each node
may hold, for the unit ending at its depth,

- ``kv``: the full-attention groups' KV (a node exists only while it holds it);
- ``window_kv``: the sliding-window groups' KV;
- ``checkpoint``: the Mamba groups' state at its end.

All groups of one kind are decided together: they serve the same positions and differ
only in which layers they page.

**What is kept.** A hit is the junction (`kvplug.hybrid.junction`), so state that no
junction can use is worth nothing. A request's sliding-window KV and Mamba checkpoints
are admitted only around the positions where later requests resume: the end of its
prompt's full units and the branch point where it left the cached tree (Marconi's
rule). Window KV that slides out elsewhere is freed at once; so is a tail of nodes that
no junction below needs.

**What goes first.** Eviction removes whole junctions: the candidate is a junction node
(held by no request) whose removal frees bytes, and removing it frees its checkpoint,
the window KV no other junction needs, and, at a leaf, the full-attention path up to the
next junction or branch. One kvplug policy ranks the junctions (`lru`: by release;
`cost`: GreedyDual with the FLOPs the junction saves beyond the junction above it, per
byte its removal frees, learned reuse odds and decay).

Invariants (`check_invariants`): a node's parent holds KV (prefixes stay whole); the
used bytes are the sum of what nodes and running requests hold; a request's nodes are
held and never evicted; every candidate is an unheld junction; the policy's candidate
set is exactly the junction records marked as candidates.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass, field
from itertools import count

from kvplug.core.groups import GroupKind
from kvplug.errors import ConfigError, UnknownPolicyError
from kvplug.hybrid.junction import Hits, longest_hits
from kvplug.hybrid.spec import HybridSpec
from kvplug.policies import EvictionPolicy, make_policy
from kvplug.policies.cost import CostPolicy, ReuseClass
from kvplug.policies.node import CachedNode

HYBRID_POLICIES = ("lru", "cost")


class JunctionCostPolicy(CostPolicy):
    """`cost` over junctions: GreedyDual with the junction's own worth (FLOPs it saves
    per byte its removal frees) in place of a block's value by depth.

    A junction's reuse class always includes its `from_end`, the junctions of the
    releasing request's path below it (0: the deepest): a conversation's earlier turns
    end in junctions that its later turns pass, reused once and then rarely again, and
    the class tells them from the turn that is still open.
    """

    def classify(self, node: CachedNode) -> ReuseClass:
        output = min(node.request_output.bit_length(), 12)
        return (min(self.reuses(node), 3), min(node.from_end, 3), int(node.request_hit), output)

    def credit(self, node: CachedNode) -> float:
        serial = node.serial
        reuses = min(self.reuses(node), 3)
        output = min(node.request_output.bit_length(), 12)
        code = ((reuses << 2 | min(node.from_end, 3)) << 1 | bool(node.request_hit)) << 4
        code |= output
        self._trial[serial] = code
        probability = self._probability.get(code)
        if probability is None:
            if code not in self._classes:
                self._classes[code] = self.classify(node)
            probability = self._probability[code] = self.reuse_probability(self._classes[code])
        return (1 + min(node.hits, 3)) * probability

    def rank(self, node: JunctionRecord) -> float:  # type: ignore[override]
        return self.inflation + self.credit(node) * node.worth


def make_hybrid_policy(name: str, block_tokens: int) -> EvictionPolicy:
    if name == "cost":
        return JunctionCostPolicy(tokens_per_block=block_tokens)
    if name == "lru":
        return make_policy("lru")
    raise UnknownPolicyError(
        f"unknown hybrid policy {name!r}; accepted: {', '.join(HYBRID_POLICIES)}"
    )


class HybridNode:
    __slots__ = (
        "unit", "parent", "children", "depth", "key", "window_kv", "checkpoint", "holders",
        "record",
    )  # fmt: skip

    kv = True  # a node exists only while it holds full-attention KV

    def __init__(self, unit: int, parent: HybridNode | None, depth: int, key: int) -> None:
        self.unit = unit
        self.parent = parent
        self.children: dict[int, HybridNode] = {}
        self.depth = depth
        self.key = key
        self.window_kv = False
        self.checkpoint = False
        self.holders = 0
        self.record: JunctionRecord | None = None


@dataclass(eq=False, slots=True)
class JunctionRecord:
    """A junction as the policy sees it (the `CachedNode` contract), plus its worth."""

    serial: int
    key: int
    depth: int
    node: HybridNode
    hits: int = 0
    from_end: int = 0
    request_hit: bool = False
    request_output: int = 0
    worth: float = 0.0
    candidate: bool = False


@dataclass
class RunningRequest:
    path: list[HybridNode]
    anchors: set[int]  # depths whose window KV and checkpoint are kept: branch point, prompt end
    hit: bool
    live_bytes: int  # the Mamba state it runs with
    output_units: int = 0


@dataclass
class HybridMetrics:
    lookups: int = 0
    junction_units: int = 0
    kind_units: dict[GroupKind, int] = field(default_factory=dict)
    retired: int = 0  # junctions evicted
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
        self.policy = make_hybrid_policy(policy, block_tokens)
        self.policy.bind(1, max(1, capacity_bytes // spec.page_bytes(block_tokens)))
        self.root = HybridNode(-1, None, 0, 0)
        self.used = 0
        self.node_count = 0
        self.pinned = 0  # bytes no eviction may free: held nodes and live states
        self.cached_by_kind = {kind: 0 for kind in self.kinds}  # bytes held by no request
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
        window = self._kept_window(junction, length, anchors)
        new_nodes = length - len(held)
        needed = new_nodes * self.kv_bytes
        needed += sum(1 for d in window if d > len(held) or not held[d - 1].window_kv) * (
            self.window_bytes
        )
        needed += sum(1 for d in anchors if d > len(held) or not held[d - 1].checkpoint) * (
            self.checkpoint_bytes
        )
        live = self.checkpoint_bytes
        freeable_held = sum(self._node_bytes(node) for node in held if not node.holders)
        if needed + live + freeable_held > self.capacity - self.pinned:
            return None
        for node in held:
            self._hold(node)
        self.pinned += live
        self.used += live
        self._make_room(needed)
        path = held
        parent = held[-1] if held else self.root
        for unit in prompt[len(held) : length]:
            parent = self._add_node(parent, unit)
            self._hold(parent)
            path.append(parent)
        for depth in window:
            self._set_window(path[depth - 1], True)
        if GroupKind.MAMBA in self.kinds:
            for depth in anchors:
                self._set_checkpoint(path[depth - 1], True)
        self.metrics.lookups += 1
        self.metrics.junction_units += junction
        for kind, units in hits.by_kind.items():
            self.metrics.kind_units[kind] = self.metrics.kind_units.get(kind, 0) + units
        if junction:
            record = matched[junction - 1].record
            if record is not None:
                record.hits += 1
                self.policy.hit(record)
        self.requests[req_id] = RunningRequest(path, anchors, junction > 0, live, output_units)
        self._refresh_around(path[max(junction, 1) - 1 :] if path else [])
        return junction

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
        parent = request.path[-1] if request.path else self.root
        changed = []
        for unit in units:
            parent = self._add_node(parent, unit)
            self._hold(parent)
            request.path.append(parent)
            self._set_window(parent, True)
            changed.append(parent)
            slid = self._slide_window(request)
            if slid is not None:
                changed.append(slid)
        self._refresh_around(changed)
        return True

    def finish(self, req_id: int) -> None:
        """End the request: what it holds is released, kept where a junction can use it."""
        request = self.requests.pop(req_id)
        self.pinned -= request.live_bytes
        self.used -= request.live_bytes
        path = request.path
        keep = self._kept_window(0, len(path), request.anchors, running=False)
        for node in path[-self.window :] if self.window else ():
            if node.window_kv and node.depth not in keep:
                self._set_window(node, False)
        for node in path:
            self._release(node)
        if path:
            self._prune(path[-1])
        below = 0  # junctions of this path below the node
        for node in reversed(path):
            record = node.record
            if record is not None and node.parent is not None:
                record.from_end = below
                record.request_hit = request.hit
                record.request_output = request.output_units
                below += 1
        self._refresh_around(path)

    # ------------------------------------------------------------------ state changes

    def _kept_window(
        self, start: int, length: int, anchors: set[int], running: bool = True
    ) -> set[int]:
        """Depths (after `start`) whose window KV the request keeps: the window before
        each anchor, and, while running, the window it computes with."""
        if not self.window_bytes:
            return set()
        ends = set(anchors) | ({length} if running else set())
        return {
            depth for end in ends for depth in range(max(start + 1, end - self.window + 1), end + 1)
        }

    def _slide_window(self, request: RunningRequest) -> HybridNode | None:
        """Free the window KV of the unit that just left the running window, unless it is
        in the window before an anchor; return the node if it changed."""
        if not self.window_bytes:
            return None
        path = request.path
        out = len(path) - self.window  # depth that just left the running window
        if out >= 1 and path[out - 1].window_kv:
            near_anchor = any(0 <= anchor - out < self.window for anchor in request.anchors)
            if not near_anchor:
                self._set_window(path[out - 1], False)
                return path[out - 1]
        return None

    def _add_node(self, parent: HybridNode, unit: int) -> HybridNode:
        node = HybridNode(unit, parent, parent.depth + 1, hash((parent.key, unit)))
        parent.children[unit] = node
        self.used += self.kv_bytes
        self.cached_by_kind[GroupKind.FULL] += self.kv_bytes
        self.node_count += 1
        return node

    def _node_bytes(self, node: HybridNode) -> int:
        return (
            self.kv_bytes
            + node.window_kv * self.window_bytes
            + node.checkpoint * self.checkpoint_bytes
        )

    def _count_cached(self, node: HybridNode, sign: int) -> None:
        cached = self.cached_by_kind
        cached[GroupKind.FULL] += sign * self.kv_bytes
        if node.window_kv:
            cached[GroupKind.SLIDING_WINDOW] += sign * self.window_bytes
        if node.checkpoint:
            cached[GroupKind.MAMBA] += sign * self.checkpoint_bytes

    def _hold(self, node: HybridNode) -> None:
        if not node.holders:
            self.pinned += self._node_bytes(node)
            self._count_cached(node, -1)
            record = node.record
            if record is not None and record.candidate:
                record.candidate = False
                self.policy.discard_candidate(record)
        node.holders += 1

    def _release(self, node: HybridNode) -> None:
        node.holders -= 1
        if not node.holders:
            self.pinned -= self._node_bytes(node)
            self._count_cached(node, 1)

    def _set_window(self, node: HybridNode, value: bool) -> None:
        if node.window_kv != value and self.window_bytes:
            delta = self.window_bytes if value else -self.window_bytes
            self._resize(node, delta, GroupKind.SLIDING_WINDOW)
            node.window_kv = value

    def _set_checkpoint(self, node: HybridNode, value: bool) -> None:
        if node.checkpoint != value:
            delta = self.checkpoint_bytes if value else -self.checkpoint_bytes
            self._resize(node, delta, GroupKind.MAMBA)
            node.checkpoint = value

    def _resize(self, node: HybridNode, delta: int, kind: GroupKind) -> None:
        self.used += delta
        if node.holders:
            self.pinned += delta
        else:
            self.cached_by_kind[kind] += delta
        if delta < 0:
            self.metrics.freed_bytes -= delta

    def _remove_node(self, node: HybridNode) -> None:
        self._set_window(node, False)
        self._set_checkpoint(node, False)
        self._drop_record(node)
        del node.parent.children[node.unit]
        self.used -= self.kv_bytes
        self.node_count -= 1
        self.cached_by_kind[GroupKind.FULL] -= self.kv_bytes
        self.metrics.freed_bytes += self.kv_bytes

    def _prune(self, node: HybridNode | None) -> HybridNode | None:
        """Remove the unheld leaf tail ending at `node` that no junction needs; return the
        node where it stopped."""
        while (
            node is not None
            and node.parent is not None
            and not node.children
            and not node.holders
            and not self._is_junction(node)
        ):
            parent = node.parent
            self._remove_node(node)
            node = parent
        return node

    # ------------------------------------------------------------------ junctions

    def _is_junction(self, node: HybridNode) -> bool:
        if GroupKind.MAMBA in self.kinds and not node.checkpoint:
            return False
        if self.window_bytes:
            needed, step = min(self.window, node.depth), node
            for _ in range(needed):
                if not step.window_kv:
                    return False
                step = step.parent
        return True

    def _drop_record(self, node: HybridNode) -> None:
        record = node.record
        if record is None:
            return
        if record.candidate:
            self.policy.discard_candidate(record)
        self.policy.remove(record)
        node.record = None

    def _refresh_around(self, nodes: list[HybridNode]) -> None:
        """Re-decide the junction record of each of `nodes` and of the nodes whose window
        reaches them, deepest first."""
        seen: set[int] = set()
        for node in reversed(nodes):
            for near in self._window_neighbourhood(node):
                if id(near) not in seen:
                    seen.add(id(near))
                    self._refresh(near)

    def _window_neighbourhood(self, node: HybridNode) -> Iterator[HybridNode]:
        yield node
        if self.window_bytes and self.window > 1:
            frontier = list(node.children.values())
            for _ in range(self.window - 1):
                yield from frontier
                frontier = [child for n in frontier for child in n.children.values()]

    def _refresh(self, node: HybridNode) -> None:
        if node.parent is None or node.parent.children.get(node.unit) is not node:
            return  # the root, or removed already
        if not self._is_junction(node):
            self._drop_record(node)
            if not node.children and not node.holders:
                self._prune(node)
            return
        record = node.record
        if record is None:
            record = node.record = JunctionRecord(next(self._serials), node.key, node.depth, node)
            self.policy.insert(record)
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

    def _marginal_flops(self, node: HybridNode) -> float:
        """What the junction saves beyond the nearest junction above it."""
        above = node.parent
        while above.parent is not None and above.record is None:
            above = above.parent
        start = above.depth
        bt = self.block_tokens
        return self.spec.prefill_flops(start * bt, node.depth * bt)

    def _exclusive_windows(self, node: HybridNode) -> list[HybridNode]:
        """Window KV of the junction at `node` that no other junction needs."""
        if not self.window_bytes:
            return []
        exclusive, step = [], node
        for _ in range(min(self.window, node.depth)):
            if step.window_kv and not step.holders and not self._window_needed(step, node):
                exclusive.append(step)
            step = step.parent
        return exclusive

    def _window_needed(self, step: HybridNode, besides: HybridNode) -> bool:
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

    def _retire(self, record: JunctionRecord) -> None:
        node = record.node
        self.metrics.retired += 1
        for step in self._exclusive_windows(node):
            self._set_window(step, False)
        self._set_checkpoint(node, False)
        self._drop_record(node)
        touched = []
        if not node.children and not node.holders:
            parent = node.parent
            self._remove_node(node)  # a leaf junction: its path goes with it
            touched.append(self._prune(parent))
        else:
            touched.append(node)
        ancestor = node.parent
        for _ in range(self.window):
            if ancestor is None or ancestor.parent is None:
                break
            touched.append(ancestor)
            ancestor = ancestor.parent
        for near in touched:
            if near is not None:
                self._refresh(near)

    def _make_room(self, needed: int) -> None:
        policy = self.policy
        while self.capacity - self.used < needed:
            victim = policy.first_candidate()
            if victim is None:
                raise RuntimeError(
                    f"no evictable junction, {self.capacity - self.used} bytes free, "
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

    def bytes_by_kind(self) -> dict[GroupKind, int]:
        """Bytes of cached state held by no request, by kind."""
        held = {kind: 0 for kind in self.kinds}
        for node in self.nodes():
            if node.holders:
                continue
            held[GroupKind.FULL] += self.kv_bytes
            if node.window_kv:
                held[GroupKind.SLIDING_WINDOW] += self.window_bytes
            if node.checkpoint:
                held[GroupKind.MAMBA] += self.checkpoint_bytes
        return held

    def check_invariants(self) -> None:
        used = sum(r.live_bytes for r in self.requests.values())
        pinned = used
        holders: dict[int, int] = {}
        for request in self.requests.values():
            for node in request.path:
                holders[id(node)] = holders.get(id(node), 0) + 1
        candidates = 0
        for node in self.nodes():
            size = self._node_bytes(node)
            used += size
            assert node.parent.children.get(node.unit) is node, "tree link broken"
            assert node.holders == holders.get(id(node), 0), "holder count off"
            if node.holders:
                pinned += size
            record = node.record
            assert (record is not None) == self._is_junction(node), "junction record stale"
            if record is not None and record.candidate:
                candidates += 1
                assert not node.holders, "a held junction is a candidate"
        assert used == self.used, f"used bytes {self.used} != {used}"
        assert self.bytes_by_kind() == self.cached_by_kind, "bytes by kind off"
        assert pinned == self.pinned, f"pinned bytes {self.pinned} != {pinned}"
        assert self.used <= self.capacity, "over capacity"
        assert candidates == len(self.policy), "policy candidates differ from records"


__all__ = ["HYBRID_POLICIES", "HybridCache", "JunctionCostPolicy", "make_hybrid_policy"]
