"""The sglang-hybrid arm: SGLang 0.5.23's radix cache for sliding-window and Mamba models.

Hand-reasoned hits on the two presets (gemma3-like: SWA window of 2 units at 512-token
blocks; nemotron-h-like: Mamba states only where a request ended), the junction bound,
stock ``lru`` against kvplug's ``lru`` on the same sequences, kvplug ``cost``, and a short
realistic replay of the Mooncake trace.
"""

from __future__ import annotations

from itertools import count
from pathlib import Path

import pytest

pytest.importorskip("sglang", reason="SGLang is not installed (see requirements/sglang-replay.txt)")

from kvplug.core.groups import GroupKind  # noqa: E402
from kvplug.hybrid.spec import HYBRID_PRESETS  # noqa: E402
from kvplug.replay.arms.base import FRESH_UNIT_BASE  # noqa: E402
from kvplug.replay.arms.sglang_hybrid import SGLangHybridArm  # noqa: E402

BLOCK = 512
GEMMA, NEMOTRON = HYBRID_PRESETS["gemma3-like"], HYBRID_PRESETS["nemotron-h-like"]
TRACE = Path(__file__).resolve().parents[3] / "shared" / "traces" / "mooncake_synthetic_trace.jsonl"
fresh = count(FRESH_UNIT_BASE)


def unit_bytes(spec) -> int:
    return spec.full_attention_equivalent().kind_unit_bytes(GroupKind.FULL, BLOCK)


def arm(spec, units: int = 40, **kwargs) -> SGLangHybridArm:
    """An arm with the memory of `units` full-attention-equivalent units."""
    return SGLangHybridArm(spec, units * unit_bytes(spec), BLOCK, **kwargs)


def run(a: SGLangHybridArm, req_id: int, prompt: list[int], outputs: int = 0) -> int | None:
    """A request as the replay runs it: prompt plus a fresh sentinel, computed up to the
    sentinel, grown by `outputs` decode units, finished having decoded that many units."""
    hits = a.admit(req_id, [*prompt, next(fresh)], len(prompt))
    if hits is None:
        return None
    for _ in range(outputs):
        assert a.grow(req_id, [next(fresh)])
    a.finish(req_id, outputs * BLOCK)
    return hits


def check_junction(a: SGLangHybridArm, before: dict[str, int], hits: int) -> None:
    """The junction never exceeds what any kind alone serves."""
    for kind, total in a.group_hits.items():
        assert total - before[kind] >= hits, kind


def test_pool_split_follows_sglang_defaults() -> None:
    g = arm(GEMMA, 100)
    full = GEMMA.kind_unit_bytes(GroupKind.FULL, BLOCK)
    swa = GEMMA.kind_unit_bytes(GroupKind.SLIDING_WINDOW, BLOCK)
    assert g.window == 2  # the units covering the 1023 tokens before a hit
    assert g.full_tokens == 100 * unit_bytes(GEMMA) // (full + 0.8 * swa)
    assert g.swa_tokens == int(0.8 * g.full_tokens)
    n = arm(NEMOTRON, 100)
    state = NEMOTRON.kind_unit_bytes(GroupKind.MAMBA, BLOCK)
    assert n.mamba_states == int(100 * unit_bytes(NEMOTRON) * 0.9 / 1.9 // state)
    assert n.full_tokens * NEMOTRON.kind_unit_bytes(GroupKind.FULL, BLOCK) <= (
        100 * unit_bytes(NEMOTRON) - n.mamba_states * state
    )


@pytest.mark.parametrize("kvplug", [False, True])
def test_gemma_shared_prefix(kvplug: bool) -> None:
    """A finishes without decoding: its SWA stays on every unit, so B, sharing its first
    six units, hits 6 (SWA at units 4 and 5 is there). A request that decoded slides its
    window: only its last two units keep SWA, so a prefix ending mid-prompt is no hit."""
    a = arm(GEMMA, kvplug=kvplug, policy="lru")
    assert run(a, 1, list(range(1, 11))) == 0
    before = dict(a.group_hits)
    assert run(a, 2, [*range(1, 7), 50, 51]) == 6
    check_junction(a, before, 6)
    assert a.group_hits == {"full_attention": 6, "sliding_window": 6}

    b = arm(GEMMA, kvplug=kvplug, policy="lru")
    assert run(b, 1, list(range(1, 11)), outputs=2) == 0  # held units 0..11; SWA on 10, 11
    before = dict(b.group_hits)
    assert run(b, 2, [*range(1, 7), 50, 51]) == 0  # full attention alone would serve 6
    assert b.group_hits["full_attention"] - before["full_attention"] == 6
    check_junction(b, before, 0)


@pytest.mark.parametrize("kvplug", [False, True])
def test_gemma_continuation_hits_after_the_window_slid(kvplug: bool) -> None:
    a = arm(GEMMA, kvplug=kvplug, policy="lru")
    prompt, outputs = list(range(1, 11)), [1001, 1002]
    # No sentinel: the request holds its whole prompt, then its decode units.
    assert a.admit(1, prompt, len(prompt)) == 0
    for unit in outputs:
        assert a.grow(1, [unit])
    a.finish(1, 2 * BLOCK)
    whole = prompt + outputs  # 12 units; SWA kept on units 10 and 11 only
    before = dict(a.group_hits)
    assert run(a, 2, [*whole, 7]) == 12
    check_junction(a, before, 12)
    # Stopping one unit short needs SWA on units 9 and 10; unit 9's is gone, and so is
    # every earlier unit's.
    assert run(a, 3, [*whole[:11], 8]) == 0


@pytest.mark.parametrize("kvplug", [False, True])
def test_nemotron_hits_only_where_a_state_was_stored(kvplug: bool) -> None:
    """Mamba states are stored where a request's held sequence ended (SGLang keeps none
    mid-sequence without --enable-mamba-extra-buffer): A's at 10, B's at 8."""
    a = arm(NEMOTRON, kvplug=kvplug, policy="lru")
    stored = set()
    assert run(a, 1, list(range(1, 11))) == 0
    stored.add(10)
    before = dict(a.group_hits)
    hits = run(a, 2, [*range(1, 7), 50, 51])
    assert hits == 0  # the shared six units hold full attention but no state
    assert a.group_hits["full_attention"] - before["full_attention"] == 6
    check_junction(a, before, hits)
    stored.add(8)
    for req_id, prompt in enumerate(
        [list(range(1, 11)), [*range(1, 11), 60, 61], [*range(1, 7), 50, 51, 70]], start=3
    ):
        before = dict(a.group_hits)
        hits = run(a, req_id, prompt)
        assert hits in stored, (prompt, hits)
        check_junction(a, before, hits)
        stored.add(len(prompt))
    # The first continuation hit A's state at 10; the whole of A again also hits 10.
    assert run(a, 9, list(range(1, 11))) == 10


def sequences(seed: int) -> list[tuple[list[int], int]]:
    import random

    rng = random.Random(seed)
    bases = [[rng.randint(1, 8) for _ in range(rng.randint(4, 14))] for _ in range(4)]
    out = []
    for _ in range(40):
        base = rng.choice(bases)
        out.append((base[: rng.randint(1, len(base))] + [rng.randint(20, 30)], rng.randint(0, 2)))
    return out


def replay_sequences(a: SGLangHybridArm, seq: list[tuple[list[int], int]]) -> list:
    results = []
    ids = count(1)
    for prompt, outputs in seq:
        req_id = next(ids)
        hits = a.admit(req_id, [*prompt, FRESH_UNIT_BASE + req_id * 10], len(prompt))
        grown = []
        if hits is not None:
            for k in range(outputs):
                grown.append(a.grow(req_id, [FRESH_UNIT_BASE + req_id * 10 + 1 + k]))
            a.finish(req_id, outputs * BLOCK)
        results.append((hits, grown, a.stats(), a.bytes_held()))
    return results


@pytest.mark.parametrize("spec", [GEMMA, NEMOTRON], ids=lambda s: s.name)
@pytest.mark.parametrize("seed", [1, 2])
def test_stock_and_kvplug_lru_agree_and_cost_runs(spec, seed: int) -> None:
    seq = sequences(seed)
    stock = replay_sequences(arm(spec, 12, policy="lru"), seq)
    kvplug = replay_sequences(arm(spec, 12, policy="lru", kvplug=True), seq)
    assert stock == kvplug
    assert any(stats.evictions for _, _, stats, _ in stock), "raise the pressure"
    cost = arm(spec, 12, policy="cost", kvplug=True)
    replay_sequences(cost, seq)
    cost.cache.sanity_check()


@pytest.mark.skipif(not TRACE.exists(), reason="the Mooncake trace is not in /work/shared")
@pytest.mark.parametrize("spec", [GEMMA, NEMOTRON], ids=lambda s: s.name)
def test_smoke_replay_on_mooncake(spec) -> None:
    from kvplug.core.model_spec import load_model
    from kvplug.replay.loop import make_jobs, replay
    from kvplug.replay.trace import Trace, read_trace

    full = read_trace(TRACE)
    trace = Trace(full.name, full.block_tokens, full.requests[:200])
    jobs = make_jobs(trace, load_model(None))
    capacity = int(0.05 * trace.distinct_blocks * unit_bytes(spec))
    for kvplug, policy in ((False, "lru"), (True, "cost")):
        a = SGLangHybridArm(spec, capacity, trace.block_tokens, policy, kvplug=kvplug)
        counters = replay(a, jobs, trace.block_tokens)
        assert counters.requests + counters.rejected >= len(jobs)
        assert 0 <= counters.hit_tokens <= counters.prompt_tokens
        assert counters.hit_tokens // trace.block_tokens <= min(a.group_hits.values())
        assert not a.requests
        a.cache.sanity_check()
