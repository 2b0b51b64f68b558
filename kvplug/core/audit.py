"""Audits of a `KVCache`: the invariants its module doc states, and its usage gauges.

Both read everything (O(total blocks + index + tables)); neither changes anything. Tests
call `check_invariants` after every operation; `usage` is the gauges a report shows.
"""

from __future__ import annotations

from collections import Counter
from typing import TYPE_CHECKING

from kvplug.core.metrics import Usage
from kvplug.core.pool import Block, BlockState

if TYPE_CHECKING:
    from kvplug.core.cache import KVCache


def usage(cache: KVCache) -> Usage:
    """Tokens, slots, tail waste and table entries of the live requests; blocks by state."""
    held: dict[int, Block] = {}
    logical = entries = 0
    for req in cache.requests.values():
        logical += len(req.tokens)
        entries += len(req.table)
        for block in req.table:
            held[block.block_id] = block
    slots = len(held) * cache.block_size
    filled = sum(block.num_tokens for block in held.values())
    states = Counter(block.state for block in cache.blocks_of_group())
    return Usage(
        logical_tokens=logical,
        physical_token_slots=slots,
        tail_waste=slots - filled,
        block_table_entries=entries,
        blocks_by_state={state.value: states.get(state, 0) for state in BlockState},
        cached_blocks=len(cache.index),
    )


def check_invariants(cache: KVCache) -> None:
    """Raise AssertionError naming the first breach of `kvplug.core.cache`'s invariants."""
    tables = _check_tables(cache)
    _check_blocks(cache, tables)
    _check_index(cache)


def _check_tables(cache: KVCache) -> Counter[int]:
    """Each table's length, fill and chain; returns how many tables hold each block."""
    size = cache.block_size
    tables: Counter[int] = Counter()
    for req in cache.requests.values():
        assert len(req.table) == -(-len(req.tokens) // size), req.req_id
        assert len(req.keys) == len(req.tokens) // size, req.req_id
        for i, block in enumerate(req.table):
            tables[block.block_id] += 1
            assert block.state is not BlockState.FREE, f"{req.req_id} holds free block"
            full = (i + 1) * size <= len(req.tokens)
            expected = size if full else len(req.tokens) - i * size
            assert block.num_tokens == expected, (req.req_id, i, block)
            if block.node is not None:  # the table holds the block's whole index chain
                assert block.node.depth == i and block.node.key == req.keys[i]
                parent = block.node.parent
                assert parent is not None
                assert (parent.block is None) if i == 0 else (parent.block is req.table[i - 1])
    holds: Counter[int] = Counter()
    for retention in cache.retention.live.values():  # a retention holds as a table does
        holds.update(retention.blocks)
        for block_id in retention.blocks:
            assert cache.pool.blocks[block_id].state is not BlockState.FREE, retention
    assert holds == cache.retention_holds, "retention holds out of step with the book"
    tables.update(holds)
    cache.retention.check_invariants()
    return tables


def _check_blocks(cache: KVCache, tables: Counter[int]) -> None:
    """Every block's state against the free queue, the index, the tables and the fences."""
    clock = cache.clock
    free_ids = cache.pool.free_ids()
    indexed = {node.block.block_id for node in cache.index.nodes() if node.block is not None}
    evictable = candidates = 0
    for block in cache.blocks_of_group():
        n_tables = tables[block.block_id]
        in_index = block.node is not None
        busy = clock.busy(block)
        assert in_index == (block.block_id in indexed), block
        assert block.ref_cnt == n_tables + in_index, (block, n_tables)
        assert (block.state is BlockState.FREE) == (block.block_id in free_ids), block
        assert block.pinned == (block.state is BlockState.EVICTABLE and busy), block
        full = block.num_tokens == cache.block_size
        state = block.state
        if state is BlockState.FREE:
            assert not busy, block
        elif state is BlockState.WRITING:
            assert n_tables and not in_index and (not full or block.write_step > clock.last_fence)
        elif state is BlockState.SEALED:
            assert n_tables and not in_index and full and block.write_step <= clock.last_fence
        elif state is BlockState.PUBLISHED:
            assert n_tables and in_index, block
        elif state is BlockState.EVICTABLE:
            assert not n_tables and in_index, block
            node = block.node
            assert node is not None and node.evictable == (not block.pinned), block
            if node.evictable:
                evictable += 1
                candidates += node.is_leaf
        else:  # DRAINING
            assert not n_tables and not in_index and busy, block
    assert evictable == cache.prefix.num_evictable, (evictable, cache.prefix.num_evictable)
    assert candidates == len(cache.prefix.eviction), (candidates, len(cache.prefix.eviction))


def _check_index(cache: KVCache) -> None:
    """The index is prefix-closed, its blocks are cached, the eviction core's child
    counts are the index's, and its protection levels are on indexed nodes only."""
    cache.prefix.eviction.check_protection(list(cache.index.nodes()))
    for node in cache.index.nodes():
        block = node.block
        assert block is not None and block.node is node
        assert block.state in (BlockState.PUBLISHED, BlockState.EVICTABLE)
        assert node.parent is not None and node.parent.children.get(node.key) is node
        assert len(node.tokens) == cache.block_size
        assert node.cached_children == len(node.children), node
        assert node.evictable == (block.state is BlockState.EVICTABLE and not block.pinned)
