"""The prefix index: a radix tree over block keys, one tree per namespace.

Each edge is one full block, so the tree is page-aligned. A child is found by its key
and then verified: its token ids and extras must equal the query's, or the match stops.
The index holds one reference on each node's block. It is prefix-closed (every node's
parent is in the index) because nodes are only added under a node that is present and
only removed while they are leaves; `remove_subtree` removes descendants first.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass, field
from itertools import count
from typing import TYPE_CHECKING

from kvplug.core.keys import BlockKey, Namespace

if TYPE_CHECKING:
    from kvplug.core.pool import Block


@dataclass(slots=True, eq=False)
class Node:
    """One cached block (or, with ``block=None``, the root of a namespace).

    It satisfies the policies' `CachedNode` contract and the eviction core's `TreeNode`.
    """

    serial: int
    key: BlockKey
    tokens: tuple[int, ...]
    extras: tuple[str, ...]
    parent: Node | None
    block: Block | None
    depth: int  # the block's position in its sequence: 0 for the first block, -1 for roots
    hits: int = 0  # lookups that reused it
    from_end: int = 0  # at its last release: blocks of the releasing request after it
    request_hit: bool = False  # at its last release: whether that request reused cache
    request_output: int = 0  # at its last release: tokens that request generated
    request_session: bool = False  # at its last release: whether that request named a session
    held_elsewhere: bool = False  # another tier holds a copy of its KV
    children: dict[BlockKey, Node] = field(default_factory=dict, repr=False)
    # kept by the eviction core (`kvplug.core.eviction.TreeNode`)
    parent_serial: int = -1
    cached_children: int = 0
    evictable: bool = False

    @property
    def is_leaf(self) -> bool:
        return not self.children

    @property
    def prefix_tokens(self) -> int:
        """Tokens up to and including this block."""
        return (self.depth + 1) * len(self.tokens)

    def __hash__(self) -> int:
        return self.serial


class PrefixIndex:
    def __init__(self) -> None:
        self.roots: dict[Namespace, Node] = {}
        self._root_namespace: dict[int, Namespace] = {}  # root serial -> its namespace
        self._serials = count()
        self._size = 0

    def __len__(self) -> int:
        """Number of cached blocks (roots excluded)."""
        return self._size

    def root(self, namespace: Namespace, root_key: BlockKey, create: bool = False) -> Node | None:
        root = self.roots.get(namespace)
        if root is None and create:
            root = Node(next(self._serials), root_key, (), (), None, None, -1)
            self.roots[namespace] = root
            self._root_namespace[root.serial] = namespace
        return root

    def discard_root_if_empty(self, namespace: Namespace) -> None:
        root = self.roots.get(namespace)
        if root is not None and not root.children:
            del self.roots[namespace]
            del self._root_namespace[root.serial]

    @staticmethod
    def child(
        parent: Node, key: BlockKey, tokens: tuple[int, ...], extras: tuple[str, ...]
    ) -> Node | None:
        """The child of `parent` holding exactly these tokens and extras, or None."""
        node = parent.children.get(key)
        if node is None or node.tokens != tokens or node.extras != extras:
            return None
        return node

    def insert(
        self,
        parent: Node,
        key: BlockKey,
        tokens: tuple[int, ...],
        extras: tuple[str, ...],
        block: Block,
    ) -> Node:
        assert key not in parent.children, "insert over an existing key"
        node = Node(next(self._serials), key, tokens, extras, parent, block, parent.depth + 1)
        parent.children[key] = node
        self._size += 1
        return node

    def remove(self, node: Node) -> None:
        """Remove a leaf. A root left without children is dropped too."""
        assert node.is_leaf and node.parent is not None, "only leaves are removed"
        parent = node.parent
        del parent.children[node.key]
        node.parent = None
        self._size -= 1
        if parent.parent is None and not parent.children:
            del self.roots[self._root_namespace.pop(parent.serial)]

    def walk(self, root: Node) -> Iterator[Node]:
        """Every node below `root`, children before their parent."""
        stack: list[tuple[Node, bool]] = [(child, False) for child in root.children.values()]
        while stack:
            node, expanded = stack.pop()
            if expanded or node.is_leaf:
                yield node
            else:
                stack.append((node, True))
                stack.extend((child, False) for child in node.children.values())

    def nodes(self) -> Iterator[Node]:
        for root in list(self.roots.values()):
            yield from self.walk(root)
