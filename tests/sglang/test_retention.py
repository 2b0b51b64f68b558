"""Retention inside SGLang's real radix cache: a finished request's path held by one more
tree lock (`kvplug.sglang.retention`), asked for by ``kvplug_retain_s`` in its
``custom_params``, on SGLang's Rust core and on its Python core."""

from __future__ import annotations

from itertools import count

import pytest

pytest.importorskip("sglang", reason="SGLang is not installed (see requirements/sglang-replay.txt)")

from types import SimpleNamespace  # noqa: E402

from kvplug.core.retention import RetentionBook  # noqa: E402
from kvplug.engine_stats import PoolStats  # noqa: E402
from kvplug.errors import ConfigError  # noqa: E402
from kvplug.replay.arms.base import FRESH_UNIT_BASE  # noqa: E402
from kvplug.replay.arms.sglang_kvplug import SGLangKVPlugArm  # noqa: E402
from kvplug.sglang.retention import RETAIN_PARAM, TreeRetention, refusal_for  # noqa: E402

fresh = count(FRESH_UNIT_BASE)
SYSTEM = [1, 2, 3, 4, 5, 6]
CORES = ["rust", "python"]


def run(arm: SGLangKVPlugArm, req_id: int, prompt: list[int], retain: float = 0.0) -> int:
    """One whole request; returns its prefix hit."""
    hits = arm.admit(req_id, [*prompt, next(fresh)], len(prompt))
    assert hits is not None
    if retain:
        assert arm.retain(req_id, retain)
    arm.finish(req_id)
    arm.cache.tree_core.check_invariants()
    arm.cache.kvplug_retention.check_invariants()
    return hits


def flood(arm: SGLangKVPlugArm, start: int, count_: int) -> None:
    for i in range(start, start + count_):
        run(arm, i, [1000 + 10 * i + k for k in range(6)])


@pytest.mark.parametrize("core", CORES)
@pytest.mark.parametrize("retained", [False, True])
def test_a_retained_path_survives_a_flood_in_sglangs_tree(core, retained) -> None:
    arm = SGLangKVPlugArm(32, "lru", tree_core=core)  # each tenant may keep 8 pages
    run(arm, 0, SYSTEM, retain=60.0 if retained else 0.0)
    flood(arm, 10, 12)
    assert run(arm, 1, SYSTEM) == (6 if retained else 0)
    assert arm.cache.kvplug_stats.retentions == int(retained)


@pytest.mark.parametrize("core", CORES)
def test_an_expired_retention_unlocks_its_path(core) -> None:
    arm = SGLangKVPlugArm(32, "cost", tree_core=core)
    run(arm, 0, SYSTEM, retain=30.0)
    retention = arm.cache.kvplug_retention
    assert len(retention.book) == 1 and arm.cache.protected_size() > 0
    arm.advance(31.0)
    flood(arm, 10, 12)  # each lookup first ends what has expired
    assert len(retention.book) == 0 and not retention.locks
    assert run(arm, 1, SYSTEM) == 0


@pytest.mark.parametrize("core", CORES)
def test_an_eviction_that_falls_short_ends_the_oldest_retention(core) -> None:
    arm = SGLangKVPlugArm(16, "lru", tree_core=core)
    cache = arm.cache
    cache.kvplug_retention.book = RetentionBook(16)  # a tenant may keep the whole cache
    run(arm, 0, SYSTEM, retain=60.0)
    run(arm, 1, [200, 201, 202, 203, 204, 205], retain=60.0)
    assert arm.admit(2, [*range(300, 308), next(fresh)], 8) is not None
    retention = cache.kvplug_retention
    assert len(retention.book) == 1  # the oldest ended, the newer one kept
    arm.finish(2)
    assert run(arm, 3, [200, 201, 202, 203, 204, 205]) == 6


@pytest.mark.parametrize("value", [0, -1, "60", float("inf"), True])
def test_a_bad_ask_is_not_served_and_counted(value) -> None:
    arm = SGLangKVPlugArm(32, "lru")
    retention = arm.cache.kvplug_retention
    req = SimpleNamespace(
        rid="r", sampling_params=SimpleNamespace(custom_params={RETAIN_PARAM: value})
    )
    assert retention.asked(req, "") is None
    assert retention.stats.retentions_refused == 1


@pytest.mark.parametrize(
    ("full_attention", "tp_size", "why"),
    [(False, 1, "sliding-window or Mamba state"), (True, 2, "2 tensor-parallel ranks")],
)
def test_a_cache_that_cannot_retain_refuses_defaults_at_start_and_asks_per_request(
    full_attention, tp_size, why
) -> None:
    arm = SGLangKVPlugArm(32, "lru")
    refusal = refusal_for(full_attention, tp_size)
    assert refusal_for(True, 1) is None and why in refusal
    with pytest.raises(ConfigError, match=f"default_seconds cannot be served: .*{why}"):
        TreeRetention(arm.cache, RetentionBook(8), PoolStats(), {"": 60.0}, refusal)
    retention = TreeRetention(arm.cache, RetentionBook(8), PoolStats(), None, refusal)
    req = SimpleNamespace(
        rid="r", sampling_params=SimpleNamespace(custom_params={RETAIN_PARAM: 60})
    )
    assert retention.asked(req, "") is None and retention.stats.retentions_refused == 1
