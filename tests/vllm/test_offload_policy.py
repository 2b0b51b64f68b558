"""kvplug's policy in vLLM's CPU offload tier, driven through vLLM's own CPU manager.

`CPUOffloadingManager` (the scheduler-side manager of vLLM's ``OffloadingConnector`` CPU
tier) is vLLM's code, built by name (``cache_policy="kvplug"``, what
``kv_connector_extra_config.eviction_policy`` passes) through vLLM's
``CachePolicyFactory``. Requests are driven as the connector drives them: lookups, a
load of the chunks the tier holds, a store of the rest, completions, the request's end.
Only the worker-side copies do not run (there is no GPU); the manager is told they
completed. The engine's choices are checked against vLLM's own ``lru`` on the same calls:

- a reused chunk outlives a newer one never reused (vLLM's lru evicts the older);
- a prefix's tail goes before its head, although ``cost`` values the head least;
- chunks the store protects, and what hangs above them, are never evicted, and a store
  that cannot make room changes nothing;
- random request sequences keep the policy's invariants after every call.

The replay of a whole trace through the tier is ``kvplug bench cpu-tier``
(`kvplug.bench.cpu_tier`, whose driver these tests use).
"""

from __future__ import annotations

import json
from typing import Any

import pytest

pytest.importorskip("vllm", reason="vLLM is not installed (pip install 'kvplug[vllm]')")
pytest.importorskip("vllm.v1.kv_offload.cpu.manager", reason="this vLLM has no CPU tier")

from hypothesis import given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

from kvplug.bench.cpu_tier import CPUTier, offload_key  # noqa: E402
from kvplug.vllm.offload_policy import NAME, KVPlugCachePolicy  # noqa: E402

CHUNK_TOKENS = 16
key = offload_key


class Tier(CPUTier):
    """The lab's driver of vLLM's CPU manager, over chunks named by integers."""

    def __init__(self, chunks: int, policy: str = NAME) -> None:
        super().__init__(chunks, policy, CHUNK_TOKENS)

    def request(self, units: list[int]) -> tuple[int, list[Any] | None]:  # type: ignore[override]
        return super().request([key(unit) for unit in units])

    def holds(self, unit: int) -> bool:
        return self.policy.get(key(unit)) is not None


@pytest.fixture
def kvplug_policy(tmp_path: Any, monkeypatch: pytest.MonkeyPatch) -> Any:
    """Sets kvplug's policy for the tier, as a user does: ``$KVPLUG_CONFIG``."""

    def use(name: str) -> None:
        path = tmp_path / "kvplug.json"
        path.write_text(json.dumps({"policy": name, "block_size": CHUNK_TOKENS}))
        monkeypatch.setenv("KVPLUG_CONFIG", str(path))

    return use


def test_the_names_build_kvplugs_policy(kvplug_policy: Any) -> None:
    """``kvplug``: the configured policy and its keys; ``kvplug-<name>``: that policy."""
    kvplug_policy("lfu")
    policy = Tier(4).policy
    assert isinstance(policy, KVPlugCachePolicy)
    assert policy.eviction.policy.name == "lfu" and policy.chunk_tokens == CHUNK_TOKENS
    named = Tier(4, "kvplug-gdsf").policy
    assert isinstance(named, KVPlugCachePolicy) and named.eviction.policy.name == "gdsf"


@pytest.mark.parametrize(("policy", "evicted"), [("lru", 1), ("kvplug-lfu", 2), ("kvplug-cost", 2)])
def test_a_reused_chunk_outlives_a_newer_cold_one(policy: str, evicted: int) -> None:
    """Chunk 1 stored and reused, then chunk 2 stored: a third needs room. vLLM's lru
    evicts 1 (used longer ago); kvplug's lfu and cost evict 2 (never reused)."""
    tier = Tier(2, policy)
    assert tier.request([1]) == (0, [])
    assert tier.request([1]) == (1, [])
    assert tier.request([2]) == (0, [])
    assert tier.request([3]) == (0, [key(evicted)])


def test_a_prefix_tail_goes_before_its_head() -> None:
    """``cost`` values a chunk by the prefill it saves, which grows with its depth, so a
    flat ranking would drop the head (1) and strand the chunks behind it."""
    tier = Tier(3, "kvplug-cost")
    assert tier.request([1, 2, 3]) == (0, [])
    assert tier.request([9]) == (0, [key(3)])
    assert tier.request([1, 2, 7])[0] == 2
    tier.policy.check_invariants()


def test_protected_chunks_stay_and_a_failed_store_changes_nothing() -> None:
    tier = Tier(2, "kvplug-cost")
    assert tier.request([1, 2]) == (0, [])
    # offering 1 again protects it, so only 2 (its tail) could go; two chunks are
    # needed, so the store fails whole
    assert tier.request([1, 5, 6]) == (1, None)
    assert tier.holds(1) and tier.holds(2)
    tier.policy.check_invariants()
    assert tier.request([7]) == (0, [key(2)])  # the tail first, as before
    tier.policy.check_invariants()


@pytest.mark.parametrize("policy", ["cost", "lfu", "lru", "learned"])
@settings(max_examples=40, deadline=None)
@given(
    chunks=st.integers(1, 12),
    requests=st.lists(
        st.tuples(st.integers(0, 3), st.lists(st.integers(0, 20), min_size=1, max_size=6)),
        min_size=1,
        max_size=30,
    ),
)
def test_invariants_hold_after_every_request(
    policy: str, chunks: int, requests: list[tuple[int, list[int]]]
) -> None:
    """Requests share prefixes (one of four roots, then their own chunks)."""
    tier = Tier(chunks, f"kvplug-{policy}")
    for root, tail in requests:
        units = [100 + root, *tail]
        tier.request(list(dict.fromkeys(units)))
        tier.policy.check_invariants()
        assert len(tier.policy.nodes) <= chunks
