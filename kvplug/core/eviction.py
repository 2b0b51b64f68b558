"""The eviction core: which cached blocks may be evicted, and which goes next.

Every cache kvplug decides for (its own `KVCache`, vLLM's block pool through
`kvplug.vllm.block_pool`, and the replay) keeps its candidate set here and nowhere else.
The adapter reports what happens to a cached block; the core keeps the policy's candidate
set exact and answers "next victim" with the policy's choice.

A *node* is one cached block (a `TreeNode`). Per node the core keeps:

- ``evictable``: cached, held by nobody, and no in-flight step can touch it. The adapter
  says so with `release` and takes it back with `reclaim` (a prefix hit).
- ``parent``: the node before it in its sequence, given to `insert` (a namespace root,
  which is never evictable, or None, for a first block, and for groups without prefix
  order, such as sliding-window groups). The link is live while the parent keeps the
  serial it had then: an adapter whose engine may drop a block that still has children
  renews the block's serial, so its children need no notice and no child list is kept.
- ``cached_children``: how many cached nodes name it as their live parent.

Invariants (the adapters' ``check_invariants`` audit them):

- the policy's candidates are exactly the evictable nodes with no cached children (but
  those released unranked, which their adapter evicts itself: `release_unranked`), so
  evicting only candidates keeps every cached prefix whole (a parent outlives its
  children) and a shared root waits for the leaves below it;
- `num_evictable` counts the evictable nodes, candidates or not; every one of them can be
  evicted, leaves first, when nothing else is cached below it;
- a candidate is held back exactly when it is protected, and then it is not the
  policy's; only a ranked policy's nodes are protected.

A node may also be *protected* (`protect_n`: a waiting request will hit it,
`kvplug.core.queue_protection`) at a level above 0. A protected candidate is held back
from the policy: the policy's candidates go first, then the held-back ones, the lowest
level first and, within a level, in the policy's order (its entry). So the eviction
order is by (level, entry), level 0 for every unprotected node, as the dense core
orders its heap (`kvplug.core.dense`). A level lasts until it is changed or the node
leaves the cache.

Every method is O(1) plus the policy's O(log n); taking a held-back victim is O(h), h
the held-back candidates (protection is bounded by the waiting requests it reads).
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from heapq import heappop, heappush
from itertools import chain
from operator import itemgetter
from typing import Generic, Protocol, TypeVar

from kvplug.policies.base import EvictionPolicy, RankedPolicy
from kvplug.policies.entry import SERIAL_MASK
from kvplug.policies.node import CachedNode


class TreeNode(CachedNode, Protocol):
    """A cached block as the eviction core sees it: the policy's fields plus its place
    in the tree. The core owns the last four fields; adapters only read them."""

    parent: TreeNode | None
    parent_serial: int  # the parent's serial when linked; a mismatch means it left
    cached_children: int
    evictable: bool


N = TypeVar("N", bound=TreeNode)


def live_parent(node: TreeNode) -> TreeNode | None:
    """`node`'s parent, if it is still the block it was linked to."""
    parent = node.parent
    if parent is None or parent.serial != node.parent_serial:
        return None
    return parent


# what `EvictionCore.pop_victims` does itself on a `RankedPolicy`'s candidate heap
_HEAP_METHODS = ("first_candidate", "pop_first", "add_candidate", "discard_candidate")


class EvictionCore(Generic[N]):
    """The candidate set of one cache, kept exact for `policy` (see the module doc)."""

    def __init__(self, policy: EvictionPolicy) -> None:
        self.policy = policy
        self.num_evictable = 0
        # `pop_victims` may work on the candidate heap itself only while the policy keeps
        # its candidates as `RankedPolicy` does
        kind = type(policy)
        self._heap_direct = isinstance(policy, RankedPolicy) and all(
            getattr(kind, name) is getattr(RankedPolicy, name) for name in _HEAP_METHODS
        )
        self._levels: dict[int, int] = {}  # serial -> protection level, of cached nodes
        self._held_back: dict[int, N] = {}  # serial -> protected candidate

    def __len__(self) -> int:
        """The number of candidates (evictable leaves)."""
        return len(self.policy) + len(self._held_back)

    @property
    def num_protected(self) -> int:
        """The cached nodes with a protection level."""
        return len(self._levels)

    def protection_of(self, node: N) -> int:
        return self._levels.get(node.serial, 0)

    def check_protection(self, cached: Sequence[N]) -> None:
        """Raise AssertionError unless every level belongs to one of the `cached` nodes
        (every node in the cache), a held-back node is a protected evictable leaf, and no
        protected node is among the policy's candidates."""
        serials = {node.serial for node in cached}
        assert set(self._levels) <= serials, "a level outlived its node"
        policy = self.policy
        in_policy = policy.candidate_heap()[1] if isinstance(policy, RankedPolicy) else {}
        for node in cached:
            protected = node.serial in self._levels
            if node.serial in self._held_back:
                assert protected and node.evictable and node.cached_children == 0, "held back"
            assert not (protected and node.serial in in_policy), "a protected policy candidate"

    def protect_n(self, nodes: Sequence[N], levels: Sequence[int]) -> None:
        """Give each of `nodes` (cached) its protection level in `levels` (parallel; 0:
        none), which lasts until it is changed here or the node leaves the cache."""
        policy = self.policy
        if not isinstance(policy, RankedPolicy):
            raise TypeError(f"policy {policy.name!r} ranks no nodes: none can be protected")
        protected, held_back, candidates = self._levels, self._held_back, policy.candidate_heap()[1]
        for node, level in zip(nodes, levels, strict=True):
            serial = node.serial
            old = protected.get(serial, 0)
            if level == old:
                continue
            if level:
                protected[serial] = level
                if not old and serial in candidates:
                    policy.discard_candidate(node)
                    held_back[serial] = node
            else:
                del protected[serial]
                if held_back.pop(serial, None) is not None:
                    policy.add_candidate(node)

    def insert(self, node: N, parent: N | None, inside: Sequence[bytes] = ()) -> None:
        """`node` was cached (held by its writer), below `parent`; an engine node of
        several blocks also names the keys of the blocks it holds before its last where
        a victim may come back (`inside`: `EvictionPolicy.ghosts_inside`)."""
        node.evictable = False
        node.cached_children = 0
        node.parent = parent
        node.parent_serial = -1 if parent is None else parent.serial
        if parent is not None:
            parent.cached_children += 1
            if parent.cached_children == 1 and parent.evictable:
                self._unoffer(parent)
        self.policy.insert(node)
        if inside:
            self.policy.ghosts_inside(node, inside)

    def insert_chain(self, nodes: Sequence[N], parent: N | None) -> None:
        """`insert` for each of `nodes`, in order, each below the one before it and the
        first below `parent`: one request's new blocks, cached together."""
        if not nodes:
            return
        policy = self.policy
        if parent is not None:
            parent.cached_children += 1
            if parent.cached_children == 1 and parent.evictable:
                self._unoffer(parent)
        above = parent
        for node in nodes:
            node.evictable = False
            node.cached_children = 1  # the next node; the last one's is set below
            node.parent = above
            node.parent_serial = -1 if above is None else above.serial
            above = node
        nodes[-1].cached_children = 0
        policy.insert_n(nodes)

    def release(self, node: N) -> None:
        """Nothing holds `node` any more and no step can touch it: rank it and offer it."""
        self.policy.release(node)
        node.evictable = True
        self.num_evictable += 1
        if node.cached_children == 0:
            self._offer(node)

    def release_n(self, nodes: Sequence[N]) -> None:
        """`release` for each of `nodes`, in order (one request's blocks, freed together),
        with the policy ranking them in one call."""
        self.policy.release_n(nodes)
        leaves = []
        for node in nodes:
            node.evictable = True
            if node.cached_children == 0:
                leaves.append(node)
        if self._levels:
            for node in leaves:
                self._offer(node)
        else:
            self.policy.add_candidates(leaves)
        self.num_evictable += len(nodes)

    def restore_n(self, nodes: Sequence[N]) -> None:
        """Nodes withdrawn without a use (another tier held them while it copied them out)
        are evictable again: a ranked policy gives each back the standing of its last
        release, the tier lowering it (`tier_changed`); any other policy releases it anew."""
        policy = self.policy
        if not isinstance(policy, RankedPolicy):
            self.release_n(nodes)
            return
        fresh = [node for node in nodes if not policy.has_rank(node)]
        if fresh:
            self.release_n(fresh)
        for node in nodes:
            if node.evictable:
                continue
            policy.restore(node)
            node.evictable = True
            self.num_evictable += 1
            if node.cached_children == 0:
                self._offer(node)
            policy.tier_changed(node, True)

    def release_unranked(self, nodes: Sequence[N]) -> None:
        """Nothing holds `nodes` (blocks without cached children) any more, and their
        adapter evicts them itself, ahead of the policy's choice: evictable, but neither
        ranked nor the policy's candidates (so no policy learns from them)."""
        for node in nodes:
            node.evictable = True
        self.num_evictable += len(nodes)

    def reclaim(self, node: N) -> None:
        """An evictable `node` is held again (a prefix hit); no-op if it is not evictable."""
        if node.evictable:
            self._withdraw(node)

    def hit(self, node: N) -> None:
        """A lookup reused `node`."""
        node.hits += 1
        self.policy.hit(node)

    def hit_n(self, nodes: Sequence[N]) -> None:
        """`hit` for each of `nodes`, in order (one request's prefix hits)."""
        for node in nodes:
            node.hits += 1
        self.policy.hit_n(nodes)

    def held_elsewhere(self, node: N, held: bool = True) -> None:
        """Another tier now holds a copy of `node`'s KV (or, `held` False, no longer does):
        the policy is told, and may re-rank it if it is evictable (`tier_changed`)."""
        if node.held_elsewhere == held:
            return
        node.held_elsewhere = held
        self.policy.tier_changed(node, node.evictable)

    def touch(self, node: N) -> None:
        """`node` was accessed now, held or not (engines that order by access report it;
        an evictable node is then also re-ranked by its adapter: `reclaim`, `release`)."""
        self.policy.touch(node)

    def remove(self, node: N) -> None:
        """`node` left the cache (evicted, invalidated, or its engine dropped its key)."""
        if node.evictable:  # _withdraw(node), inlined: this runs for every eviction
            node.evictable = False
            self.num_evictable -= 1
            if node.cached_children == 0:
                self._unoffer(node)
        self._leave(node)

    def pop_victim(self) -> N | None:
        """The candidate the policy evicts first, removed (as `remove` would), or None:
        `next_victim` and `remove` in one step, for an adapter that evicts it at once."""
        node = self.policy.pop_first()
        if node is None:
            node = self._take_held_back()
            if node is None:
                return None
        node.evictable = False
        self.num_evictable -= 1
        self._leave(node)
        return node  # type: ignore[return-value]

    def pop_victims(self, n: int) -> list[N]:
        """`pop_victim` up to `n` times (fewer once no candidate is left): the victims in
        order, each removed, in one call.

        For a `RankedPolicy` that keeps its candidates as `RankedPolicy` does (none of
        `_HEAP_METHODS` overridden), the loop works on the candidate heap directly
        (`RankedPolicy.candidate_heap`) and hands the victims to `remove_victims` at the
        end; any other policy is asked one victim at a time. A parent left without
        children whose entry is below every heap entry is the next victim, so it is taken
        at once instead of being pushed and popped: a request's chain, ranked tail
        lowest, goes in one run. The victims are exactly those of `n` `pop_victim`
        calls."""
        policy = self.policy
        if not self._heap_direct or not isinstance(policy, RankedPolicy):
            victims: list[N] = []
            while len(victims) < n:
                node = self.pop_victim()
                if node is None:
                    break
                victims.append(node)
            return victims
        heap, candidates, ranks = policy.candidate_heap()
        protected = self._levels
        victims = []
        taken = 0
        following: N | None = None  # a parent known to be the next victim
        while taken < n:
            node = following
            if node is None:
                while heap:
                    entry = heappop(heap)
                    serial = entry & SERIAL_MASK
                    found = candidates.get(serial)
                    if found is not None and ranks[serial] == entry:  # current
                        del candidates[serial]
                        node = found  # type: ignore[assignment]
                        break
                if node is None:
                    node = self._take_held_back()
                    if node is None:
                        break
            else:
                following = None
            node.evictable = False
            parent = node.parent
            if parent is not None and parent.serial == node.parent_serial:
                parent.cached_children -= 1
                if parent.cached_children == 0 and parent.evictable:
                    entry = ranks[parent.serial]
                    if protected and parent.serial in protected:
                        self._held_back[parent.serial] = parent
                    elif taken + 1 < n and (not heap or entry < heap[0]):
                        following = parent  # type: ignore[assignment]
                    else:  # policy.add_candidate(parent), inlined
                        candidates[parent.serial] = parent
                        heappush(heap, entry)
            victims.append(node)
            taken += 1
        self.num_evictable -= taken
        if protected:
            for node in victims:
                protected.pop(node.serial, None)
        policy.remove_victims(victims)
        return victims

    def _leave(self, node: N) -> None:
        """`node`, no longer evictable, leaves the cache: its parent may become a leaf."""
        parent = node.parent  # live_parent(node), inlined: this runs for every eviction
        if parent is not None and parent.serial == node.parent_serial:
            parent.cached_children -= 1
            if parent.cached_children == 0 and parent.evictable:
                self._offer(parent)
        if self._levels:
            self._levels.pop(node.serial, None)
        self.policy.remove(node)

    def split(self, upper: N, lower: N) -> None:
        """An engine that stores several blocks in one node (SGLang's radix tree) split
        `lower`: `upper`, new, now holds its first part and takes its place below its
        parent, and `lower` hangs below `upper`. `upper` inherits `lower`'s hits and,
        if `lower` is evictable, is released too (ranked now); it is never a candidate
        while `lower` is cached. The parent's child count does not change."""
        parent = live_parent(lower)
        upper.parent = parent
        upper.parent_serial = -1 if parent is None else parent.serial
        upper.cached_children = 1
        upper.evictable = False
        upper.hits = lower.hits
        self.policy.insert(upper)
        lower.parent = upper
        lower.parent_serial = upper.serial
        if lower.evictable:
            self.policy.release(upper)
            upper.evictable = True
            self.num_evictable += 1

    def iter_victims(self, gone: Sequence[N] = ()) -> Iterator[N]:
        """Every evictable node in the order successive `pop_victim` calls would take them
        once the evictable nodes `gone` have left first (nothing else changing
        meanwhile), changing nothing: the candidates in the policy's order, merged with
        each parent at the point its last cached child would leave (its rank is the one
        of its release, as `pop_victim` would find it). For a `RankedPolicy`; another
        policy yields its current candidates only (`choose_victims`)."""
        policy = self.policy
        if not isinstance(policy, RankedPolicy):
            skip = {node.serial for node in gone}
            for node in policy.choose_victims(len(policy)):
                if node.serial not in skip:
                    yield node  # type: ignore[misc]
            return
        promoted: list[tuple[tuple[int, int], N]] = []  # parents left without children
        children_left: dict[int, int] = {}
        skip = {node.serial for node in gone}
        levels = self._levels

        def leaves(node: N) -> None:
            parent = live_parent(node)
            if parent is not None and parent.evictable and parent.serial not in skip:
                left = children_left.get(parent.serial, parent.cached_children) - 1
                children_left[parent.serial] = left
                if left == 0:
                    key = (levels.get(parent.serial, 0), policy.entry_of(parent))
                    heappush(promoted, (key, parent))  # type: ignore[misc]

        for node in gone:
            leaves(node)
        # the policy's candidates (level 0), then the held-back ones by (level, entry)
        candidates = chain(
            (((0, entry), node) for entry, node in policy.iter_ranked()),
            sorted(
                (
                    ((levels[serial], policy.entry_of(node)), node)
                    for serial, node in self._held_back.items()
                ),
                key=itemgetter(0),
            ),
        )
        upcoming = next(candidates, None)
        while upcoming is not None or promoted:
            if promoted and (upcoming is None or promoted[0][0] < upcoming[0]):
                _, node = heappop(promoted)
            else:
                node = upcoming[1]  # type: ignore[index,assignment]
                upcoming = next(candidates, None)
                if node.serial in skip:
                    continue
            yield node
            leaves(node)

    def next_victim(self) -> N | None:
        """The candidate the policy evicts first, or None. Changes nothing."""
        first = self.policy.first_candidate()
        if first is None and self._held_back:
            return self._first_held_back()
        return first  # type: ignore[return-value]

    def is_candidate(self, node: N) -> bool:
        return node.evictable and node.cached_children == 0

    def _withdraw(self, node: N) -> None:
        node.evictable = False
        self.num_evictable -= 1
        if node.cached_children == 0:
            self._unoffer(node)

    def _offer(self, node: N) -> None:
        """`node` became a candidate: the policy's, or held back if it is protected."""
        if self._levels and node.serial in self._levels:
            self._held_back[node.serial] = node
        else:
            self.policy.add_candidate(node)

    def _unoffer(self, node: N) -> None:
        """`node` is no longer a candidate."""
        if self._held_back.pop(node.serial, None) is None:
            self.policy.discard_candidate(node)

    def _first_held_back(self) -> N:
        levels, entry_of = self._levels, self.policy.entry_of  # type: ignore[attr-defined]
        return min(self._held_back.values(), key=lambda node: (levels[node.serial], entry_of(node)))

    def _take_held_back(self) -> N | None:
        """The held-back candidate to evict first, no longer a candidate (None: none)."""
        if not self._held_back:
            return None
        node = self._first_held_back()
        del self._held_back[node.serial]
        self.policy.chosen = node.serial  # type: ignore[attr-defined]
        return node
