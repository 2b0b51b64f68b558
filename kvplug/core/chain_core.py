"""The eviction core for released chains: the leaf rule, with one heap entry per chain.

`kvplug.core.eviction.EvictionCore` offers the policy each evictable leaf on its own, so
every evicted block costs a heap pop and, when its parent becomes a leaf, a push. An
engine that frees a request's blocks tail first (vLLM) releases a *chain*: blocks where
each is the parent of the one before it. `ChainCore` keeps each released chain as one
unit, queued in its own heap at the order key of its current tail; evicting walks the
popped chain from its tail while the next block stays a leaf below every other queued
chain, and queues what is left once.

It decides exactly as `EvictionCore` with the same `RankedPolicy`: the victim is always
the evictable leaf with the lowest entry (rank, release order) the policy gave it at its
latest release. The policy ranks; its own candidate heap stays empty (`ChainCore` never
calls ``add_candidate``), as with `kvplug.core.ranked_set.RankedSet`.

Invariants (`check` audits them):

- every evictable node is in exactly one chain (``node.chain``, at index
  ``node.chain_at``), the chain of its latest release (or of a split of it);
- a chain's blocks before its cursor (``pos``) are gone from it (evicted, reclaimed,
  removed or released into another chain); the block at the cursor, if live, is its tail;
- the candidates (evictable nodes without cached children) are exactly the tails of the
  queued chains, and a chain is queued (``queued`` holds its tail's release order, with
  one current heap entry) exactly while its tail is a candidate.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from heapq import heappop, heappush
from typing import Any, Generic, Protocol, TypeVar

from kvplug.core.eviction import TreeNode, live_parent
from kvplug.policies.base import RankedPolicy


class ChainNode(TreeNode, Protocol):
    """A `TreeNode` with its place in a released chain (owned by `ChainCore`)."""

    chain: Chain | None
    chain_at: int


N = TypeVar("N", bound=ChainNode)


class Chain:
    """Released blocks, tail first, each the parent of the one before it."""

    __slots__ = ("nodes", "pos", "end", "queued")

    def __init__(self, nodes: list[Any]) -> None:
        self.nodes = nodes
        self.pos = 0  # the cursor: the current tail's index
        self.end = len(nodes)
        self.queued: tuple[float, float, Chain] | None = None  # its current heap entry


class ChainCore(Generic[N]):
    """The candidate set of one cache, kept as released chains (see the module doc). Its
    interface is `EvictionCore`'s, less `release_unranked` and `split`."""

    def __init__(self, policy: RankedPolicy) -> None:
        if not isinstance(policy, RankedPolicy):
            raise TypeError(f"ChainCore needs a RankedPolicy, got {type(policy).__name__}")
        self.policy = policy
        self.num_evictable = 0
        self._heap: list[tuple[float, float, Chain]] = []  # (rank, order, chain)
        self._ranks = policy._rank  # serial -> (rank, order, serial), the policy's entries

    def __len__(self) -> int:
        """The number of candidates (evictable leaves): O(n), for audits."""
        return len(self.candidates())

    def candidates(self) -> list[N]:
        """The tails of the queued chains."""
        return [e[2].nodes[e[2].pos] for e in self._heap if e[2].queued is e]

    # -- what the adapter reports --------------------------------------------------------
    def insert(self, node: N, parent: N | None) -> None:
        node.evictable = False
        node.cached_children = 0
        node.chain = None
        node.parent = parent
        node.parent_serial = -1 if parent is None else parent.serial
        if parent is not None:
            parent.cached_children += 1
            if parent.cached_children == 1 and parent.evictable:
                self._dequeue(parent)
        self.policy.insert(node)

    def release_n(self, nodes: Sequence[N]) -> None:
        """`nodes` (tail first; runs where each is the live parent of the one before are
        chains) are released: ranked by the policy, queued by chain."""
        self.policy.release_n(nodes)
        self._chain(nodes)

    def restore_n(self, nodes: Sequence[N]) -> None:
        """As `EvictionCore.restore_n`: nodes a tier held without a use keep the standing
        of their last release (lowered by the tier); never-ranked ones are released."""
        policy = self.policy
        fresh = [node for node in nodes if not policy.has_rank(node)]
        if fresh:
            policy.release_n(fresh)
        ranked_now = {id(node) for node in fresh}
        for node in nodes:
            if id(node) not in ranked_now:
                policy.restore(node)
                policy.tier_changed(node, True)
        self._chain(nodes)

    def reclaim(self, node: N) -> None:
        if node.evictable:
            self._withdraw(node)

    def hit(self, node: N) -> None:
        node.hits += 1
        self.policy.hit(node)

    def held_elsewhere(self, node: N, held: bool = True) -> None:
        if node.held_elsewhere == held:
            return
        node.held_elsewhere = held
        self.policy.tier_changed(node, node.evictable)
        chain = node.chain
        if chain is not None and chain.queued is not None and chain.nodes[chain.pos] is node:
            entry = self._ranks[node.serial]
            if entry[1] != chain.queued[1]:  # re-ranked: queue the chain at its new entry
                self._queue(chain, entry)

    def touch(self, node: N) -> None:
        self.policy.touch(node)

    def remove(self, node: N) -> None:
        if node.evictable:
            self._withdraw(node)
        self._leave(node)

    def pop_victim(self) -> N | None:
        victims = self.pop_victims(1)
        return victims[0] if victims else None

    def pop_victims(self, n: int) -> list[N]:
        """Up to `n` victims, in order, each removed as `remove` would: the leaf rule's
        order, walking a popped chain while its next block stays the lowest leaf."""
        heap, ranks, policy = self._heap, self._ranks, self.policy
        victims: list[N] = []
        hand: Chain | None = None  # a chain whose tail is below every queued entry
        while len(victims) < n:
            if hand is None:
                while heap:
                    top = heappop(heap)
                    chain = top[2]
                    if chain.queued is top:
                        break
                else:
                    break
                chain.queued = None
                hand = chain
            nodes = hand.nodes
            pos = hand.pos
            node = nodes[pos]
            node.evictable = False
            node.chain = None
            self.num_evictable -= 1
            victims.append(node)
            policy.chosen = node.serial
            parent = node.parent
            next_in_hand = None
            if parent is not None and parent.serial == node.parent_serial:
                parent.cached_children -= 1
                if parent.cached_children == 0 and parent.evictable:
                    if parent.chain is hand and parent.chain_at == pos + 1:
                        next_in_hand = parent
                    else:
                        self._activate(parent)
            policy.remove(node)
            pos += 1
            while pos < hand.end and nodes[pos].chain is not hand:
                pos += 1
            hand.pos = pos
            if next_in_hand is None:
                # the walk goes on only to a live leaf right above the victim; a live
                # block further up with children waits for them (parked)
                if pos < hand.end and nodes[pos].cached_children == 0 and nodes[pos].evictable:
                    next_in_hand = nodes[pos]
                else:
                    hand = None
                    continue
            entry = ranks[next_in_hand.serial]
            while heap and heap[0][2].queued is not heap[0]:
                heappop(heap)  # stale
            if heap and (heap[0][0], heap[0][1]) < (entry[0], entry[1]):
                self._queue(hand, entry)
                hand = None
        if hand is not None:
            self._queue(hand, ranks[hand.nodes[hand.pos].serial])
        return victims

    def next_victim(self) -> N | None:
        """The candidate evicted first, or None. Changes nothing."""
        heap = self._heap
        while heap and heap[0][2].queued is not heap[0]:
            heappop(heap)
        if not heap:
            return None
        chain = heap[0][2]
        return chain.nodes[chain.pos]  # type: ignore[no-any-return]

    def iter_victims(self, gone: Sequence[N] = ()) -> Iterator[N]:
        """Every evictable node in the order successive `pop_victim` calls would take them
        once the evictable nodes `gone` have left first, changing nothing (as
        `EvictionCore.iter_victims`: the queued tails in order, merged with each parent
        at the point its last cached child would leave)."""
        ranks = self._ranks
        promoted: list[tuple[tuple[float, float, int], N]] = []
        children_left: dict[int, int] = {}
        skip = {node.serial for node in gone}

        def leaves(node: N) -> None:
            parent = live_parent(node)
            if parent is not None and parent.evictable and parent.serial not in skip:
                left = children_left.get(parent.serial, parent.cached_children) - 1
                children_left[parent.serial] = left
                if left == 0:
                    heappush(promoted, (ranks[parent.serial], parent))  # type: ignore[misc]

        for node in gone:
            leaves(node)
        queued = self._iter_queued()
        upcoming = next(queued, None)
        while upcoming is not None or promoted:
            if promoted and (upcoming is None or promoted[0][0] < upcoming[0]):
                _, node = heappop(promoted)
            else:
                node = upcoming[1]  # type: ignore[index]
                upcoming = next(queued, None)
                if node.serial in skip:
                    continue
            yield node
            leaves(node)

    def is_candidate(self, node: N) -> bool:
        return node.evictable and node.cached_children == 0

    def check(self, evictable: Sequence[N]) -> None:
        """Raise AssertionError if an invariant of the module doc does not hold;
        `evictable` is every evictable node the adapter knows."""
        tails = {id(node) for node in self.candidates()}
        for node in evictable:
            chain = node.chain
            assert chain is not None and chain.nodes[node.chain_at] is node, node.serial
            assert chain.pos <= node.chain_at < chain.end, node.serial
            leaf = node.cached_children == 0
            assert leaf == (id(node) in tails), f"node {node.serial}: leaf {leaf}, queued"
        current = [e[2] for e in self._heap if e[2].queued is e]
        assert len({id(c) for c in current}) == len(current), "a chain queued twice"

    # -- helpers ---------------------------------------------------------------------------
    def _iter_queued(self) -> Iterator[tuple[tuple[float, float, int], N]]:
        """The queued tails with their entries, lowest first (the heap read through a
        frontier of its positions, nothing copied)."""
        heap, ranks = self._heap, self._ranks
        if not heap:
            return
        frontier = [(heap[0][:2], 0)]
        size = len(heap)
        while frontier:
            _, at = heappop(frontier)
            for child in (2 * at + 1, 2 * at + 2):
                if child < size:
                    heappush(frontier, (heap[child][:2], child))
            entry = heap[at]
            chain = entry[2]
            if chain.queued is entry:
                node = chain.nodes[chain.pos]
                yield ranks[node.serial], node

    def _chain(self, nodes: Sequence[N]) -> None:
        """Make `nodes` (ranked, tail first) evictable, in chains, each queued if its
        tail is a leaf."""
        start = 0
        count = len(nodes)
        ranks = self._ranks
        for i in range(count):
            node = nodes[i]
            node.evictable = True
            last = i + 1 == count
            if not last:
                above = nodes[i + 1]
                last = node.parent is not above or node.parent_serial != above.serial
            if last:
                members = list(nodes[start : i + 1])
                chain = Chain(members)
                for at, member in enumerate(members):
                    member.chain = chain
                    member.chain_at = at
                tail = members[0]
                if tail.cached_children == 0:
                    self._queue(chain, ranks[tail.serial])
                start = i + 1
        self.num_evictable += count

    def _queue(self, chain: Chain, entry: tuple[float, float, int]) -> None:
        queued = chain.queued = (entry[0], entry[1], chain)
        heappush(self._heap, queued)

    def _dequeue(self, node: N) -> None:
        """`node` stops being a candidate: its chain, if it is the queued tail, waits."""
        chain = node.chain
        if chain is not None and chain.nodes[chain.pos] is node:
            chain.queued = None

    def _activate(self, node: N) -> None:
        """`node`, evictable, has just lost its last cached child: it is a candidate. At
        its chain's cursor the chain is queued; further up, the chain is split there."""
        chain = node.chain
        assert chain is not None
        at = node.chain_at
        if at != chain.pos:
            old = chain
            members = old.nodes[at : old.end]
            old.end = at
            chain = Chain(members)
            for i, member in enumerate(members):
                if member.chain is old and member.chain_at == at + i:
                    member.chain = chain
                    member.chain_at = i
        self._queue(chain, self._ranks[node.serial])

    def _withdraw(self, node: N) -> None:
        node.evictable = False
        self.num_evictable -= 1
        self._dequeue(node)
        node.chain = None

    def _leave(self, node: N) -> None:
        parent = node.parent
        if parent is not None and parent.serial == node.parent_serial:
            parent.cached_children -= 1
            if parent.cached_children == 0 and parent.evictable:
                self._activate(parent)
        self.policy.remove(node)
