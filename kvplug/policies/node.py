"""What a policy may read about a cached block: the `CachedNode` contract.

Every cache kvplug drives hands its policies objects with these fields: kvplug's own
prefix-index `kvplug.core.index.Node`, and the per-block record of vLLM's pool
(`kvplug.vllm.block_pool.CachedBlock`). A policy reads them and never writes them; it
keeps what it learns in its own tables, keyed by `serial`.
"""

from __future__ import annotations

from typing import Protocol


class CachedNode(Protocol):
    """One cached block as a policy sees it."""

    serial: int  # unique while the block holds this content; never reused
    key: bytes | object  # the block's prefix key (stable across evictions of the content)
    depth: int  # the block's position in its sequence: 0 for the first block
    hits: int  # lookups that reused it since it was cached
    from_end: int  # at its last release: blocks of the releasing request after it
    request_hit: bool  # at its last release: whether that request reused the cache
    request_output: int  # at its last release: tokens that request generated
    request_session: bool  # at its last release: whether that request named a session
    # another tier (a CPU offload, LMCache) holds a copy of its KV, so evicting it costs a
    # reload, not a recompute; set by the adapter through `EvictionCore.held_elsewhere`
    held_elsewhere: bool


class SpanningNode(CachedNode, Protocol):
    """A node of an engine whose nodes each hold several blocks (SGLang's radix node spans
    many pages): a policy told so (``spans_blocks``) also reads `blocks`."""

    blocks: int  # the blocks it holds (at least 1)
