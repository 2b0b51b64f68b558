"""The cache safety matrix and the sharing / cancellation / eviction scenarios."""

from __future__ import annotations

import copy
from dataclasses import replace

import pytest

from kvplug.core.cache import Copy, KVCache
from kvplug.core.keys import HASH_ALGORITHMS, MMFeature, Namespace
from kvplug.core.pool import BlockState
from kvplug.errors import (
    CapacityError,
    ConfigError,
    DuplicateRequestError,
    FenceError,
    KVPlugError,
    OutOfBlocksError,
    UnknownPolicyError,
    UnknownRequestError,
)

BS = 16
PREFIX = [(7 * i + 3) % 1000 for i in range(512)]
PROMPT = PREFIX + [42]  # one more token, so all 512 prefix tokens may be served from cache
BASE = Namespace(model="m", revision="r1", tokenizer="t", tenant="acme")
IMAGE = MMFeature("image-1", offset=100, length=64)


def _cache(**kw) -> KVCache:
    return KVCache(256, BS, namespace=BASE, **kw)


def _run(cache: KVCache, req_id: str, prompt, **kw) -> int:
    cached = cache.add_request(req_id, prompt, **kw)
    cache.append(req_id, prompt[cached:])
    cache.complete_step()
    return cached


def _changed(pos: int) -> list[int]:
    prompt = list(PROMPT)
    prompt[pos] += 1
    return prompt


MATRIX = [
    ("identical", PROMPT, {}, 512),
    ("token at 0", _changed(0), {}, 0),
    ("token at 255", _changed(255), {}, 240),
    ("token at 511", _changed(511), {}, 496),
    ("adapter", PROMPT, {"namespace": replace(BASE, adapter="lora-7")}, 0),
    ("image feature", PROMPT, {"mm_features": [MMFeature("image-2", 100, 64)]}, 96),
    ("image moved", PROMPT, {"mm_features": [MMFeature("image-1", 101, 64)]}, 96),
    ("position scheme", PROMPT, {"namespace": replace(BASE, position_scheme="alibi")}, 0),
    ("model revision", PROMPT, {"namespace": replace(BASE, revision="r2")}, 0),
    ("tenant", PROMPT, {"namespace": replace(BASE, tenant="globex")}, 0),
    ("cache salt", PROMPT, {"namespace": replace(BASE, tenant="salt:xyz")}, 0),
    ("block layout", PROMPT, {"namespace": replace(BASE, layout="HND")}, 0),
    ("kv dtype", PROMPT, {"namespace": replace(BASE, kv_dtype="fp8_e4m3")}, 0),
    ("tokenizer", PROMPT, {"namespace": replace(BASE, tokenizer="t2")}, 0),
]


@pytest.mark.parametrize(
    ("case", "prompt", "kwargs", "reusable"), MATRIX, ids=[row[0] for row in MATRIX]
)
def test_safety_matrix(case, prompt, kwargs, reusable) -> None:
    cache = _cache()
    _run(cache, "original", PROMPT, mm_features=[IMAGE])
    cache.finish("original")
    kwargs = {"mm_features": [IMAGE], **kwargs}
    assert _run(cache, "variant", prompt, **kwargs) == reusable
    cache.check_invariants()


@pytest.mark.parametrize("shared", [False, True], ids=["separate", "shared"])
def test_cross_tenant_reuse_only_when_configured(shared: bool) -> None:
    other = replace(BASE, tenant="globex")
    cache = _cache(share_across_tenants=shared)
    _run(cache, "a", PROMPT)
    assert _run(cache, "a again", PROMPT) == 512  # the prompt is reusable within a tenant
    assert len(cache.index) == 32
    assert _run(cache, "b", PROMPT, namespace=other) == (512 if shared else 0)
    assert len(cache.match(PROMPT, namespace=other)) == 32  # b's own blocks, if not shared
    assert len(cache.index) == (32 if shared else 64)  # one copy, or one per tenant
    assert (cache.resolve_namespace(other) == cache.resolve_namespace()) is shared
    cache.check_invariants()


def test_block_size_is_part_of_the_namespace() -> None:
    published: dict[int, list] = {16: [], 32: []}
    small = KVCache(64, 16, namespace=BASE, event_sink=published[16].append)
    large = KVCache(64, 32, namespace=BASE, event_sink=published[32].append)
    ns_small, ns_large = small.resolve_namespace(), large.resolve_namespace()
    assert (ns_small.block_size, ns_large.block_size) == (16, 32)
    assert replace(ns_small, block_size=0) == replace(ns_large, block_size=0)
    assert small.hasher.root_key(ns_small) != large.hasher.root_key(ns_large)

    prompt = PREFIX[:64] + [42]
    for cache in (small, large):
        _run(cache, "a", prompt)
    # The same 64 tokens under the same namespace otherwise: no key is shared, not even
    # where a 32-token block and two 16-token blocks end on the same token.
    small_keys = [event.key for event in published[16]]
    large_keys = [event.key for event in published[32]]
    assert (len(small_keys), len(large_keys)) == (4, 2)
    assert not set(small_keys) & set(large_keys)
    # Each cache finds its own blocks, and a namespace naming another block size is
    # looked up under the cache's own.
    assert [n.key for n in small.match(prompt)] == small_keys
    assert [n.key for n in large.match(prompt)] == large_keys
    assert small.resolve_namespace(replace(BASE, block_size=32)) == ns_small
    assert [n.key for n in small.match(prompt, replace(BASE, block_size=32))] == small_keys
    assert _run(small, "b", prompt, namespace=replace(BASE, block_size=32)) == 64


@pytest.mark.parametrize("algo", sorted(HASH_ALGORITHMS))
def test_every_hash_algorithm_reuses_and_separates(algo: str) -> None:
    cache = _cache(hash_algo=algo)
    _run(cache, "a", PROMPT)
    assert _run(cache, "b", PROMPT) == 512
    assert _run(cache, "c", _changed(300)) == 288


def test_a_hash_collision_is_a_miss_not_wrong_state() -> None:
    cache = KVCache(32, 4)
    cache.hasher.block_key = lambda parent, tokens, extras=(): b"every block collides"
    _run(cache, "a", [1, 2, 3, 4, 5, 6, 7, 8, 9])
    assert _run(cache, "b", [9, 9, 9, 9, 9, 9, 9, 9, 9]) == 0
    assert _run(cache, "c", [1, 2, 3, 4, 5, 6, 7, 8, 9]) == 8
    cache.check_invariants()


# ---------------------------------------------------------------- scenarios


def test_cancel_during_write_keeps_blocks_pinned_then_publishes_full_ones() -> None:
    cache = KVCache(8, 4)
    prompt = list(range(10))  # two full blocks and a partial one
    cache.add_request("a", prompt)
    table = cache.append("a", prompt).new_blocks
    step = cache.step
    cache.cancel("a")  # the step writing these blocks is still in flight
    states = [cache.pool.blocks[b].state for b in table]
    assert states == [BlockState.DRAINING] * 3
    assert cache.match(prompt) == []  # unpublished state is never visible
    cache.add_request("b", prompt)  # must not be handed a draining block
    fresh = cache.append("b", prompt).new_blocks
    assert not set(fresh) & set(table)
    cache.check_invariants()

    cache.fence(step)
    states = [cache.pool.blocks[b].state for b in table]
    assert states == [BlockState.EVICTABLE, BlockState.EVICTABLE, BlockState.FREE]
    assert [n.block.block_id for n in cache.match(prompt)] == table[:2]
    assert cache.metrics.release_age_percentile(1.0) == 1
    cache.check_invariants()


def test_cancel_discards_when_caching_is_off() -> None:
    cache = KVCache(8, 4, enable_prefix_caching=False)
    cache.add_request("a", list(range(8)))
    table = cache.append("a", list(range(8))).new_blocks
    cache.cancel("a")
    cache.complete_step()
    assert all(cache.pool.blocks[b].state is BlockState.FREE for b in table)
    assert cache.num_free_blocks == 8


def test_deferred_release_age_counts_steps_until_the_fence() -> None:
    cache = KVCache(8, 4, enable_prefix_caching=False)
    cache.add_request("a", [1, 2, 3])
    cache.append("a", [1, 2, 3])
    first = cache.step
    cache.finish("a")  # cancelled while its step is in flight
    cache.next_step()
    cache.next_step()  # more steps are issued before the first is fenced
    assert cache.num_free_blocks == 7
    cache.fence(first)  # one step had to finish before the block could be reused
    assert cache.num_free_blocks == 8
    cache.add_request("b", [1])
    cache.append("b", [1])
    cache.complete_step()
    cache.finish("b")  # finished after its step was fenced: freed at once
    assert cache.metrics.release_ages == {1: 1, 0: 1}
    assert cache.metrics.as_dict()["release_age_max"] == 1


def test_branching_from_a_partial_block_copies_on_write() -> None:
    cache = KVCache(16, 4)
    cache.add_request("a", list(range(10)))
    cache.append("a", list(range(10)))
    cache.complete_step()
    cache.fork("a", "b")
    assert cache.block_table("a") == cache.block_table("b")
    tail = cache.block_table("a")[-1]
    result = cache.append("b", [100])
    assert result.copies == [Copy(src=tail, dst=result.new_blocks[0], num_tokens=2)]
    assert cache.block_table("b")[:2] == cache.block_table("a")[:2]
    assert cache.block_table("b")[2] != tail
    assert cache.append("a", [200]).copies == []  # the sole remaining holder writes in place
    assert cache.block_table("a")[-1] == tail
    assert cache.metrics.cow_copies == 1
    cache.complete_step()
    cache.check_invariants()
    cache.finish("a")
    cache.finish("b")
    cache.check_invariants()
    assert all(b.ref_cnt == (b.node is not None) for b in cache.pool.blocks)


def test_fork_of_full_blocks_shares_without_copying() -> None:
    cache = KVCache(16, 4)
    cache.add_request("a", list(range(8)))
    cache.append("a", list(range(8)))
    cache.fork("a", "b")
    assert cache.append("b", [1]).copies == []
    assert cache.append("a", [2]).copies == []
    assert cache.block_table("a")[:2] == cache.block_table("b")[:2]
    assert cache.pool.blocks[cache.block_table("a")[0]].ref_cnt == 2


def test_eviction_spares_live_readers() -> None:
    cache = KVCache(6, 4)
    _run(cache, "reader", list(range(9)))  # holds 3 blocks, 2 published
    _run(cache, "gone", list(range(100, 109)))
    cache.finish("gone")  # 2 evictable, 1 free
    reader_blocks = cache.block_table("reader")
    cache.add_request("new", list(range(200, 212)))
    cache.append("new", list(range(200, 212)))  # needs 3: 1 free + both evictable
    assert cache.metrics.evictions == 2
    assert cache.block_table("reader") == reader_blocks
    with pytest.raises(OutOfBlocksError):
        cache.append("new", [1])
    cache.check_invariants()


def test_invalidate_hides_entries_but_frees_only_when_readers_finish() -> None:
    cache = KVCache(8, 4)
    prompt = list(range(9))
    _run(cache, "reader", prompt)
    held = cache.block_table("reader")
    assert cache.invalidate() == 2
    assert cache.match(prompt) == []
    assert [cache.pool.blocks[b].state for b in held] == [BlockState.SEALED] * 2 + [
        BlockState.WRITING
    ]
    cache.append("reader", [1, 2, 3])
    cache.complete_step()
    cache.finish("reader")
    assert cache.num_free_blocks == 8
    cache.check_invariants()


def test_lru_evicts_least_recently_released_tail_first() -> None:
    cache = KVCache(6, 2)
    _run(cache, "old", [1, 2, 3, 4, 5])  # blocks [1,2] [3,4] + partial
    _run(cache, "new", [6, 7, 8, 9, 0])
    old, new = cache.block_table("old"), cache.block_table("new")
    cache.finish("old")
    cache.finish("new")
    victims = [node.block.block_id for node in cache.policy.choose_victims(4)]
    # Only leaves are candidates: each chain's tail, oldest release first.
    assert victims == [old[1], new[1]]
    assert cache.evict(4) == 4
    assert cache.num_free_blocks == 6


def test_a_hit_moves_blocks_to_the_back_of_the_lru_order() -> None:
    cache = KVCache(16, 2)
    _run(cache, "a", [1, 2, 3])
    _run(cache, "b", [5, 6, 7])
    cache.finish("a")
    cache.finish("b")
    _run(cache, "a2", [1, 2, 9])
    cache.finish("a2")
    assert [n.tokens for n in cache.policy.choose_victims(3)] == [(5, 6), (1, 2)]


# ---------------------------------------------------------------- bad input


def _snapshot(cache: KVCache):
    return (
        copy.deepcopy(cache.metrics),
        cache.usage(),
        {r: cache.block_table(r) for r in cache.requests},
        [(b.state, b.ref_cnt, b.num_tokens) for b in cache.pool.blocks],
        (cache.num_free_blocks, cache.num_reclaimable, len(cache.index)),
        cache.step,
        cache.last_fence,
    )


@pytest.mark.parametrize("size", [0, -1, 1.5, True])
def test_block_size_must_be_a_positive_integer(size) -> None:
    with pytest.raises(ConfigError, match="block_size"):
        KVCache(8, size)


def test_num_blocks_must_be_positive() -> None:
    with pytest.raises(ConfigError, match="num_blocks"):
        KVCache(0, 16)


def test_unknown_policy_lists_known_ones() -> None:
    with pytest.raises(UnknownPolicyError, match="known policies: .*lru"):
        KVCache(8, 16, policy="fifo")


def test_unknown_hash_algorithm() -> None:
    with pytest.raises(ConfigError, match="sha256"):
        KVCache(8, 16, hash_algo="md5")


def test_bad_input_leaves_the_cache_unchanged() -> None:
    cache = KVCache(4, 4, max_model_len=12)
    _run(cache, "a", list(range(9)))
    cache.finish("a")
    _run(cache, "b", list(range(10)))
    cache.add_request("c", [5] * 12)  # admitted, but its 3 blocks will not fit (1 is free)
    before = _snapshot(cache)
    assert before[0].requests == 3 and before[0].matched_tokens == 8

    with pytest.raises(CapacityError, match="limit of 12"):  # appending past the table
        cache.append("b", [1, 2, 3])
    with pytest.raises(UnknownRequestError, match="'zzz'"):
        cache.finish("zzz")
    with pytest.raises(UnknownRequestError):
        cache.append("zzz", [1])
    with pytest.raises(UnknownRequestError):
        cache.touch("zzz")
    with pytest.raises(UnknownRequestError):
        cache.fork("zzz", "y")
    with pytest.raises(DuplicateRequestError):
        cache.fork("b", "c")
    with pytest.raises(DuplicateRequestError):
        cache.add_request("b", list(range(10)))
    with pytest.raises(FenceError, match="older"):
        cache.fence(cache.last_fence - 1)
    with pytest.raises(FenceError, match="not issued"):
        cache.fence(cache.step + 5)
    assert cache.blocks_needed("c", 12) == 3 and not cache.can_append("c", 12)
    with pytest.raises(OutOfBlocksError, match="need"):
        cache.append("c", [5] * 12)
    with pytest.raises(KVPlugError, match="empty prompt"):
        cache.add_request("d", [])
    with pytest.raises(CapacityError):
        cache.add_request("e", list(range(13)))

    assert _snapshot(cache) == before  # metrics, gauges, tables, blocks, step and fence
    cache.check_invariants()
    cache.finish("c")
    cache.check_invariants()


def test_double_free_is_refused() -> None:
    cache = KVCache(4, 4)
    cache.add_request("a", [1, 2])
    (block_id,) = cache.append("a", [1, 2]).new_blocks
    cache.complete_step()
    cache.finish("a")
    with pytest.raises(UnknownRequestError, match="already finished"):
        cache.finish("a")
    block = cache.pool.blocks[block_id]
    assert block.state is BlockState.FREE  # really allocated, then freed by the finish
    assert cache.metrics.allocations == cache.metrics.frees == 1
    before = _snapshot(cache)
    with pytest.raises(KVPlugError, match=f"double free of block {block_id}"):
        cache.pool.free(block)
    assert _snapshot(cache) == before
    assert cache.num_free_blocks == 4  # it is in the free queue once, not twice
    cache.check_invariants()
    got = []
    for i in range(4):
        cache.add_request(i, [i])
        got += cache.append(i, [i]).new_blocks
    assert sorted(got) == [0, 1, 2, 3]
    with pytest.raises(OutOfBlocksError):
        cache.add_request(9, [9])
        cache.append(9, [9])


# ---------------------------------------------------------------- gauges and groups


def test_usage_counts_logical_tokens_physical_slots_and_tail_waste() -> None:
    cache = KVCache(16, 4)
    cache.add_request("a", list(range(10)))
    cache.append("a", list(range(10)))
    cache.fork("a", "b")  # shares all three blocks
    usage = cache.usage()
    assert usage.logical_tokens == 20
    assert usage.physical_token_slots == 12
    assert usage.tail_waste == 2
    assert usage.block_table_entries == 6


def test_groups_share_one_pool_of_equal_pages() -> None:
    from kvplug.core.groups import CacheGroupSpec, GroupKind
    from kvplug.core.pool import BlockPool

    full = CacheGroupSpec(GroupKind.FULL, block_size=16, bytes_per_token=64)
    window = CacheGroupSpec(GroupKind.SLIDING_WINDOW, 16, 64, sliding_window=128)
    pool = BlockPool(8, page_bytes=full.page_bytes)
    a = KVCache(0, 16, pool=pool, group=0, spec=full)
    b = KVCache(0, 16, pool=pool, group=1, spec=window)
    a.add_request("x", [1] * 40)
    a.append("x", [1] * 40)
    b.add_request("x", [1] * 40)
    b.append("x", [1] * 40)
    assert pool.num_free == 2
    assert {pool.blocks[i].group for i in b.block_table("x")} == {1}
    a.check_invariants()
    b.check_invariants()
    with pytest.raises(ConfigError, match="page size"):
        KVCache(0, 16, pool=pool, spec=CacheGroupSpec(block_size=16, bytes_per_token=32))
