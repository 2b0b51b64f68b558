"""One test per lifecycle and keying hazard of the core, each written against the public API.

Each test pins a rule whose breach would hand out state that is still in use or serve state
that must not be reused: deferred release across a fence, copy-on-write admission, extras
verification, namespace keying, invalidation, the candidate set and the cost ranking. Each
one was checked to fail on a core with that rule deliberately broken.
"""

from __future__ import annotations

import copy
import dataclasses
from dataclasses import dataclass, replace

import pytest
from hypothesis import given
from hypothesis import strategies as st

from kvplug.core.cache import KVCache
from kvplug.core.keys import BlockHasher, MMFeature, Namespace, encode_fields
from kvplug.core.pool import BlockState
from kvplug.errors import OutOfBlocksError
from kvplug.policies.base import RankedPolicy
from kvplug.policies.cost import CostPolicy


def _state(cache: KVCache, block_id: int) -> BlockState:
    return cache.pool.blocks[block_id].state


def _serve(cache: KVCache, req_id: str, prompt: list[int], **kw) -> int:
    """Add, compute the uncached rest, fence. Returns the prompt tokens served from cache."""
    cached = cache.add_request(req_id, prompt, **kw)
    cache.append(req_id, prompt[cached:])
    cache.complete_step()
    return cached


def _snapshot(cache: KVCache) -> tuple:
    return (
        copy.deepcopy(cache.metrics),
        cache.usage(),
        {r: cache.block_table(r) for r in cache.requests},
        [(b.state, b.ref_cnt, b.num_tokens) for b in cache.pool.blocks],
        cache.num_free_blocks,
        cache.num_reclaimable,
        len(cache.index),
        cache.step,
        cache.last_fence,
    )


# ---------------------------------------------------------------- 1. copy-on-write source


def test_cow_source_released_in_the_copying_step_drains_until_the_fence() -> None:
    cache = KVCache(8, 4)
    _serve(cache, "parent", list(range(10)))  # two full blocks and a tail holding 2 tokens
    cache.fork("parent", "child")
    tail = cache.block_table("parent")[-1]

    copied = cache.append("child", [100])  # the child copies the shared tail first
    (cow,) = copied.copies
    assert (cow.src, cow.num_tokens) == (tail, 2)
    step = cache.step
    cache.cancel("parent")  # its other holder lets go while the copy still reads it

    assert _state(cache, tail) is BlockState.DRAINING
    assert cache.num_free_blocks == 8 - 3 - 1
    # Everything free is handed out; the tail under copy is not among it.
    cache.add_request("other", list(range(200, 216)))
    assert tail not in cache.append("other", list(range(200, 216))).new_blocks
    assert _state(cache, tail) is BlockState.DRAINING
    cache.check_invariants()

    cache.fence(step)
    assert _state(cache, tail) is BlockState.FREE
    assert cache.num_free_blocks == 1
    cache.check_invariants()


# ---------------------------------------------------------------- 2. read-only steps


@pytest.mark.parametrize("read", ["touch", "lookup hit"])
def test_blocks_only_read_in_an_unfenced_step_are_not_recycled_at_finish(read: str) -> None:
    cache = KVCache(4, 4)
    prompt = list(range(9))  # two full blocks and a tail of one token
    _serve(cache, "warm", prompt)
    if read == "touch":
        req = "warm"
        cache.touch(req)  # the current step reads the blocks and writes nothing
        read_blocks = cache.block_table(req)
    else:
        cache.finish("warm")  # its two full blocks stay cached, its tail is freed
        req = "hit"
        assert cache.add_request(req, prompt) == 8  # a lookup hit on both full blocks
        cache.append(req, prompt[8:])  # the step reads them and writes only a new tail
        read_blocks = cache.block_table(req)[:2]
    step = cache.step
    cache.finish(req)  # before the step that read the blocks is fenced

    assert [_state(cache, b) for b in read_blocks].count(BlockState.FREE) == 0
    assert cache.num_free_blocks == 1
    assert cache.num_reclaimable == 1  # no cached block is offered for eviction yet
    assert cache.evict(len(cache.pool)) == 0
    cache.add_request("next", [500] * 8)
    assert not cache.can_append("next", 8)
    with pytest.raises(OutOfBlocksError):  # it would need a block the step still reads
        cache.append("next", [500] * 8)
    assert set(cache.append("next", [500] * 4).new_blocks).isdisjoint(read_blocks)
    cache.check_invariants()

    cache.finish("next")
    cache.fence(step)
    assert [_state(cache, b) for b in read_blocks].count(BlockState.DRAINING) == 0
    assert cache.num_reclaimable == len(cache.pool)  # at the fence, all of them come back
    cache.evict(len(cache.pool))
    assert cache.num_free_blocks == len(cache.pool)
    cache.check_invariants()


# ---------------------------------------------------------------- 3. copy-on-write admission


def test_cow_copy_is_counted_by_admission_and_a_short_append_changes_nothing() -> None:
    cache = KVCache(3, 4)
    _serve(cache, "parent", list(range(6)))  # one full block and a tail of 2 tokens
    cache.fork("parent", "child")
    assert cache.num_reclaimable == 1  # the other two blocks are held

    assert cache.blocks_needed("child", 1) == 1  # no growth, but the tail must be copied
    assert cache.blocks_needed("child", 3) == 2  # one block of growth plus the copy
    assert cache.can_append("child", 1)
    assert not cache.can_append("child", 3)
    before = _snapshot(cache)
    with pytest.raises(OutOfBlocksError):
        cache.append("child", [1, 2, 3])
    assert _snapshot(cache) == before
    cache.check_invariants()

    result = cache.append("child", [1])  # exactly the copy fits
    assert len(result.copies) == 1 and result.new_blocks == [result.copies[0].dst]
    assert cache.num_free_blocks == 0
    cache.check_invariants()


# ---------------------------------------------------------------- 4. extras verification


def test_colliding_keys_with_different_multimodal_extras_are_a_miss() -> None:
    cache = KVCache(32, 4)
    honest = cache.hasher.block_key

    def ignore_extras(parent, tokens, extras=()):
        return honest(parent, tokens)

    cache.hasher.block_key = ignore_extras  # this instance only: keys ignore the images
    prompt = [1] * 13  # three full blocks of the same placeholder token, then one more
    cat = [MMFeature("cat", offset=4, length=4)]  # the image fills the second block
    dog = [MMFeature("dog", offset=4, length=4)]
    _serve(cache, "cat", prompt, mm_features=cat)
    cache.finish("cat")
    assert len(cache.index) == 3

    # The keys really collide: the dog's chain names the very nodes the cat published.
    keys, key = [], cache.hasher.root_key(cache.resolve_namespace())
    for i in range(3):
        extras = ("dog@0",) if i == 1 else ()
        key = cache.hasher.block_key(key, prompt[4 * i : 4 * i + 4], extras)
        keys.append(key)
    assert [node.key for node in cache.match(prompt, mm_features=cat)] == keys

    assert len(cache.match(prompt, mm_features=dog)) == 1  # only the block before the image
    assert len(cache.match(prompt)) == 1
    assert _serve(cache, "dog", prompt, mm_features=dog) == 4
    assert _serve(cache, "cat again", prompt, mm_features=cat) == 12
    cache.check_invariants()


# ---------------------------------------------------------------- 5. namespace keying


def _changed_value(value):
    if isinstance(value, bool):
        return not value
    if isinstance(value, int):
        return value + 1
    if isinstance(value, str):
        return value + "-changed"
    raise TypeError(f"add a changed value for {type(value).__name__} to this test")


@pytest.mark.parametrize("algo", ["xxh3_128", "sha256"])
def test_every_namespace_field_changes_the_key_bytes(algo: str) -> None:
    hasher = BlockHasher(algo)
    base = Namespace(model="m", revision="r", tokenizer="t", adapter="a", tenant="x", block_size=16)
    base_key = hasher.root_key(base)
    fields = dataclasses.fields(Namespace)
    assert len(fields) >= 9
    keys = {base_key}
    for f in fields:
        variant = replace(base, **{f.name: _changed_value(getattr(base, f.name))})
        key = hasher.root_key(variant)
        assert key != base_key, f"Namespace.{f.name} does not change the key"
        assert hasher.block_key(key, [1, 2]) != hasher.block_key(base_key, [1, 2]), f.name
        keys.add(key)
    assert len(keys) == len(fields) + 1  # and no two changes give the same key


# ---------------------------------------------------------------- 6. invalidation


def test_invalidate_drops_exactly_what_a_lookup_in_that_namespace_finds() -> None:
    cache = KVCache(32, 4)
    old = Namespace(model="m", revision="r1")
    new = replace(old, revision="r2")
    prompt = list(range(13))  # three full blocks
    _serve(cache, "old", prompt, namespace=old)
    _serve(cache, "new", prompt, namespace=new)
    _serve(cache, "new2", prompt[:8] + [99, 98, 97, 96, 0], namespace=new)
    for req in ("old", "new", "new2"):
        cache.finish(req)
    assert len(cache.match(prompt, namespace=old)) == 3
    assert len(cache.index) == 3 + 4

    assert cache.invalidate(old) == 3
    assert cache.match(prompt, namespace=old) == []
    assert len(cache.index) == 4
    assert len(cache.match(prompt, namespace=new)) == 3  # the other namespace is untouched
    assert len(cache.match(prompt[:8] + [99, 98, 97, 96, 0], namespace=new)) == 3
    assert _serve(cache, "old again", prompt, namespace=old) == 0
    assert cache.metrics.invalidations == 3
    cache.check_invariants()


# ---------------------------------------------------------------- 7. candidates are leaves


class _ShallowestFirst(RankedPolicy):
    """Ranks every block by its depth: a parent, if it were ever offered, would go first."""

    name = "shallowest-first"

    def rank(self, node) -> float:
        return float(node.depth)


@pytest.mark.parametrize("policy", ["shallowest-first", "lru", "lfu", "gdsf", "cost"])
def test_a_parent_with_cached_children_is_never_evicted(policy: str) -> None:
    cache = KVCache(16, 2, policy=_ShallowestFirst() if policy == "shallowest-first" else policy)
    shared = [1, 2]
    left, right = [*shared, 3, 4, 0], [*shared, 5, 6, 0]
    _serve(cache, "left", left)
    _serve(cache, "right", right)  # hits the shared first block
    cache.finish("left")
    cache.finish("right")
    assert len(cache.index) == 3

    assert cache.evict(1) == 1
    cache.check_invariants()
    assert len(cache.index) == 2
    assert len(cache.match([*shared, 9])) == 1  # the parent is still there
    assert sorted(len(cache.match(p)) for p in (left, right)) == [1, 2]  # and one child

    assert cache.evict(1) == 1  # the other child
    cache.check_invariants()
    assert len(cache.match([*shared, 9])) == 1
    assert cache.evict(1) == 1  # only now the parent, a leaf at last
    assert len(cache.index) == 0 and cache.match(left) == []
    cache.check_invariants()


# ---------------------------------------------------------------- 8. cost ranks depth


@dataclass(eq=False)
class _Node:
    """What the cost policy reads of an index node."""

    serial: int
    key: bytes
    depth: int
    hits: int = 0
    from_end: int = 0
    request_hit: bool = False
    request_output: int = 0
    request_session: bool = False

    def __hash__(self) -> int:
        return self.serial


@pytest.mark.parametrize("hits", [0, 1, 5])
def test_cost_ranks_a_deeper_block_above_a_shallower_one_of_the_same_class(hits: int) -> None:
    policy = CostPolicy(tokens_per_block=2048)
    policy.bind(16, 1000)
    nodes = [
        _Node(depth, f"block-{depth}".encode(), depth, hits, 2, True, 100)
        for depth in (0, 1, 4, 16, 64)
    ]
    classes = {policy.classify(node) for node in nodes}
    assert len(classes) == 1  # one reuse class: only the depth differs
    ranks = [policy.rank(node) for node in nodes]
    assert ranks == sorted(ranks) and len(set(ranks)) == len(ranks), ranks

    for node in reversed(nodes):  # released deepest first, so order alone favours depth
        policy.release(node)
        policy.add_candidate(node)
    assert [n.depth for n in policy.choose_victims(len(nodes))] == [0, 1, 4, 16, 64]


# -- 9. namespace encoding is unambiguous -------------------------------------------------


def test_namespaces_that_only_differ_in_where_a_separator_falls_get_different_keys() -> None:
    """A field may contain any character (a tenant comes from the client): moving a
    character from one field to the next must change the key."""
    hasher = BlockHasher()
    a, b = Namespace(model="m\x1fr"), Namespace(model="m", revision="r\x1f")
    assert hasher.root_key(a) != hasher.root_key(b)
    assert hasher.block_key(b"p", [1], ("x\x1fy",)) != hasher.block_key(b"p", [1], ("x", "y"))


@given(
    st.lists(st.text(max_size=6), max_size=4),
    st.lists(st.text(max_size=6), max_size=4),
)
def test_encode_fields_is_injective(first: list[str], second: list[str]) -> None:
    assert (encode_fields(first) == encode_fields(second)) == (first == second)
