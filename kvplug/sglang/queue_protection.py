"""Waiting-queue protection inside SGLang: the requests SGLang matched while they waited
claim the nodes they will hit.

SGLang matches a request against the radix tree before it admits it: each scheduling
step, every waiting request where the tree core matches cheaply (its Rust core, under
its default first-come-first-served policy), or, on its Python core, the requests the
admission loop reaches (all of the first 128 under a cache-aware policy). kvplug's cache
notes each match of a request (the device nodes of the matched path, the tree core's
``last_matched``), in the order SGLang first matched the requests, which is their queue
order under first-come-first-served. Before each eviction (`evict_for_alloc`) the first
`depth` of those requests that still wait (no tree lock: SGLang locks a request's path
when it admits it) claim their paths, by the engine-neutral rule of
`kvplug.core.queue_protection`: a claimed node is evicted only when no unclaimed
candidate is left. A request leaves the record when it finishes.

Full-attention models only: a sliding-window or Mamba component ranks its own state,
which a claim does not reach, so a hybrid model refuses the setting at start-up
(`refusal_for`).
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

from kvplug.core.queue_protection import QueueProtection
from kvplug.sglang.tree_core import NodeRecord


def refusal_for(depth: int, full_attention_only: bool) -> str | None:
    """Why a cache cannot protect `depth` waiting requests' paths, or None if it can."""
    if depth and not full_attention_only:
        return (
            f"kvplug config: queue_protection.requests = {depth} is served by "
            "--radix-cache-backend kvplug on full-attention models only (a sliding-window "
            "or Mamba component ranks its own state); set it to 0"
        )
    return None


class _CurrentCore:
    """The tree core's eviction core as it is now (a reset builds a new one)."""

    def __init__(self, cache: Any) -> None:
        self.cache = cache

    def protect_n(self, nodes: list[NodeRecord], levels: list[int]) -> None:
        self.cache.tree_core.eviction.protect_n(nodes, levels)


class TreeQueueProtection:
    """`QueueProtection` of one SGLang cache, fed by its matches (see the module doc)."""

    def __init__(self, cache: Any, depth: int) -> None:
        self.cache = cache
        self.protection: QueueProtection[NodeRecord] = QueueProtection(depth, _CurrentCore(cache))
        self._matched: dict[str, tuple[Any, list[NodeRecord]]] = {}  # rid -> (req, path)

    def matched(self, req: Any, path: list[NodeRecord]) -> None:
        """SGLang matched `req` (its device path, root first), waiting or being admitted;
        a request keeps its place from its first match."""
        self._matched[req.rid] = (req, path)

    def forget(self, req: Any) -> None:
        """`req` finished: it waits no more."""
        self._matched.pop(req.rid, None)

    def protected_pages(self) -> int:
        """The pages of the nodes claimed now."""
        return sum(record.blocks for record in self.protection.live)

    def refresh(self) -> None:
        """Claim the paths of the first waiting requests matched (before an eviction)."""
        if self._matched or self.protection.live:
            self.protection.refresh(self._claims())

    def _claims(self) -> Iterator[list[NodeRecord]]:
        holds = self.cache.tree_core.holds
        for req, path in list(self._matched.values()):
            if req.finished():
                self.forget(req)
                continue
            if req.lock is not None:  # admitted: its path is locked
                continue
            yield [record for record in path if holds(record)]
