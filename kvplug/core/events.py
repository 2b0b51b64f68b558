"""KV events: what a cache tells the outside world about its reusable blocks.

These mirror vLLM's ``BlockStored`` / ``BlockRemoved`` KV events (the ones llm-d's
prefix-cache scorer and Dynamo's KV router consume): a block became visible to prefix
lookups, or stopped being so. A subscriber that applies them in order holds exactly the
set of keys the cache's prefix index holds.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from kvplug.core.keys import BlockKey


@dataclass(frozen=True, slots=True)
class BlockStored:
    """`key` entered the prefix index under `parent_key` (None: the first block)."""

    key: BlockKey
    parent_key: BlockKey | None
    num_tokens: int


@dataclass(frozen=True, slots=True)
class BlockRemoved:
    """`key` left the prefix index (evicted or invalidated)."""

    key: BlockKey


KVEvent = BlockStored | BlockRemoved
EventSink = Callable[[KVEvent], None]
