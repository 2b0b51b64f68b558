"""vLLM's own `BlockPool`, told in advance which blocks to hand out: a bound on any pool.

A pool that makes a policy's decisions does two kinds of work that stock's does not: it
*decides* (ranks, keeps its bookkeeping), and vLLM does *different work* around it,
because other decisions mean other hits, other allocations and other frees. The second is
no pool's overhead: a pool that knew every decision in advance would still pay it.

`ToldBlockPool` is that pool. A first run of the policy's own pool records the blocks each
`get_new_blocks` call handed out (`record_handouts`); a stock `BlockPool` then replays the
same requests and hands out exactly those blocks, doing per block what stock's
`get_new_blocks` does (unlink from the free queue, `_maybe_evict_cached_block` where the
block holds a hash, take a reference) and nothing else: no ranking, no bookkeeping. Its
time is a floor for any pool that makes those decisions inside vLLM's pool interface; a
policy's pool time over it is what deciding costs.

Invariant: replayed on the same requests in the same order, the told pool answers every
manager call as the recorded pool did (so its hits are the recorded run's, which the
benchmark checks); `get_new_blocks` raises if asked for other than the recorded count.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator

from vllm.v1.core.block_pool import BlockPool
from vllm.v1.core.kv_cache_utils import KVCacheBlock

from kvplug.errors import KVPlugError

TOLD = "told:"  # the prefix of a benchmark arm replaying a policy's handouts


class ToldBlockPool(BlockPool):
    """A stock `BlockPool` handing out the recorded blocks (`tell`)."""

    _told: Iterator[list[int]]

    def tell(self, handouts: list[list[int]]) -> None:
        """From now on, the i-th `get_new_blocks` call hands out ``handouts[i]``."""
        self._told = iter(handouts)

    def get_new_blocks(self, num_blocks: int) -> list[KVCacheBlock]:
        """Stock's `get_new_blocks`, with the recorded blocks in place of the queue's
        head: each is unlinked from the free queue where it lies (what stock's
        ``popleft_n`` does at the head)."""
        ids = next(self._told, None)
        if ids is None or len(ids) != num_blocks:
            raise KVPlugError(
                f"the told pool was asked for {num_blocks} blocks where the recorded run "
                f"handed out {'none' if ids is None else len(ids)}: the replay diverged"
            )
        blocks = self.blocks
        ret = [blocks[i] for i in ids]
        queue = self.free_block_queue
        if self._reuse_watchers:
            self._notify_reuse(ret)
        collector, caching = self.metrics_collector, self.enable_caching
        for block in ret:
            prev_block, next_block = block.prev_free_block, block.next_free_block
            if prev_block is None or next_block is None:
                raise KVPlugError(f"the told pool's block {block.block_id} is not free")
            prev_block.next_free_block = next_block
            next_block.prev_free_block = prev_block
            block.prev_free_block = block.next_free_block = None
            if caching and block._block_hash is not None:  # (stock's call, where it acts)
                self._maybe_evict_cached_block(block)
            assert block.ref_cnt == 0
            block.ref_cnt += 1
            if collector:
                collector.on_block_allocated(block)
        queue.num_free_blocks -= num_blocks
        return ret


def make_told(pool: BlockPool, handouts: list[list[int]]) -> ToldBlockPool:
    """`pool` (a stock `BlockPool` nothing has used yet) as a `ToldBlockPool` replaying
    `handouts`."""
    if type(pool) is not BlockPool:
        raise TypeError(f"only vLLM's own BlockPool can be told, not {type(pool).__name__}")
    pool.__class__ = ToldBlockPool
    told: ToldBlockPool = pool  # type: ignore[assignment]
    told.tell(handouts)
    return told


def record_handouts(pool: BlockPool) -> list[list[int]]:
    """The block ids each later `get_new_blocks` call of `pool` hands out, in order (a list
    that grows as it runs)."""
    handouts: list[list[int]] = []
    handed: Callable[[int], list[KVCacheBlock]] = pool.get_new_blocks

    def get_new_blocks(num_blocks: int) -> list[KVCacheBlock]:
        blocks = handed(num_blocks)
        handouts.append([block.block_id for block in blocks])
        return blocks

    pool.get_new_blocks = get_new_blocks  # type: ignore[method-assign]
    return handouts


__all__ = ["TOLD", "ToldBlockPool", "make_told", "record_handouts"]
