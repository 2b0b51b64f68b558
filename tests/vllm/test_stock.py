"""The vllm-stock arm: vLLM's own KV-cache manager behind the replay's arm interface.

The property test runs the same random admit / grow / finish sequences through vLLM's
`KVCacheManager` and through kvplug's cache with its `lru` policy; kvplug's LRU claims to
reproduce vLLM's eviction order, so every answer and every counter must agree.
"""

from __future__ import annotations

import subprocess
import sys
from itertools import count

import pytest

pytest.importorskip("vllm", reason="vLLM is not installed (pip install 'kvplug[vllm]')")

from hypothesis import example, given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

from kvplug.policies import make_policy  # noqa: E402
from kvplug.replay.arms.base import (  # noqa: E402
    FRESH_UNIT_BASE,
    ArmStats,
    ArmUnavailable,
    CacheArm,
    KVPlugArm,
)
from kvplug.replay.arms.vllm import SUPPORTED_VLLM_VERSIONS, VLLMStockArm  # noqa: E402

F = FRESH_UNIT_BASE

# Operations, interpreted by `replay_both`:
#   ("admit", prefix, cut, tail): prompt = prefixes[prefix][:cut] + tail, plus a fresh
#       sentinel, computed sequential-replay style (compute = len(prompt) - 1);
#   ("grow", pick, n): n fresh decode units for running request number `pick`;
#   ("finish", pick): finish running request number `pick`.
# `prefix` and `pick` are taken modulo the number of choices.
admit_ops = st.tuples(
    st.just("admit"),
    st.integers(0, 2),
    st.integers(1, 8),
    st.lists(st.integers(0, 5), max_size=3),
)
grow_ops = st.tuples(st.just("grow"), st.integers(0, 7), st.integers(1, 3))
finish_ops = st.tuples(st.just("finish"), st.integers(0, 7))
# At least 20 operations, so that the pool fills with cached blocks and allocations evict.
operations = st.lists(
    st.one_of(admit_ops, admit_ops, grow_ops, finish_ops), min_size=20, max_size=60
)
prefix_sets = st.lists(st.lists(st.integers(0, 5), min_size=1, max_size=8), min_size=1, max_size=3)


def replay_both(
    capacity: int, prefixes: list[list[int]], ops: list[tuple], lru: CacheArm | None = None
) -> None:
    """Apply `ops` to an lru arm (kvplug's core cache unless given) and to the vLLM arm;
    fail at the first difference."""
    lru = lru or KVPlugArm("lru", make_policy("lru"), capacity)
    stock = VLLMStockArm(capacity)
    fresh = count(F)
    running: list[int] = []
    trace: list[str] = [f"capacity {capacity}"]
    for req_id, op in enumerate(ops):
        if op[0] == "admit":
            _, which, cut, tail = op
            prompt = prefixes[which % len(prefixes)][:cut] + list(tail) + [next(fresh)]
            compute = len(prompt) - 1
            got = (lru.admit(req_id, prompt, compute), stock.admit(req_id, prompt, compute))
            trace.append(f"admit({req_id}, {prompt}) -> lru {got[0]}, vllm {got[1]}")
            if got[0] is not None:
                running.append(req_id)
        elif not running:
            continue
        elif op[0] == "grow":
            target = running[op[1] % len(running)]
            units = [next(fresh) for _ in range(op[2])]
            got = (lru.grow(target, units), stock.grow(target, units))
            trace.append(f"grow({target}, {len(units)} units) -> lru {got[0]}, vllm {got[1]}")
        else:
            target = running.pop(op[1] % len(running))
            lru.finish(target)
            stock.finish(target)
            got = (None, None)
            trace.append(f"finish({target})")
        history = "\n  ".join(trace)
        assert got[0] == got[1], f"answers differ:\n  {history}"
        assert lru.stats() == stock.stats(), (
            f"stats differ: lru {lru.stats()}, vllm {stock.stats()}:\n  {history}"
        )


@settings(max_examples=200, deadline=None)
@example(  # two evictions in one allocation: vLLM takes (1, 2) then its parent (1)
    capacity=3,
    prefixes=[[1, 2], [3], [4, 5]],
    ops=[
        ("admit", 0, 2, []),
        ("finish", 0),
        ("admit", 1, 1, []),
        ("finish", 0),
        ("admit", 2, 2, []),
        ("admit", 0, 1, []),
    ],
)
@given(capacity=st.integers(2, 32), prefixes=prefix_sets, ops=operations)
def test_lru_matches_vllm_hit_for_hit(capacity, prefixes, ops):
    replay_both(capacity, prefixes, ops)


@settings(max_examples=200, deadline=None)
@given(capacity=st.integers(2, 32), prefixes=prefix_sets, ops=operations)
def test_kvplug_pool_with_lru_matches_vllm_hit_for_hit(capacity, prefixes, ops):
    """vLLM's manager with kvplug's block pool (``--scheduler-cls kvplug.vllm.Scheduler``)
    and the lru policy evicts exactly what vLLM's own pool evicts."""
    replay_both(capacity, prefixes, ops, lru=VLLMStockArm(capacity, make_policy("lru")))


def test_shared_prefix_eviction_and_full_hit():
    arm = VLLMStockArm(4)
    assert arm.admit(0, [1, 2, 3, F], 3) == 0
    assert arm.admit(1, [1, 2, 7, F + 1], 3) == 2  # shares (1), (1, 2)
    assert arm.stats() == ArmStats(evictions=0, churn=0, cached_blocks=4)
    arm.finish(0)
    arm.finish(1)  # least recently released first: (1,2,3), then (1,2,7), (1,2), (1)

    assert arm.admit(2, [9, F + 2], 1) == 0  # the pool is full: evicts (1, 2, 3)
    assert arm.stats() == ArmStats(evictions=1, churn=1, cached_blocks=4)
    assert arm.admit(3, [1, 2, 3, F + 3], 3) == 2  # (1,2,3) is gone; evicts (1,2,7)
    assert arm.stats() == ArmStats(evictions=2, churn=2, cached_blocks=4)
    arm.finish(3)

    # Sequential style: with the sentinel, a fully cached prompt is served whole.
    assert arm.admit(4, [1, 2, 3, F + 4], 3) == 3
    arm.finish(2)
    # Without it vLLM recomputes the last token although it is cached, taking the block of
    # (9), and caches the copy under the same hash: three hashes remain.
    assert arm.admit(5, [1, 2, 3], 3) == 2
    assert arm.stats() == ArmStats(evictions=3, churn=3, cached_blocks=3)


def test_refused_admit_and_grow_change_nothing():
    arm = VLLMStockArm(4)
    assert arm.admit(0, [1, 2, F], 2) == 0
    pool = arm.manager.block_pool
    before = (pool.get_num_free_blocks(), arm.stats())

    assert arm.admit(1, [3, 4, 5, F + 1], 3) is None  # 3 blocks needed, 2 free
    assert arm.grow(0, [F + 2, F + 3, F + 4]) is False
    assert (pool.get_num_free_blocks(), arm.stats()) == before

    # Request 0 grows on from where it was, without the refused units: its decode blocks
    # are hashed over 1, 2, F (the sentinel stands in the sequence), F+5.
    assert arm.grow(0, [F + 5]) is True
    assert arm.grow(0, [F + 6]) is True
    arm.finish(0)
    assert arm.admit(2, [1, 2, F, F + 5, F + 7], 4) == 4
    assert arm.admit(1, [3, 4, 5, F + 1], 3) is None  # request 2 holds all 4 blocks


def test_unavailable_with_another_vllm_version(monkeypatch):
    import vllm

    monkeypatch.setattr(vllm, "__version__", "0.31.0")
    with pytest.raises(
        ArmUnavailable, match=r"supports vLLM 0\.32\.0 or .*0\.34\.0 only.*0\.31\.0"
    ):
        VLLMStockArm(4)
    assert SUPPORTED_VLLM_VERSIONS == ("0.32.0", "0.33.0", "0.34.0")


def test_unavailable_without_vllm(monkeypatch):
    monkeypatch.setitem(sys.modules, "vllm", None)  # makes `import vllm` raise ImportError
    with pytest.raises(ArmUnavailable, match="not importable"):
        VLLMStockArm(4)


def test_module_imports_without_vllm():
    code = (
        "import sys; sys.modules['vllm'] = None; "
        "import kvplug.replay.arms.vllm as m; "
        "print(m.VLLMStockArm.name)"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "vllm-stock"


@pytest.mark.parametrize("sequential", [True, False], ids=["sequential", "realistic"])
def test_lru_matches_vllm_on_the_bundled_trace(sequential: bool) -> None:
    """The whole replay, both arms, every capacity: identical hits, evictions and churn."""
    from kvplug.core.model_spec import load_model
    from kvplug.replay.runner import run_replay
    from kvplug.replay.sources import bundled_trace_path
    from kvplug.replay.trace import read_trace

    trace = read_trace(bundled_trace_path())
    capacities = [round(f * trace.distinct_blocks) for f in (0.02, 0.05, 0.1, 0.25)]
    rows = run_replay(
        trace, ["lru", "vllm-stock"], capacities, load_model(None), sequential=sequential
    )
    by_arm: dict[str, list] = {"lru": [], "vllm-stock": []}
    for row in rows:
        assert row.available, row.note
        by_arm[row.policy].append(
            (
                row.capacity_blocks,
                row.hit_ratio,
                row.saved_flops,
                row.evictions,
                row.churn,
                row.preemptions,
                row.rejected,
            )
        )
    assert by_arm["lru"] == by_arm["vllm-stock"]
    assert any(evictions for _, _, _, evictions, *_ in by_arm["lru"])


@pytest.mark.parametrize("output_tokens", [0, 300])
def test_kvplug_arm_tells_the_pool_how_many_tokens_the_request_generated(output_tokens) -> None:
    """A replay unit is a trace block, so a request's output units undercount its tokens:
    the `vllm-kvplug:` arm passes the trace's output length to kvplug's manager, and the
    released blocks' records carry it (a preempted request, told 0, carries 0)."""
    arm = VLLMStockArm(8, make_policy("cost"))
    prompt = [11, 12, 13, 14]
    assert arm.admit(0, [*prompt, 900], len(prompt)) == 0
    assert arm.grow(0, [901])  # one output unit
    arm.finish(0, output_tokens)
    pool = arm.manager.block_pool
    released = [pool.standing(block) for block in pool.blocks if pool._keys[block.block_id]]
    assert released and all(standing.evictable for standing in released)
    assert {standing.request_output for standing in released} == {output_tokens}
