"""kvplug's policies over both tiers of SGLang's hierarchical cache (HiCache), in-process.

The caches are SGLang's own `UnifiedRadixCache` from SGLang's unit-test fixture (real
token pools on the CPU, `sglang_fixture.build`) with HiCache started by SGLang's own
`init_hicache`: a real host pool, SGLang's cache controller, its transfer engine and its
write policies (``write_through``, ``write_through_selective``, ``write_back``). Three
CUDA-only pieces below the tree are stood in for on the CPU for the duration of each
test (`sglang_hicache_cpu`: host-buffer registration, the ``direct`` copy kernel, a
stream synchronise); the KV bytes really move between the pools.

What it shows:

- random sequences of the scheduler's cache operations (insert; match, loading back what
  only the host holds, and lock; unlock; device eviction; host eviction; the per-step
  event poll) keep kvplug's invariants (`KVPlugTreeCore.check_invariants`: records are
  exactly the nodes with device KV, ``held_elsewhere`` exactly those with a host copy,
  the host tier's members exactly the host-only nodes, candidates exactly SGLang's
  evictable leaves) and SGLang's own `sanity_check`, for every write policy, under
  ``kvplug-lru`` and ``kvplug-cost``;
- a demoted node loaded back holds the KV bytes written before it was demoted;
- of two device leaves alike but for a host copy, ``kvplug-cost`` demotes the one the
  host holds (a reload) and keeps the other (a recompute); SGLang's ``lru`` evicts the
  older, the one held nowhere else;
- the host pool evicts by kvplug's policy: of two host-only leaves, ``kvplug-cost``
  drops the one never reused, SGLang's ``lru`` the older one, reused or not.
"""

from __future__ import annotations

import dataclasses
import random
from array import array
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from typing import Any

import pytest

pytest.importorskip("sglang", reason="SGLang is not installed (see requirements/sglang-replay.txt)")

import torch  # noqa: E402
from hypothesis import given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402
from sglang.srt.mem_cache.base_prefix_cache import EvictParams, InsertParams  # noqa: E402
from sglang.srt.mem_cache.radix_cache import RadixKey  # noqa: E402
from sglang.srt.server_args import set_global_server_args_for_scheduler  # noqa: E402
from sglang_fixture import FULL, build, match_prefix  # noqa: E402
from sglang_hicache_cpu import cpu_hicache, cpu_hicache_server_args  # noqa: E402

WRITE_POLICIES = ("write_through", "write_through_selective", "write_back")


class HiCache:
    """One HiCache-enabled cache and the operations SGLang's scheduler runs on it."""

    def __init__(self, policy: str, write_policy: str, write_through_threshold: int) -> None:
        self.policy = policy
        self.cache, self.allocator, _ = build("full-p1", policy)
        server_args = cpu_hicache_server_args(hicache_write_policy=write_policy)
        set_global_server_args_for_scheduler(server_args)
        self.cache.init_hicache(server_args, self.cache.cache_init_params)
        self.cache.write_through_threshold = write_through_threshold
        self.cache.load_back_threshold = 0
        self.tree = self.cache.tree_core
        self.locks: list[Any] = []

    def close(self) -> None:
        from sglang.test.kits.unified_radix_cache.fixtures import drop_hicache_atexit_pin

        drop_hicache_atexit_pin(self.cache)
        self.cache.release_host_resources()

    # -- the scheduler's operations ---------------------------------------------------------
    def insert(self, tokens: list[int]) -> int:
        if not tokens:
            return -1
        if self.allocator.available_size() < len(tokens):
            self.cache.evict(EvictParams(num_tokens=len(tokens)))
            if self.allocator.available_size() < len(tokens):
                return -1
        value = self.allocator.alloc(len(tokens))
        key = RadixKey(array("q", tokens))
        prefix = self.cache.insert(InsertParams(key=key, value=value)).prefix_len
        self.allocator.free(value[:prefix])  # the tree had these already (SGLang frees them)
        return prefix

    def match_and_lock(self, tokens: list[int]) -> int:
        """Match `tokens`; what only the host holds is loaded back first (as SGLang's
        scheduler does at admission), then the matched path is locked."""
        match = match_prefix(self.cache, tokens)
        node = match.last_device_node
        if match.host_hit_length > 0 and self.load_back(match.best_match_node):
            node = match.best_match_node
        self.locks.append(self.cache.lock(node))
        return match.device_prefix_len + match.host_hit_length

    def load_back(self, node_id: Any) -> bool:
        if not self.cache.load_back(node_id):
            return False
        self.cache.ready_to_load_host_cache()
        for ack in list(self.cache.cache_controller.ack_load_queue):
            ack.finish_event.synchronize()
        self.cache.loading_check()
        return True

    def unlock(self, pick: int) -> None:
        if self.locks:
            self.cache.unlock(self.locks.pop(pick % len(self.locks)))

    def evict(self, tokens: int) -> int:
        return self.cache.evict(EvictParams(num_tokens=tokens)).num_tokens_evicted

    def evict_host(self, tokens: int) -> int:
        return self.cache.evict_host(tokens)

    def poll(self) -> None:
        """The per-step poll: finished write-throughs unlock their nodes."""
        self.cache.check_hicache_events()

    def back_up(self, tokens: list[int]) -> None:
        """Copy the path of `tokens` to the host now, parent first, and wait for it."""
        from sglang.test.kits.unified_radix_cache.fixtures import write_backup

        node = self.node(tokens)
        path = []
        while node is not self.tree.root_node:
            path.append(node)
            node = node.parent
        for ancestor in reversed(path):
            if not ancestor.backuped:
                assert write_backup(self.cache, ancestor.id, write_back=True) > 0
        self.cache.writing_check(write_back=True)

    # -- reading it -------------------------------------------------------------------------
    def node(self, tokens: list[int]) -> Any:
        """The tree node whose path ends at the last of `tokens`."""
        node, rest = self.tree.root_node, list(tokens)
        while rest:
            node = next(c for c in node.children.values() if list(c.key.token_ids[:1]) == rest[:1])
            rest = rest[len(node.key) :]
        return node

    def tier(self, tokens: list[int]) -> str:
        """Where the KV of `tokens`'s last node is: device, host, both, or gone."""
        try:
            data = self.node(tokens).component_data[FULL]
        except StopIteration:
            return "gone"
        on_device, on_host = data.value is not None, data.host_value is not None
        return {(True, True): "both", (True, False): "device", (False, True): "host"}.get(
            (on_device, on_host), "gone"
        )

    def check(self) -> None:
        if self.policy.startswith("kvplug-"):
            self.tree.check_invariants()
        self.cache.sanity_check()


@contextmanager
def opened(
    policy: str, write_policy: str = "write_through", threshold: int = 1 << 30
) -> Iterator[HiCache]:
    """A `HiCache` with SGLang's CUDA-only pieces stood in for, closed after use."""
    with cpu_hicache():
        cache = HiCache(policy, write_policy, threshold)
        try:
            yield cache
        finally:
            cache.close()


@pytest.fixture
def hicache() -> Iterator[Any]:
    """Builds `HiCache`s (see `opened`); closes them after the test."""
    with ExitStack() as stack:
        yield lambda *args, **kwargs: stack.enter_context(opened(*args, **kwargs))


prefixes = st.lists(st.integers(1, 6), min_size=1, max_size=12)
op_list = st.lists(
    st.one_of(
        st.tuples(st.just("insert"), st.integers(0, 2), st.integers(1, 12), st.integers(0, 9)),
        st.tuples(st.just("match"), st.integers(0, 2), st.integers(1, 12)),
        st.tuples(st.just("unlock"), st.integers(0, 7)),
        st.tuples(st.just("evict"), st.integers(1, 16)),
        st.tuples(st.just("evict_host"), st.integers(1, 16)),
        st.tuples(st.just("poll")),
    ),
    max_size=30,
)


def apply(cache: HiCache, bases: list[list[int]], op: tuple) -> Any:
    kind = op[0]
    if kind == "insert":
        _, which, cut, tail = op
        suffix = [100 + tail] * 4 if tail < 7 else []
        return cache.insert(bases[which % len(bases)][:cut] + suffix)
    if kind == "match":
        return cache.match_and_lock(bases[op[1] % len(bases)][: op[2]])
    if kind == "unlock":
        return cache.unlock(op[1])
    if kind == "evict":
        return cache.evict(op[1])
    if kind == "evict_host":
        return cache.evict_host(op[1])
    return cache.poll()


@pytest.mark.parametrize("write_policy", WRITE_POLICIES)
@pytest.mark.parametrize("policy", ["kvplug-lru", "kvplug-cost"])
@settings(max_examples=12, deadline=None)
@given(bases=st.lists(prefixes, min_size=1, max_size=3), ops=op_list)
def test_both_tiers_keep_kvplug_and_sglang_invariants(
    policy: str, write_policy: str, bases: list[list[int]], ops: list[tuple]
) -> None:
    # a write-through at the first hit, so that random runs back nodes up, demote them
    # and load them back
    with opened(policy, write_policy, threshold=1) as cache:
        for op in ops:
            apply(cache, bases, op)
            cache.check()
        while cache.locks:
            cache.unlock(0)
        cache.poll()
        cache.evict(1 << 20)
        cache.check()


@pytest.mark.parametrize("policy", ["lru", "kvplug-cost"])
def test_a_loaded_back_node_holds_the_bytes_it_was_demoted_with(hicache: Any, policy: str) -> None:
    cache = hicache(policy)
    tokens = list(range(1, 9))
    cache.insert(tokens)
    kv_pool = cache.allocator.get_kvcache()
    layer = kv_pool.start_layer
    indices = cache.node(tokens).component_data[FULL].value
    marks = torch.arange(1, len(tokens) + 1, dtype=kv_pool.dtype)[:, None, None]
    kv_pool.get_key_buffer(layer)[indices] = marks
    cache.back_up(tokens)
    assert cache.evict(len(tokens)) == len(tokens)
    assert cache.tier(tokens) == "host"
    assert cache.match_and_lock(tokens) == len(tokens)
    assert cache.tier(tokens) == "both"
    loaded = cache.node(tokens).component_data[FULL].value
    assert torch.equal(
        kv_pool.get_key_buffer(layer)[loaded],
        marks.expand_as(kv_pool.get_key_buffer(layer)[loaded]),
    )
    cache.check()


@pytest.mark.parametrize(("policy", "kept"), [("lru", "held"), ("kvplug-cost", "alone")])
def test_a_device_node_the_host_holds_is_demoted_first(
    hicache: Any, policy: str, kept: str
) -> None:
    """Two device leaves of the same length and depth, never reused; the newer one is
    backed up. One leaf's worth of eviction: ``cost`` prices the backed-up one as a
    reload and demotes it; ``lru`` evicts the older, whose KV is then lost."""
    cache = hicache(policy)
    alone, held = list(range(1, 9)), list(range(11, 19))
    cache.insert(alone)
    cache.insert(held)
    cache.back_up(held)
    assert (cache.tier(alone), cache.tier(held)) == ("device", "both")
    assert cache.evict(8) == 8
    if kept == "alone":
        assert (cache.tier(alone), cache.tier(held)) == ("device", "host")
    else:
        assert (cache.tier(alone), cache.tier(held)) == ("gone", "both")
    cache.check()


@pytest.mark.parametrize(("policy", "dropped"), [("lru", "reused"), ("kvplug-cost", "once")])
def test_the_host_pool_evicts_by_the_policy(hicache: Any, policy: str, dropped: str) -> None:
    """Two host-only leaves: the older was reused twice before it was demoted (two
    requests matched it and, finishing, inserted it again: SGLang counts a hit there),
    the newer never. Host eviction for one of them: ``cost`` drops the one never reused,
    ``lru`` the older."""
    cache = hicache(policy)
    reused, once = list(range(1, 9)), list(range(11, 19))
    cache.insert(reused)
    for _ in range(2):
        cache.match_and_lock(reused)
        cache.insert(reused)
        cache.unlock(0)
    cache.insert(once)
    cache.back_up(reused)
    cache.back_up(once)
    assert cache.evict(16) == 16
    assert (cache.tier(reused), cache.tier(once)) == ("host", "host")
    assert cache.evict_host(8) == 8
    gone, kept = (reused, once) if dropped == "reused" else (once, reused)
    assert (cache.tier(gone), cache.tier(kept)) == ("gone", "host")
    cache.check()


def test_random_runs_reach_every_tier_change() -> None:
    """A seeded run of the random operations at write-through on the first hit: nodes are
    backed up, demoted, loaded back and evicted from the host, and every operation keeps
    the invariants (what the property test's examples rely on reaching)."""
    rng = random.Random(7)
    bases = [[rng.randint(1, 6) for _ in range(12)] for _ in range(3)]
    seen = {"demoted": 0, "loaded back": 0, "host evicted": 0}
    with opened("kvplug-cost", "write_through", threshold=1) as cache:
        tree = cache.tree
        forget, gain, forget_host = tree.forget, tree.gain_device, tree.forget_host

        def counting_forget(node: Any, keep_host: bool = False) -> None:
            seen["demoted"] += keep_host
            forget(node, keep_host=keep_host)

        def counting_gain(node: Any) -> None:
            seen["loaded back"] += node.id not in tree.records
            gain(node)

        def counting_forget_host(node: Any) -> None:
            seen["host evicted"] += node.id in tree.host_records
            forget_host(node)

        tree.forget, tree.gain_device, tree.forget_host = (
            counting_forget,
            counting_gain,
            counting_forget_host,
        )
        for _ in range(400):
            kind = rng.choice(
                ["insert", "insert", "match", "unlock", "evict", "evict_host", "poll"]
            )
            op: tuple = {
                "insert": (kind, rng.randrange(3), rng.randint(1, 12), rng.randrange(10)),
                "match": (kind, rng.randrange(3), rng.randint(1, 12)),
                "unlock": (kind, rng.randrange(8)),
                "evict": (kind, rng.randint(1, 16)),
                "evict_host": (kind, rng.randint(1, 16)),
                "poll": (kind,),
            }[kind]
            apply(cache, bases, op)
            cache.check()
    assert all(count > 0 for count in seen.values()), seen


def test_the_backend_builds_a_hierarchical_cache() -> None:
    """``--radix-cache-backend kvplug --enable-hierarchical-cache``: SGLang's own
    selection (`create_unified_radix_cache`, called by kvplug's factory) starts HiCache
    on kvplug's cache and registers its layer counter with the worker."""
    from sglang.srt.mem_cache.registry import TreeCacheBuildContext, get_radix_cache_factory
    from sglang.srt.runtime_context import use_context

    from kvplug.replay.arms.sglang import _scheduler_context
    from kvplug.sglang import plugin
    from kvplug.sglang.backend import KVPlugRadixCache
    from kvplug.sglang.tree_core import KVPlugTreeCore

    plugin.register()
    counters: list[Any] = []

    class Worker:
        def register_hicache_layer_transfer_counter(self, counter: Any) -> None:
            counters.append(counter)

    with cpu_hicache():
        stock, _, _ = build("full-p1", "lru")  # its pools, for a fresh set of parameters
        params = dataclasses.replace(
            stock.cache_init_params, eviction_policy="kvplug-cost", component_registry_override=None
        )
        server_args = cpu_hicache_server_args(enable_hierarchical_cache=True)
        server_args._radix_eviction_policy_explicitly_set = True
        set_global_server_args_for_scheduler(server_args)
        ctx = TreeCacheBuildContext(
            server_args=server_args,
            params=params,
            is_hybrid_swa=False,
            is_hybrid_ssm=False,
            enable_hierarchical_cache=True,
            disable_radix_cache=False,
            tp_worker=Worker(),
            model_config=None,
            tp_size=1,
            tp_rank=0,
            tp_group=None,
        )
        with use_context(_scheduler_context()):
            cache = get_radix_cache_factory("kvplug")(ctx)
        try:
            assert isinstance(cache, KVPlugRadixCache)
            assert isinstance(cache.tree_core, KVPlugTreeCore)
            assert cache.cache_controller is not None
            assert counters == [cache.cache_controller.layer_done_counter]
        finally:
            from sglang.test.kits.unified_radix_cache.fixtures import drop_hicache_atexit_pin

            drop_hicache_atexit_pin(cache)
            cache.release_host_resources()
