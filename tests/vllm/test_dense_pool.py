"""The dense pool makes the record pool's decisions, compiled and as plain Python.

`kvplug.vllm.dense_pool.DenseCostPool` serves `cost` over `kvplug.core.dense`, typed
arrays by block id, where `KVPlugBlockPool` keeps a record per block and the generic
eviction core. These tests drive vLLM's real KV cache manager over three pools on the
same random operations: the record pool, the dense pool on the dense core (`cost`'s or
`learned`'s) as built here (compiled where a compiler was found at install), and the
dense pool on the dense core's source run as plain Python. After every step all three
must hold the same keys on the same blocks (so every eviction chose the same victim),
count the same statistics, and have learned the same (inflation, trials and reuses per
class, ghost history, and `learned`'s referee and shadows).
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from contextlib import contextmanager
from itertools import count
from types import SimpleNamespace

import pytest

pytest.importorskip("vllm", reason="vLLM is not installed (pip install 'kvplug[vllm]')")

from dense_plain import plain_dense_module  # noqa: E402
from hypothesis import given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402
from vllm.v1.core.block_pool import BlockPool  # noqa: E402
from vllm.v1.core.kv_cache_utils import BlockHash  # noqa: E402

import kvplug.core.dense  # noqa: E402
from kvplug.core.groups import GroupKind  # noqa: E402
from kvplug.errors import ConfigError  # noqa: E402
from kvplug.hybrid.spec import HYBRID_PRESETS  # noqa: E402
from kvplug.policies import make_policy  # noqa: E402
from kvplug.policies.cost import CostPolicy  # noqa: E402
from kvplug.policies.learned import LearnedPolicy  # noqa: E402
from kvplug.replay.arms.base import FRESH_UNIT_BASE  # noqa: E402
from kvplug.replay.arms.vllm import VLLMStockArm  # noqa: E402
from kvplug.replay.arms.vllm_hybrid import VLLMHybridArm  # noqa: E402
from kvplug.vllm import dense_pool  # noqa: E402
from kvplug.vllm.block_pool import KVPlugBlockPool, ReleaseOrderPool, pool_class  # noqa: E402
from kvplug.vllm.dense_pool import CHOICE_VARIABLE, DenseCostPool  # noqa: E402

F = FRESH_UNIT_BASE
GEMMA = HYBRID_PRESETS["gemma3-like"]  # 5 sliding-window groups, 1 full attention
NEMOTRON = HYBRID_PRESETS["nemotron-h-like"]  # Mamba groups, 1 full attention
HYBRID_BLOCK_TOKENS = 512


def _plain_python_cores() -> dict[type, type]:
    """The dense cores from the dense core's source, run by the interpreter, by the policy
    each decides for."""
    module = plain_dense_module()
    return {CostPolicy: module.DenseCostCore, LearnedPolicy: module.DenseLearnedCore}


PLAIN_CORES = _plain_python_cores()
POLICIES = {"cost": {}, "learned": {"shadow_blocks": 4, "window": 6, "margin": -1.0}}


@contextmanager
def dense_choice(value: str, cores: dict[type, type] | None = None) -> Iterator[None]:
    before = os.environ.get(CHOICE_VARIABLE)
    os.environ[CHOICE_VARIABLE] = value
    saved = dict(dense_pool.DENSE_CORES)
    if cores is not None:
        dense_pool.DENSE_CORES.update(cores)
    try:
        yield
    finally:
        dense_pool.DENSE_CORES.update(saved)
        if before is None:
            del os.environ[CHOICE_VARIABLE]
        else:
            os.environ[CHOICE_VARIABLE] = before


def three_arms(capacity: int, policy: str = "cost") -> list[VLLMStockArm]:
    params = POLICIES[policy]
    with dense_choice("0"):
        record = VLLMStockArm(capacity, make_policy(policy, params))
    with dense_choice("1"):
        built = VLLMStockArm(capacity, make_policy(policy, params))
    with dense_choice("1", PLAIN_CORES):
        plain = VLLMStockArm(capacity, make_policy(policy, params))
    assert type(record.manager.block_pool) is KVPlugBlockPool
    assert type(built.manager.block_pool) is DenseCostPool
    assert type(plain.manager.block_pool.core) in PLAIN_CORES.values()
    return [record, built, plain]


def victim_history(pool: KVPlugBlockPool) -> tuple[list, list]:
    """The ghosts (key, value) and the recent victims' keys, oldest first: the record
    policy's ghosts and the pool's record, or the dense core's one history of both."""
    if isinstance(pool, DenseCostPool):
        assert pool._evicted is pool.core.history
        return pool.core.history.ghost_items(), pool.core.history.recent_keys()
    return list(pool.policy._ghosts.items()), pool._evicted.recent_keys()


def state(arm: VLLMStockArm) -> tuple:
    pool = arm.manager.block_pool
    policy = pool.policy
    return (
        list(pool._keys),
        pool.stats,
        pool.num_cached_blocks(),
        pool.get_num_free_blocks(),
        policy.inflation,
        list(policy._tried),
        list(policy._reused),
        *victim_history(pool),
        dict(policy._classes),
        getattr(policy, "explain", dict)(),
        getattr(policy, "_mean_credit", None),
    )


admit_ops = st.tuples(
    st.just("admit"), st.integers(0, 2), st.integers(1, 8), st.lists(st.integers(0, 5), max_size=3)
)
grow_ops = st.tuples(st.just("grow"), st.integers(0, 7), st.integers(1, 3))
finish_ops = st.tuples(st.just("finish"), st.integers(0, 7), st.integers(0, 600))
evict_ops = st.tuples(st.just("evict"), st.integers(0, 40))
operations = st.lists(
    st.one_of(admit_ops, admit_ops, grow_ops, finish_ops, evict_ops), min_size=20, max_size=80
)
prefix_sets = st.lists(st.lists(st.integers(0, 5), min_size=1, max_size=8), min_size=1, max_size=3)


@pytest.mark.parametrize("policy", list(POLICIES))
@settings(max_examples=80, deadline=None)
@given(capacity=st.integers(2, 24), prefixes=prefix_sets, ops=operations)
def test_dense_pools_decide_as_the_record_pool(policy, capacity, prefixes, ops):
    arms = three_arms(capacity, policy)
    fresh = count(F)
    running: list[int] = []
    for req_id, op in enumerate(ops):
        if op[0] == "admit":
            _, which, cut, tail = op
            prompt = prefixes[which % len(prefixes)][:cut] + list(tail) + [next(fresh)]
            admitted = {arm.admit(req_id, prompt, len(prompt) - 1) is not None for arm in arms}
            assert len(admitted) == 1
            if admitted.pop():
                running.append(req_id)
        elif running and op[0] == "grow":
            units = [next(fresh) for _ in range(op[2])]
            grown = {arm.grow(running[op[1] % len(running)], units) for arm in arms}
            assert len(grown) == 1
        elif running and op[0] == "finish":
            req = running.pop(op[1] % len(running))
            for arm in arms:
                arm.finish(req, op[2])
        elif op[0] == "evict":  # a KV connector evicts a block on request (cached or not)
            for arm in arms:
                pool = arm.manager.block_pool
                block = pool.blocks[1 + op[1] % capacity]
                if block._block_hash is not None:
                    pool.evict_blocks({block.block_id})
        states = [state(arm) for arm in arms]
        assert states[1] == states[0], f"compiled dense pool differs after {op}"
        assert states[2] == states[0], f"plain-Python dense pool differs after {op}"
        for arm in arms:
            arm.manager.block_pool.check_invariants()


def three_hybrid_arms(spec, pages: int, policy: str) -> list[VLLMHybridArm]:
    """`three_arms` for a hybrid model: vLLM's hybrid coordinator over each pool."""
    params = POLICIES[policy]
    arms = []
    for choice, cores in (("0", None), ("1", None), ("1", PLAIN_CORES)):
        with dense_choice(choice, cores):
            capacity = pages * spec.page_bytes(HYBRID_BLOCK_TOKENS)
            arms.append(
                VLLMHybridArm(spec, capacity, HYBRID_BLOCK_TOKENS, make_policy(policy, params))
            )
    assert type(arms[0].manager.block_pool) is KVPlugBlockPool
    assert type(arms[1].manager.block_pool) is DenseCostPool
    assert type(arms[2].manager.block_pool.core) in PLAIN_CORES.values()
    return arms


hybrid_ops = st.lists(
    st.tuples(
        st.sampled_from(["admit", "admit", "grow", "finish"]),
        st.integers(0, 3),
        st.integers(1, 8),
        st.integers(0, 300),
    ),
    min_size=10,
    max_size=40,
)


@pytest.mark.parametrize("policy", list(POLICIES))
@pytest.mark.parametrize("spec", [GEMMA, NEMOTRON], ids=lambda spec: spec.name)
@settings(max_examples=40, deadline=None)
@given(pages=st.integers(12, 60), ops=hybrid_ops)
def test_dense_pools_decide_as_the_record_pool_for_hybrid_models(policy, spec, pages, ops):
    """The same for a hybrid model's groups sharing one pool: with a sliding-window
    group the hybrid rules (anchors, retiring, copies evicted first) run over each pool's
    state, and every pool must take the same victims and learn the same."""
    arms = three_hybrid_arms(spec, pages, policy)
    fresh = count(F)
    running: list[int] = []
    for req_id, (op, family, length, output) in enumerate(ops):
        if op == "admit" or not running:
            prompt = [family * 100 + i for i in range(length)] + [next(fresh)]
            admitted = {arm.admit(req_id, prompt, length) for arm in arms}
            assert len(admitted) == 1, f"admissions differ: {admitted}"
            if admitted.pop() is not None:
                running.append(req_id)
        elif op == "grow":
            unit = next(fresh)
            grown = {arm.grow(running[family % len(running)], [unit]) for arm in arms}
            assert len(grown) == 1
        else:
            req = running.pop(family % len(running))
            for arm in arms:
                arm.finish(req, output)
        states = [state(arm) for arm in arms]
        assert states[1] == states[0], f"compiled dense pool differs after {op}"
        assert states[2] == states[0], f"plain-Python dense pool differs after {op}"
        for arm in arms:
            arm.manager.block_pool.check_invariants()


def test_the_free_queue_walks_the_dense_pools_eviction_order():
    """What a tier walking the free queue from its head sees (vLLM's lazy offload,
    LMCache's drain) is the order the next allocations evict, in both pools."""
    arms = three_arms(6)
    for arm in arms:
        for req, prompt in enumerate([[1, 2, 3, F], [1, 2, 4, F + 1], [5, 6, F + 2]]):
            assert arm.admit(req, prompt, len(prompt) - 1) is not None
        arm.admit(10, [1, 2, 3, F + 3], 3)  # a hit on the first prefix
        for req in (0, 1, 2, 10):
            arm.finish(req, 40)
    orders = []
    for arm in arms:
        queue = arm.manager.block_pool.free_block_queue
        walked = [block.block_id for block in queue.get_all_free_blocks()]
        handed = [b.block_id for b in arm.manager.block_pool.get_new_blocks(len(walked))]
        assert walked == handed
        orders.append(walked)
    assert orders[0] == orders[1] == orders[2]


@pytest.mark.parametrize("compiled", [True, False], ids=["built", "plain"])
def test_a_prefix_hits_touch_is_vllms_touch_plus_the_hits(compiled):
    """The compiled touch (`touch_objects`) does what vLLM's own `touch` does to every
    block (the null block included, as this release treats it: a reference or none),
    takes free ones out of the free queue, and counts the hits."""
    args = {"num_gpu_blocks": 8, "enable_caching": True, "hash_block_size": 16}
    with dense_choice("1", None if compiled else PLAIN_CORES):
        pool = pool_class(make_policy("cost"))(**args, policy=make_policy("cost"))
    stock = BlockPool(**args)
    for each in (pool, stock):
        blocks = each.get_new_blocks(3)
        hashes = [BlockHash(b"k%d" % i) for i in range(3)]
        request = SimpleNamespace(block_hashes=hashes, request_id="r", lora_request=None)
        each.cache_full_blocks(request, blocks, 0, 3, 16, 0)
        each.free_blocks(reversed(blocks))
        each.touch_counts_hits = True
        each.touch([each.null_block, *blocks[:2]])
        assert [b.ref_cnt for b in blocks] == [1, 1, 0]
        assert each.get_num_free_blocks() == 8 - 1 - 2
    assert pool.null_block.ref_cnt == stock.null_block.ref_cnt
    assert pool.stats.block_hits == 2
    pool.check_invariants()


def test_pool_class_chooses_the_dense_pool_for_cost_only(monkeypatch):
    monkeypatch.setenv(CHOICE_VARIABLE, "1")
    assert pool_class(make_policy("cost")) is DenseCostPool
    assert pool_class(make_policy("cost"), {0: GroupKind.FULL, 1: GroupKind.MAMBA}) is (
        DenseCostPool
    )
    sliding = {0: GroupKind.FULL, 1: GroupKind.SLIDING_WINDOW}
    assert pool_class(make_policy("cost"), sliding) is DenseCostPool
    assert pool_class(make_policy("lfu"), sliding) is KVPlugBlockPool
    assert pool_class(make_policy("learned")) is DenseCostPool
    assert pool_class(make_policy("lfu")) is KVPlugBlockPool
    assert pool_class(make_policy("lru")) is ReleaseOrderPool
    monkeypatch.setenv(CHOICE_VARIABLE, "0")
    assert pool_class(make_policy("cost")) is KVPlugBlockPool
    monkeypatch.setenv(CHOICE_VARIABLE, "auto")
    expected = DenseCostPool if kvplug.core.dense.COMPILED else KVPlugBlockPool
    assert pool_class(make_policy("cost")) is expected


def test_a_bad_choice_is_refused_with_the_choices(monkeypatch):
    monkeypatch.setenv(CHOICE_VARIABLE, "yes")
    with pytest.raises(ConfigError, match="KVPLUG_DENSE_CORE='yes'.*auto, 0, 1"):
        pool_class(make_policy("cost"))


def test_the_dense_pool_refuses_what_it_cannot_serve():
    arm = VLLMStockArm(4, make_policy("cost"))
    pool = arm.manager.block_pool
    if not isinstance(pool, DenseCostPool):
        pytest.skip("the dense core is not compiled here")
    with pytest.raises(TypeError, match="'lfu'"):
        pool.use_policy(make_policy("lfu"), pool.stats)
