"""Prefix keys for SGLang's radix nodes: a prefix's key at each of its pages, wherever the
nodes that hold it begin and end.

A radix node spans many pages and its boundaries move: a match splits a node, a partial
eviction splits a victim, and a prefix evicted as one node comes back inside a longer one.
kvplug's policies remember what they learn by key (a victim's ghost, `learned`'s sample),
so a node's key is its prefix's key at its last token: the same tokens under the same
namespace (SGLang's extra key and cache salt) give the same key however the tree splits
them, and the key of every page a new node holds is at hand to recognise a victim coming
back inside it (`CostPolicy.ghosts_inside`).

A prefix is hashed in chunks of `chunk_tokens` tokens at fixed positions from the root
(a multiple of the page size): its *state* at a chunk boundary is the xxh3 digest of the
chunk's tokens seeded with the state at the boundary before (at the root: the
namespace's), and its key at any token is the digest of the tokens since the last
boundary (its *tail*) seeded with the state there. A node keeps the state and tail at its
end, from which its children continue; a new node hashes only its own tokens, one chunk
at a time. The keys identify what the policies learn, never what SGLang reuses: SGLang
matches tokens itself.
"""

from __future__ import annotations

from bisect import bisect_left, bisect_right, insort
from collections import deque
from functools import lru_cache
from typing import Any, NamedTuple

import xxhash

from kvplug.core.keys import encode_fields

CHUNK_TOKENS = 64  # about: the chunk is the smallest multiple of the page size from here

_digest = xxhash.xxh3_64_intdigest
_key = xxhash.xxh3_64_digest


def chunk_tokens(page_size: int) -> int:
    """The chunk, in tokens, for a tree of `page_size`-token pages."""
    return page_size * -(-CHUNK_TOKENS // page_size)


@lru_cache(maxsize=1024)
def namespace_state(extra_key: str | None, cache_salt: str | None) -> int:
    """The state a prefix begins at in SGLang's namespace of `extra_key` and `cache_salt`."""
    return _digest(encode_fields((extra_key or "", cache_salt or "")))


class Prefix(NamedTuple):
    """A prefix's hash where it ends: the `state` at its last chunk boundary and the
    bytes of its tokens since (`tail`)."""

    state: int
    tail: bytes

    @property
    def key(self) -> bytes:
        return _key(self.tail, self.state)


def root_prefix(extra_key: str | None, cache_salt: str | None) -> Prefix:
    """The empty prefix of a namespace."""
    return Prefix(namespace_state(extra_key, cache_salt), b"")


def extend(prefix: Prefix, tokens: Any, chunk: int) -> Prefix:
    """`prefix` followed by `tokens` (an array with ``tobytes`` and ``itemsize``)."""
    data = prefix.tail + tokens.tobytes()
    size = chunk * tokens.itemsize
    full = len(data) - len(data) % size
    state = prefix.state
    for at in range(0, full, size):
        state = _digest(data[at : at + size], state)
    return Prefix(state, data[full:])


class VictimEnds:
    """Where recent victims ended: each one's end (its token count from the root) and last
    token. A new node looks up the keys of its pages only where one ended with the token
    it holds there (`inside`): the ends in its span are found by bisection, and the token
    sorts out most other prefixes of the same length. Keeps the last `capacity` victims
    (one the policy has forgotten meanwhile is looked up for nothing)."""

    def __init__(self, capacity: int) -> None:
        self.capacity = max(capacity, 1)
        self.ends: list[int] = []  # the distinct ends, ascending
        self.marks: dict[tuple[int, int], int] = {}  # (end, last token) -> victims
        self._per_end: dict[int, int] = {}  # end -> victims
        self._order: deque[tuple[int, int]] = deque()

    def add(self, end: int, last_token: int) -> None:
        mark = (end, int(last_token))
        self.marks[mark] = self.marks.get(mark, 0) + 1
        if end in self._per_end:
            self._per_end[end] += 1
        else:
            self._per_end[end] = 1
            insort(self.ends, end)
        self._order.append(mark)
        if len(self._order) > self.capacity:
            self._drop(self._order.popleft())

    def _drop(self, mark: tuple[int, int]) -> None:
        left = self.marks[mark] - 1
        if left:
            self.marks[mark] = left
        else:
            del self.marks[mark]
        end = mark[0]
        left = self._per_end[end] - 1
        if left:
            self._per_end[end] = left
        else:
            del self._per_end[end]
            del self.ends[bisect_left(self.ends, end)]

    def inside(self, start: int, tokens: Any) -> list[int]:
        """The positions in ``(start, start + len(tokens))`` where a victim ended with the
        token `tokens` (from `start` on) holds there, ascending."""
        ends = self.ends
        first = bisect_right(ends, start)
        last = bisect_left(ends, start + len(tokens), first)
        if first == last:
            return []
        marks = self.marks
        return [p for p in ends[first:last] if (p, int(tokens[p - start - 1])) in marks]


def node_prefix(
    before: Prefix,
    start: int,
    tokens: Any,
    page_size: int,
    ends: VictimEnds | None = None,
) -> tuple[Prefix, list[bytes]]:
    """A node holding `tokens` from token count `start` on, its prefix continuing from
    `before`: its prefix at its end, and (with `ends`) the keys at the page boundaries
    inside it where a recent victim ended (`VictimEnds.inside`)."""
    chunk = chunk_tokens(page_size)
    after = extend(before, tokens, chunk)
    if ends is None:
        return after, []
    inside = [p for p in ends.inside(start, tokens) if p % page_size == 0]
    return after, [extend(before, tokens[: p - start], chunk).key for p in inside]
