"""The prefix cache: namespaced block keys, the prefix index, and eviction.

`PrefixCache` answers "which cached blocks serve this prompt", takes newly written blocks
into the index (if the policy admits them), and names the next victim. It owns the
index's nodes and the eviction core; the blocks' states and reference counts belong to
`kvplug.core.cache.KVCache`, which calls it.

Invariants (audited by `kvplug.core.audit`):

- the index is prefix-closed: a node's parent is in the index (or is its namespace root);
- a node is in the eviction core's tree exactly while it is in the index, linked to its
  index parent, so the policy's candidates are exactly the evictable index leaves;
- every entry and exit is published to the event sink, in order.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence

from kvplug.core.events import BlockRemoved, BlockStored, EventSink
from kvplug.core.eviction import EvictionCore
from kvplug.core.index import Node, PrefixIndex
from kvplug.core.keys import BlockHasher, BlockKey, MMFeature, Namespace, block_extras
from kvplug.core.metrics import CacheMetrics
from kvplug.core.pool import Block
from kvplug.policies import EvictionPolicy


class PrefixCache:
    """The index, its keys and its eviction order for one cache group."""

    def __init__(
        self,
        policy: EvictionPolicy,
        block_size: int,
        hash_algo: str,
        metrics: CacheMetrics,
        *,
        enabled: bool = True,
        event_sink: EventSink | None = None,
    ) -> None:
        self.block_size = block_size
        self.enabled = enabled
        self.policy = policy
        self.hasher = BlockHasher(hash_algo)
        self.index = PrefixIndex()
        self.eviction: EvictionCore[Node] = EvictionCore(policy)
        self.metrics = metrics
        self.event_sink = event_sink

    @property
    def num_evictable(self) -> int:
        """Cached blocks held by nobody that the policy may evict."""
        return self.eviction.num_evictable

    # ------------------------------------------------------------------ keys

    def root_key(self, namespace: Namespace) -> BlockKey:
        return self.hasher.root_key(namespace)

    def block_key(
        self, parent: BlockKey, tokens: Sequence[int], features: tuple[MMFeature, ...], start: int
    ) -> BlockKey:
        """The key of the block holding `tokens`, which start at position `start`."""
        extras = block_extras(features, start, start + self.block_size)
        return self.hasher.block_key(parent, tokens, extras)

    # ------------------------------------------------------------------ lookups

    def lookup(
        self, prompt: Sequence[int], namespace: Namespace, features: tuple[MMFeature, ...]
    ) -> tuple[list[Node], list[BlockKey]]:
        """The indexed blocks serving the longest cached prefix of `prompt` (never its last
        token), and their keys. Changes nothing."""
        nodes: list[Node] = []
        keys: list[BlockKey] = []
        node = self.index.roots.get(namespace) if self.enabled else None
        if node is None:
            return nodes, keys
        size = self.block_size
        key = node.key
        for start in range(0, (len(prompt) - 1) // size * size, size):
            tokens = tuple(prompt[start : start + size])
            extras = block_extras(features, start, start + size)
            key = self.hasher.block_key(key, tokens, extras)
            child = self.index.child(node, key, tokens, extras)
            if child is None:
                break
            node = child
            nodes.append(node)
            keys.append(key)
        return nodes, keys

    def nodes(self, namespace: Namespace | None = None) -> list[Node]:
        """Every indexed node (or one namespace's), children before their parents."""
        if namespace is None:
            roots = list(self.index.roots.values())
        else:
            root = self.index.roots.get(namespace)
            roots = [root] if root is not None else []
        return [node for root in roots for node in self.index.walk(root)]

    # ------------------------------------------------------------------ changes

    def publish(
        self,
        namespace: Namespace,
        root_key: BlockKey,
        parent: Node | None,
        key: BlockKey,
        tokens: tuple[int, ...],
        extras: tuple[str, ...],
        block: Block,
    ) -> Node | None:
        """Index `block` below `parent` (None: the namespace's first block).

        Returns its node, or None when the same content is indexed already or the policy
        does not admit it (counted in ``metrics.rejected``)."""
        under = parent or self.index.root(namespace, root_key, create=True)
        assert under is not None
        if key in under.children:  # the same content was published first by another request
            return None
        candidate = Node(-1, key, tokens, extras, under, block, under.depth + 1)
        if not self.policy.admit(candidate):
            self.metrics.rejected += 1
            self.index.discard_root_if_empty(namespace)
            return None
        node = self.index.insert(under, key, tokens, extras, block)
        self.eviction.insert(node, under)
        self.metrics.published += 1
        if self.event_sink is not None:
            parent_key = parent.key if parent is not None else None
            self.event_sink(BlockStored(key, parent_key, len(tokens)))
        return node

    def hit(self, node: Node) -> None:
        """A new request takes `node` (a lookup hit); it is no longer evictable."""
        self.eviction.reclaim(node)
        self.eviction.hit(node)

    def offer(self, node: Node) -> None:
        """Nobody holds `node` and no step can touch it: the policy may evict it."""
        self.eviction.release(node)

    def next_victim(self) -> Node | None:
        return self.eviction.next_victim()

    def unindex(self, node: Node) -> None:
        """Take a leaf out of the index and the eviction core."""
        self.eviction.remove(node)
        self.index.remove(node)
        if self.event_sink is not None:
            self.event_sink(BlockRemoved(node.key))

    def __iter__(self) -> Iterator[Node]:
        return self.index.nodes()
