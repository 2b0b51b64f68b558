"""The hybrid vllm-stock arm: vLLM's own hybrid KV-cache coordinator behind the arm interface.

Every expected hit below is worked out by hand from vLLM 0.32's rules (see the module
docstring of `kvplug.replay.arms.vllm_hybrid`). Prompts are passed sequential style (a fresh
sentinel unit after the prompt, ``compute = len(prompt)``) unless a test says realistic
(no sentinel: vLLM's ``max_cache_hit_length = num_tokens - 1`` then keeps the last unit
out of every hit).
"""

from __future__ import annotations

from collections import Counter
from dataclasses import replace

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

pytest.importorskip("vllm", reason="vLLM is not installed (pip install 'kvplug[vllm]')")

from kvplug.core.groups import GroupKind  # noqa: E402
from kvplug.hybrid.spec import HYBRID_PRESETS  # noqa: E402
from kvplug.policies import make_policy  # noqa: E402
from kvplug.replay.arms.base import FRESH_UNIT_BASE, ArmStats  # noqa: E402
from kvplug.replay.arms.vllm_hybrid import MAMBA_CACHE_MODE, VLLMHybridArm  # noqa: E402

F = FRESH_UNIT_BASE
BLOCK_TOKENS = 512
GEMMA = HYBRID_PRESETS["gemma3-like"]  # 5 sliding-window groups (window 2 units), 1 full
NEMOTRON = HYBRID_PRESETS["nemotron-h-like"]  # 6 Mamba groups, 1 full
A = list(range(10))

ARMS = ["stock", "cost"]  # vllm-stock, and vllm-kvplug:cost (kvplug's pool)


def make_arm(spec, pages: int, arm: str = "stock") -> VLLMHybridArm:
    policy = None if arm == "stock" else make_policy(arm)
    return VLLMHybridArm(spec, pages * spec.page_bytes(BLOCK_TOKENS), BLOCK_TOKENS, policy)


def own_hits(arm: VLLMHybridArm, prompt: list[int]) -> list[int]:
    """Each group's own hit for `prompt`, looked up without admitting it."""
    from vllm.v1.request import Request

    request = Request("probe", prompt, arm._sampling_params, None, block_hasher=arm._block_hasher)
    return arm.group_own_hits(request)


def held_blocks(arm: VLLMHybridArm, req_id: int) -> list[int]:
    """Per group, the non-null blocks request `req_id` holds."""
    blocks = arm.manager.coordinator.get_blocks(str(req_id))
    return [sum(not block.is_null for block in group) for group in blocks]


def test_groups_map_to_vllm_specs():
    from vllm.v1.core.kv_cache_coordinator import HybridKVCacheCoordinator
    from vllm.v1.kv_cache_interface import FullAttentionSpec, MambaSpec, SlidingWindowSpec

    gemma = make_arm(GEMMA, 7)
    assert gemma.name == "vllm-stock"
    assert isinstance(gemma.manager.coordinator, HybridKVCacheCoordinator)
    assert gemma.manager.kv_cache_config.num_blocks == 8  # 7 pages + the null block
    specs = [g.kv_cache_spec for g in gemma.manager.kv_cache_config.kv_cache_groups]
    assert [type(s) for s in specs] == [SlidingWindowSpec] * 5 + [FullAttentionSpec]
    # window 1024 tokens = 2 units of 512; vLLM needs cdiv(sliding_window - 1, 1) blocks
    assert {s.sliding_window for s in specs[:5]} == {3}
    assert {s.block_size for s in specs} == {1}

    nemotron = make_arm(NEMOTRON, 7, "cost")
    assert nemotron.name == "vllm-kvplug:cost"
    groups = nemotron.manager.kv_cache_config.kv_cache_groups
    assert [type(g.kv_cache_spec) for g in groups] == [MambaSpec] * 6 + [FullAttentionSpec]
    assert MAMBA_CACHE_MODE == "align"
    assert {g.kv_cache_spec.mamba_cache_mode for g in groups[:6]} == {"align"}
    names = [name for g in groups for name in g.layer_names]
    assert len(names) == len(set(names)) == 28
    assert nemotron.group_hits == {"mamba": 0, "full_attention": 0}


def test_a_full_attention_spec_runs_on_the_unitary_coordinator():
    from vllm.v1.core.kv_cache_coordinator import UnitaryKVCacheCoordinator

    arm = make_arm(GEMMA.full_attention_equivalent(), 30)
    assert isinstance(arm.manager.coordinator, UnitaryKVCacheCoordinator)
    assert arm.admit(0, [*A, F], 10) == 0
    arm.finish(0)
    assert arm.admit(1, [*A[:6], 99, F + 1], 7) == 6
    assert arm.group_hits == {"full_attention": 6}


def test_capacity_must_hold_a_block():
    page = GEMMA.page_bytes(BLOCK_TOKENS)
    assert make_arm(GEMMA, 1).capacity_blocks == 1
    assert VLLMHybridArm(GEMMA, 2 * page - 1, BLOCK_TOKENS).capacity_blocks == 1
    with pytest.raises(ValueError, match="holds no block"):
        VLLMHybridArm(GEMMA, page - 1, BLOCK_TOKENS)


@pytest.mark.parametrize("kind", ARMS)
def test_gemma_junction_after_the_window_slid(kind):
    """A ran 10 units and one decode unit: each sliding-window group freed its blocks 0-7
    (outside the 2-unit window) while A ran, but freed blocks keep their hash. B shares
    A's first 8 units: the full group holds all 8, and every sliding-window group still
    has blocks 6 and 7, the window before position 8. Nothing was evicted (the pool has
    room), so the junction is 8."""
    arm = make_arm(GEMMA, 200, kind)
    assert arm.admit(0, [*A, F], 10) == 0
    assert held_blocks(arm, 0) == [10] * 6
    assert arm.grow(0, [F + 1])
    # The sliding-window groups keep units 8, 9 and the new one; the full group all 11.
    assert held_blocks(arm, 0) == [3] * 5 + [11]
    arm.finish(0)

    b = [*A[:8], 100, 101, F + 2]
    assert own_hits(arm, b) == [8] * 6
    assert arm.admit(1, b, 10) == 8
    assert arm.group_hits == {"sliding_window": 8, "full_attention": 8}
    assert arm.stats().evictions == 0
    arm.finish(1)
    # 10 units for A and for B's two new ones, plus the decode unit, in all 6 groups.
    assert arm.stats().cached_blocks == 6 * (10 + 1 + 2)
    assert arm.bytes_held() == arm.stats().cached_blocks * GEMMA.page_bytes(BLOCK_TOKENS)


def test_gemma_evicted_window_block_shortens_the_junction():
    """A pool of 61 blocks: A takes 60 (10 units x 6 groups). Its decode step first frees
    the sliding-window blocks outside the window (group by group, each from block 7 down to
    0, into the free queue's tail), then takes 6 blocks: the last fresh one and the 5
    oldest freed, group 0's blocks 7, 6, 5, 4 and 3. For B (A's first 8 units) group 0 can
    serve only 3 units (blocks 1 and 2 before position 3); the other groups 8. The
    coordinator settles on the shortest."""
    arm = make_arm(GEMMA, 61)
    assert arm.admit(0, [*A, F], 10) == 0
    assert arm.grow(0, [F + 1])
    assert arm.stats() == ArmStats(evictions=5, churn=5, cached_blocks=61)
    arm.finish(0)

    b = [*A[:8], 100, 101, F + 2]
    assert own_hits(arm, b) == [3, 8, 8, 8, 8, 8]
    assert arm.admit(1, b, 10) == 3
    assert arm.group_hits == {"sliding_window": 3, "full_attention": 8}


def test_gemma_kvplug_pool_runs_the_eviction_case():
    """The same sequence with kvplug's pool and the cost policy: it evicts other blocks,
    and the junction is still the shortest group's hit."""
    arm = make_arm(GEMMA, 61, "cost")
    assert arm.admit(0, [*A, F], 10) == 0
    assert arm.grow(0, [F + 1])
    assert arm.stats().evictions == 5
    arm.finish(0)
    b = [*A[:8], 100, 101, F + 2]
    own = own_hits(arm, b)
    hit = arm.admit(1, b, 10)
    assert hit == min(own)
    assert arm.group_hits["full_attention"] >= hit and arm.group_hits["sliding_window"] >= hit
    arm.manager.block_pool.check_invariants()


@pytest.mark.parametrize("kind", ARMS)
def test_nemotron_partial_prefix_gets_no_mamba_hit(kind):
    """Align mode caches a Mamba state only where a step ended. A's prefill ended at 10
    (sequential style: one step), so B, sharing A's first 8 units, finds a full-attention
    hit of 8 and no Mamba state: the junction is 0. vLLM marks 8 as the shared-prefix
    boundary and splits B's prefill there, caching B's state at 8; C, sharing those 8
    units again, then hits 8."""
    arm = make_arm(NEMOTRON, 200, kind)
    assert arm.admit(0, [*A, F], 10) == 0
    arm.finish(0)

    b = [*A[:8], 100, 101, F + 1]
    assert own_hits(arm, b) == [0] * 6 + [8]
    assert arm.admit(1, b, 10) == 0
    assert arm.group_hits == {"mamba": 0, "full_attention": 8}
    assert arm._requests[1].shared_prefix_boundary == 8
    arm.finish(1)

    c = [*A[:8], 300, F + 2]
    assert own_hits(arm, c) == [8] * 7
    assert arm.admit(2, c, 9) == 8
    assert arm.group_hits == {"mamba": 8, "full_attention": 16}
    if kind != "stock":
        arm.manager.block_pool.check_invariants()


@pytest.mark.parametrize("kind", ARMS)
def test_nemotron_repeat_and_extension(kind):
    """Block size 1 unit (512 tokens): the Mamba state at the end of A's prefill serves a
    repeat of A and a prompt extending A, whole."""
    arm = make_arm(NEMOTRON, 200, kind)
    assert arm.admit(0, [*A, F], 10) == 0
    arm.finish(0)
    assert arm.admit(1, [*A, F + 1], 10) == 10  # repeat: a full hit
    arm.finish(1)
    assert arm.admit(2, [*A, 50, 51, F + 2], 12) == 10  # extension: all of A
    arm.finish(2)
    assert arm.group_hits == {"mamba": 20, "full_attention": 20}


@pytest.mark.parametrize("kind", ARMS)
def test_nemotron_realistic_repeat_hits_all_but_the_last_unit(kind):
    """Realistic style (no sentinel): vLLM recomputes the last prompt unit, so a repeat can
    hit at most 9 of 10. The scheduler's align-mode split ends A's first prefill step at
    unit 9 (`get_mamba_prefill_checkpoint_position`: the last block boundary before
    ``num_tokens - 1``), so a state is cached there and the repeat gets its 9 units; an
    extension gets all 10 from the state at A's end. The issue's claim that align mode
    misses prompts shorter than the forced block size holds here only in the sense that
    the block is one unit: a one-unit prompt has nothing to hit (it recomputes its only
    unit), a two-unit prompt hits one."""
    arm = make_arm(NEMOTRON, 200, kind)
    assert arm.admit(0, A, 10) == 0
    assert held_blocks(arm, 0) == [2] * 6 + [10]  # states at 9 and 10; all 10 KV blocks
    arm.finish(0)
    assert arm.admit(1, A, 10) == 9
    arm.finish(1)
    assert arm.admit(2, [*A, 50], 11) == 10
    arm.finish(2)

    assert arm.admit(3, [70], 1) == 0
    arm.finish(3)
    assert arm.admit(4, [70], 1) == 0
    arm.finish(4)
    assert arm.admit(5, [80, 81], 2) == 0
    arm.finish(5)
    assert arm.admit(6, [80, 81], 2) == 1
    arm.finish(6)
    # Sequential style, a one-unit prompt is served whole: its state at 1 is cached.
    assert arm.admit(7, [90, F], 1) == 0
    arm.finish(7)
    assert arm.admit(8, [90, F + 1], 1) == 1


def test_nemotron_refused_admit_changes_nothing():
    """A realistic-style prefill runs in two steps (9 units, then 1); the first step is
    refused unless the second one's blocks (1 full + 6 Mamba) are left free too."""
    arm = make_arm(NEMOTRON, 22)
    pool = arm.manager.block_pool
    # First step: 9 full-attention blocks + 1 per Mamba group = 15; second: 1 + 6 = 7.
    assert arm.admit(0, [*A[:5], 200, 201, 202, 203, 204], 10) is not None
    arm.finish(0)
    big = [*range(100, 110)]
    assert arm.admit(1, [1000, F], 1) == 0  # holds 7 blocks: 15 left
    before = (pool.get_num_free_blocks(), arm.stats())
    assert arm.admit(2, big, 10) is None  # needs 15 + 7
    assert (pool.get_num_free_blocks(), arm.stats()) == before
    arm.finish(1)
    assert arm.admit(2, big, 10) == 0  # 22 free now


@pytest.mark.parametrize("spec", [GEMMA, NEMOTRON], ids=lambda s: s.name)
def test_smoke_replay_on_the_bundled_trace(spec):
    """A realistic replay of the bundled trace's first requests through both arms."""
    from kvplug.replay.loop import make_jobs, replay
    from kvplug.replay.sources import bundled_trace_path
    from kvplug.replay.trace import read_trace

    trace = read_trace(bundled_trace_path())
    trace = replace(trace, requests=trace.requests[:120])
    unit = spec.full_attention_equivalent().kind_unit_bytes(GroupKind.FULL, trace.block_tokens)
    capacity = trace.distinct_blocks * unit // 10
    jobs = make_jobs(trace, spec)
    for kind in ARMS:
        policy = None if kind == "stock" else make_policy(kind)
        arm = VLLMHybridArm(spec, capacity, trace.block_tokens, policy)
        counters = replay(arm, jobs, trace.block_tokens)
        assert counters.requests + counters.rejected >= len(jobs)
        junction_units = counters.hit_tokens // trace.block_tokens
        assert all(hits >= junction_units for hits in arm.group_hits.values())
        assert arm.stats().cached_blocks <= arm.capacity_blocks
        if policy is not None:
            arm.manager.block_pool.check_invariants()


# ---------------------------------------------------------------- one decision across groups


def test_kvplug_pool_knows_each_groups_kind():
    gemma = make_arm(GEMMA, 61, "cost").manager.block_pool
    assert gemma.group_kinds == {
        **{i: GroupKind.SLIDING_WINDOW for i in range(5)},
        5: GroupKind.FULL,
    }
    nemotron = make_arm(NEMOTRON, 61, "cost").manager.block_pool
    assert sorted(nemotron.group_kinds.values()).count(GroupKind.MAMBA) == 6
    full = make_arm(GEMMA.full_attention_equivalent(), 61, "cost").manager.block_pool
    assert full.group_kinds == {}  # one kind: nothing spans groups


def test_an_unmapped_group_spec_falls_back_with_one_warning(caplog):
    from types import SimpleNamespace

    from vllm.v1.kv_cache_interface import FullAttentionSpec, SlidingWindowSpec

    from kvplug.vllm.kv_cache_manager import group_kinds

    class ChunkedThing(FullAttentionSpec):  # a subclass has its own hit rule
        pass

    def group(spec_type):
        return SimpleNamespace(kv_cache_spec=object.__new__(spec_type))

    config = SimpleNamespace(
        kv_cache_groups=[group(SlidingWindowSpec), group(FullAttentionSpec), group(ChunkedThing)]
    )
    with caplog.at_level("WARNING"):
        assert group_kinds(config) == {}
    assert len(caplog.records) == 1
    assert "ChunkedThing" in caplog.text and "SlidingWindowSpec" in caplog.text


def without_anchor_rules(arm: VLLMHybridArm) -> None:
    """Give the arm's pool its policy again without the groups' windows: no anchor rules
    (every sliding-window block ranked by the policy), as before they existed."""
    from kvplug.vllm.stats import PoolStats

    pool = arm.manager.block_pool
    pool.use_policy(make_policy("cost"), PoolStats(), pool.tree_groups, pool.group_kinds)
    assert pool.rules is not None and not pool.rules.windows  # cross-group retiring only


# the hybrid rules run over either tracked pool: the record pool (records and the generic
# eviction core) and the dense pool (the dense core's arrays), chosen at build time
POOLS = {"record": ("0", "KVPlugBlockPool"), "dense": ("1", "DenseCostPool")}


@pytest.fixture(params=list(POOLS))
def ranked_arm(request, monkeypatch):
    """`make_arm` for kvplug's `cost` on the pool of this run (`POOLS`)."""
    choice, pool_type = POOLS[request.param]
    monkeypatch.setenv("KVPLUG_DENSE_CORE", choice)

    def build(spec, pages: int) -> VLLMHybridArm:
        arm = make_arm(spec, pages, "cost")
        assert type(arm.manager.block_pool).__name__ == pool_type
        return arm

    return build


def sliding_window_nodes(pool) -> list[int]:
    """The block ids of the sliding-window blocks the pool accounts for."""
    suffixes = {g.to_bytes(4, "big") for g in range(5)}
    return [
        block.block_id
        for block in pool.blocks
        if (key := pool._keys[block.block_id]) is not None and key[-4:] in suffixes
    ]


def live_nodes(pool) -> list[int]:
    return [node for node, key in enumerate(pool._keys) if key is not None]


def num_candidates(pool) -> int:
    """The policy's candidates: the record pool's policy's, or the dense core's heap."""
    return len(pool.core) if hasattr(pool, "core") else len(pool.policy)


def test_a_victim_retires_its_position_in_the_other_sliding_window_groups(ranked_arm):
    arm = ranked_arm(GEMMA, 61)
    without_anchor_rules(arm)
    assert arm.admit(0, [*A, F], 10) == 0
    arm.finish(0)  # 60 blocks of A cached, none held
    pool = arm.manager.block_pool
    nodes = pool.rules.nodes
    victim = nodes.next_victim()
    dependents = pool.rules.dependents(victim)
    key = pool._keys[victim]
    position, group = key[:-4], int.from_bytes(key[-4:], "big")
    expected = {g for g in range(5) if g != group}
    found = [pool._keys[node] for node, *_ in dependents]
    assert {int.from_bytes(k[-4:], "big") for k in found} == expected
    assert all(k[:-4] == position for k in found)
    assert all(nodes.is_evictable(node) for node, *_ in dependents)
    # a one-unit prompt takes 6 blocks (one per group), the pool has 1 fresh: 5 go, the
    # victim and then its 4 dependents, before anything the policy would rank next
    assert arm.admit(1, [500, F + 1], 1) == 0
    assert pool.stats.evictions == 5 and pool.stats.retired == len(expected)
    cached = pool.cached_block_hash_to_block
    for g in range(6):
        gone = cached.get_one_block(position + g.to_bytes(4, "big")) is None
        assert gone == (g in expected or g == group)
    assert arm.stats().evictions == pool.stats.evictions  # KV events saw every eviction
    pool.check_invariants()


@pytest.mark.parametrize("policy", ["cost", "lru"])
@pytest.mark.parametrize("spec", [GEMMA, NEMOTRON], ids=lambda s: s.name)
@settings(max_examples=25, deadline=None)
@given(
    ops=st.lists(
        st.tuples(
            st.sampled_from(["admit", "grow", "finish"]), st.integers(0, 3), st.integers(1, 6)
        ),
        max_size=30,
    ),
    pages=st.integers(20, 80),
)
def test_kvplug_pool_invariants_with_several_groups(policy, spec, ops, pages):
    """Random requests through vLLM's hybrid coordinator over kvplug's pool (ranked by
    `cost`, or vLLM's own queue with `lru`): the pool's invariants, including its count of
    cached blocks, hold after every call, every group sharing one pool, and the arm
    asserts on each admission that the junction is at most every group's own hit."""
    arm = make_arm(spec, pages, policy)
    pool = arm.manager.block_pool
    running: list[int] = []
    fresh = F + 1000
    for index, (op, family, length) in enumerate(ops):
        if op == "admit" or not running:
            fresh += 1
            prompt = [family * 100 + i for i in range(length)] + [fresh]
            if arm.admit(index, prompt, length) is not None:
                running.append(index)
        elif op == "grow":
            fresh += 1
            arm.grow(running[family % len(running)], [fresh])
        else:
            arm.finish(running.pop(family % len(running)))
        pool.check_invariants()
    for req in running:
        arm.finish(req)
    pool.check_invariants()
    assert arm.stats().evictions == pool.stats.evictions


def test_sliding_window_blocks_before_anchors_are_marked(ranked_arm):
    arm = ranked_arm(GEMMA, 200)
    pool = arm.manager.block_pool
    nodes = pool.rules.nodes
    assert pool.rules.windows == dict.fromkeys(range(5), 2)
    assert arm.admit(0, [*A, F], 10) == 0
    arm.grow(0, [900, 901, 902])
    arm.finish(0)
    # the prompt (11 units with the sentinel) ends at 11, and a resend is served at most
    # at 10; the request ends at 13 (the last unit, 902, is never computed)
    anchored = {
        (nodes.depth_of(n), pool._keys[n][-4:])
        for n in sliding_window_nodes(pool)
        if nodes.is_anchored(n)
    }
    assert {depth for depth, _ in anchored} == {8, 9, 10, 11, 12}
    assert len(anchored) == 5 * 5
    # served positions: a hit at 5 touches the window before it, 3 and 4 (request 1's
    # own prompt ends at 7 (its 700 at 5 is anchored, A[5] is not; F + 1 is not computed)
    assert arm.admit(1, [*A[:5], 700, F + 1], 6) == 5
    arm.finish(1)
    anchored = Counter(
        nodes.depth_of(n) for n in sliding_window_nodes(pool) if nodes.is_anchored(n)
    )
    assert anchored == dict.fromkeys([3, 4, 5, 8, 9, 10, 11, 12], 5)
    pool.check_invariants()


def test_unanchored_sliding_window_blocks_are_evicted_before_the_policys_choice(ranked_arm):
    arm = ranked_arm(GEMMA, 61)
    assert arm.admit(0, [*A, F], 10) == 0
    arm.finish(0)  # 60 blocks of A cached, none held, 1 fresh
    pool = arm.manager.block_pool
    nodes = pool.rules.nodes
    unanchored = [n for n in sliding_window_nodes(pool) if not nodes.is_anchored(n)]
    assert sorted({nodes.depth_of(n) for n in unanchored}) == list(range(8))
    assert all(nodes.is_evictable(n) for n in unanchored)
    # they are not the policy's to rank: its candidates are the others' leaves
    choice = nodes.next_victim()
    assert choice >= 0 and choice not in unanchored
    assert num_candidates(pool) == sum(
        nodes.is_candidate(n) for n in live_nodes(pool) if n not in unanchored
    )
    kept = [n for n in live_nodes(pool) if n not in unanchored]
    serials = {n: nodes.serial_of(n) for n in range(len(pool.blocks))}
    # a one-unit prompt takes 6 blocks, the pool has 1 fresh: 5 go, all unanchored
    # sliding-window blocks, ahead of the policy's choice and of every anchored window
    assert arm.admit(1, [500, F + 1], 1) == 0
    assert pool.stats.evictions == 5 and pool.stats.retired == 0
    assert all(nodes.serial_of(n) == serials[n] for n in kept)
    assert sum(nodes.serial_of(n) != serials[n] for n in unanchored) == 5
    assert arm.stats().evictions == pool.stats.evictions  # KV events saw every eviction
    pool.check_invariants()
    arm.finish(1)
    pool.check_invariants()


def test_pool_audit_catches_an_unanchored_window_not_queued_first(ranked_arm):
    arm = ranked_arm(GEMMA, 61)
    assert arm.admit(0, [*A, F], 10) == 0
    arm.finish(0)
    pool = arm.manager.block_pool
    pool.check_invariants()
    nodes = pool.rules.nodes
    while nodes.first_entries():  # the unanchored windows would strand (never evicted first)
        nodes.next_first(({}, False))  # (an empty copy index: no key held twice)
    with pytest.raises(AssertionError, match="not queued first"):
        pool.check_invariants()


def test_recomputed_full_attention_blocks_stay_leaves_and_go_first(ranked_arm):
    """A request served a shorter junction than its full-attention hit recomputes cached
    blocks (vLLM caches the copies too): its later blocks hang below the first copies,
    so its own copies are leaves, evicted first once released."""
    arm = ranked_arm(GEMMA, 61)
    pool = arm.manager.block_pool
    nodes = pool.rules.nodes
    assert arm.admit(0, [*A, F], 10) == 0
    arm.finish(0)
    assert arm.admit(1, [500, F + 1], 1) == 0  # evicts unanchored windows of A
    arm.finish(1)
    assert arm.admit(2, [*A[:7], 800, F + 2], 8) == 3  # full attention alone: 7
    full = (5).to_bytes(4, "big")
    full_nodes = [n for n in live_nodes(pool) if pool._keys[n][-4:] == full]
    lookup = pool.cached_block_hash_to_block.get_one_block
    firsts = {nodes.depth_of(n): n for n in full_nodes if lookup(pool._keys[n]).block_id == n}
    copies = [n for n in full_nodes if lookup(pool._keys[n]).block_id != n]
    assert sorted(nodes.depth_of(n) for n in copies) == [3, 4, 5, 6]
    assert all(nodes.cached_children(n) == 0 for n in copies)
    own = next(n for n in full_nodes if nodes.depth_of(n) == 7 and n != firsts[7])  # its 800
    assert nodes.live_parent(own) == firsts[6]
    assert nodes.cached_children(firsts[6]) == 2
    pool.check_invariants()
    arm.finish(2)
    queued = {n for n, serial, _ in nodes.first_entries() if nodes.serial_of(n) == serial}
    assert all(n in queued for n in copies)
    assert not any(n in queued for n in firsts.values())
    pool.check_invariants()
