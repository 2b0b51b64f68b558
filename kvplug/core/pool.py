"""Physical blocks, their lifecycle states and the free queue.

Lifecycle of a block (`BlockState`)::

    FREE -> WRITING -> SEALED -> PUBLISHED <-> EVICTABLE -> FREE
                \\         \\          \
                 +---------+----------+-> DRAINING -> FREE (or EVICTABLE, once sealed)

- FREE: in the free queue; nothing refers to it.
- WRITING: held by one or more block tables; partly filled, or full while the step
  that writes it has not been fenced yet. Never visible to lookups.
- SEALED: full and written, held by tables, not in the prefix index (caching is off,
  admission said no, the same content was published first by another request, or the
  block was invalidated while held).
- PUBLISHED: in the prefix index and held by at least one table.
- EVICTABLE: in the prefix index, held by no table. Reusable by lookups; the eviction
  policy may free it once no in-flight step can still touch it.
- DRAINING: held by no table and not in the index, but a step that read or wrote it has
  not been fenced: it returns to the pool (or, if it was a full block whose write was in
  flight, is published) only at that fence.

Reference count: ``ref_cnt == (number of block tables holding the block) + (1 if it is
in the prefix index)``. It never goes negative; a block is FREE exactly when it is in
the free queue, and then its reference count is 0.

The pool knows nothing of requests or the index: `kvplug.core.cache.KVCache` drives the
transitions; the pool only hands out and takes back blocks in O(1).
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field
from enum import StrEnum
from typing import TYPE_CHECKING

from kvplug.errors import ConfigError, KVPlugError, OutOfBlocksError

if TYPE_CHECKING:
    from kvplug.core.index import Node


class BlockState(StrEnum):
    FREE = "free"
    WRITING = "writing"
    SEALED = "sealed"
    PUBLISHED = "published"
    EVICTABLE = "evictable"
    DRAINING = "draining"


@dataclass(slots=True, eq=False)
class Block:
    """One physical page of `block_size` token slots."""

    block_id: int
    state: BlockState = BlockState.FREE
    ref_cnt: int = 0
    num_tokens: int = 0  # slots filled
    group: int = 0
    node: Node | None = field(default=None, repr=False)  # its prefix-index node, if published
    write_step: int = 0  # step of the last write into it
    busy_until: int = 0  # last step in which a since-released holder could read it
    released_at_fence: int = -1  # last fence when its holders let go, until reusable; else -1
    pinned: bool = False  # EVICTABLE but not yet offered to the policy (awaiting a fence)


class BlockPool:
    """A fixed set of equal-sized blocks and a FIFO queue of the free ones."""

    def __init__(self, num_blocks: int, page_bytes: int = 0) -> None:
        if not isinstance(num_blocks, int) or num_blocks < 1:
            raise ConfigError(f"num_blocks must be an integer >= 1, got {num_blocks!r}")
        self.page_bytes = page_bytes
        self.blocks = [Block(block_id=i) for i in range(num_blocks)]
        self._free: deque[Block] = deque(self.blocks)
        self.allocations = 0
        self.frees = 0

    def __len__(self) -> int:
        return len(self.blocks)

    @property
    def num_free(self) -> int:
        return len(self._free)

    def allocate(self, group: int = 0) -> Block:
        """Take the oldest free block; it comes back WRITING with one reference."""
        if not self._free:
            raise OutOfBlocksError(f"all {len(self.blocks)} blocks are in use")
        block = self._free.popleft()
        block.state = BlockState.WRITING
        block.ref_cnt = 1
        block.num_tokens = 0
        block.group = group
        block.write_step = block.busy_until = 0
        block.released_at_fence = -1
        self.allocations += 1
        return block

    def free(self, block: Block) -> None:
        """Return `block` to the pool. It must have no references left."""
        if block.state is BlockState.FREE:
            raise KVPlugError(f"double free of block {block.block_id}")
        if block.ref_cnt != 0 or block.node is not None:
            raise KVPlugError(
                f"block {block.block_id} still has {block.ref_cnt} references; cannot free it"
            )
        block.state = BlockState.FREE
        block.num_tokens = 0
        block.pinned = False
        self._free.append(block)
        self.frees += 1

    def free_ids(self) -> set[int]:
        """Ids in the free queue (for audits; O(n))."""
        return {block.block_id for block in self._free}
