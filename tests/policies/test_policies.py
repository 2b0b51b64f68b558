"""Eviction policies: the registry, each policy's order, and the cache invariants under each."""

from __future__ import annotations

from importlib.metadata import EntryPoint

import pytest
from cache_machine import MACHINE_EXAMPLES, CacheMachine
from hypothesis import given, settings
from hypothesis import strategies as st

from kvplug.config import KVPlugConfig, build_policy
from kvplug.core.cache import KVCache
from kvplug.core.eviction import EvictionCore
from kvplug.core.model_spec import load_model
from kvplug.errors import ConfigError, UnknownPolicyError
from kvplug.policies import available_policies, make_policy, offline_policies, policy_class
from kvplug.policies.base import EvictionPolicy
from kvplug.policies.cost import CostPolicy
from kvplug.policies.gdsf import GDSFPolicy
from kvplug.policies.learned import LearnedPolicy
from kvplug.policies.lfu import LFUPolicy
from kvplug.policies.offline.rate_oracle import ReturningOraclePolicy

BUILTIN = ["belady", "cost", "gdsf", "learned", "lfu", "lru", "rate-oracle", "returning-oracle"]


def test_registry_lists_every_builtin_policy() -> None:
    assert set(BUILTIN) <= set(available_policies())
    for name in BUILTIN:
        assert isinstance(make_policy(name), EvictionPolicy)


def test_unknown_policy_lists_the_known_ones() -> None:
    with pytest.raises(
        UnknownPolicyError,
        match="known policies: belady, cost, gdsf, learned, lfu, lru, rate-oracle, returning-",
    ):
        make_policy("arc")


def test_bad_policy_parameter_is_reported() -> None:
    with pytest.raises(UnknownPolicyError, match="takes no parameter .half_life. .accepted: "):
        make_policy("cost", {"half_life": 3})


class _Outside(CostPolicy):
    name = "outside"


def test_other_packages_add_policies_through_entry_points(monkeypatch) -> None:
    found = [
        EntryPoint("outside", f"{__name__}:_Outside", "kvplug.policies"),
        EntryPoint("broken", "builtins:dict", "kvplug.policies"),
    ]
    monkeypatch.setattr("kvplug.policies.registry.entry_points", lambda group: found)
    assert "outside" in available_policies()
    assert isinstance(make_policy("outside"), _Outside)
    assert policy_class("lru").name == "lru"  # built-ins cannot be shadowed
    with pytest.raises(UnknownPolicyError, match="not an EvictionPolicy"):
        make_policy("broken")


def _serve(cache: KVCache, req: str, prompt: list[int], output: int = 0) -> int:
    cached = cache.add_request(req, prompt)
    cache.append(req, prompt[cached:])
    cache.complete_step()
    cache.finish(req, output_tokens=output)
    return cached


@pytest.mark.parametrize(("policy", "first"), [("lfu", (9,)), ("lru", (1,))])
def test_lfu_evicts_the_least_reused_where_lru_evicts_the_oldest(policy, first) -> None:
    cache = KVCache(8, 1, policy=policy)
    _serve(cache, "a", [1, 9])
    _serve(cache, "a2", [1, 8])  # reuses block 1
    _serve(cache, "b", [2, 9])
    assert cache.evict(2) == 2  # both leaves under block 1, which is now a leaf itself
    # lru: block 1 was released before b's blocks; lfu: block 1 was reused, b's leaf not.
    assert cache.policy.choose_victims(1)[0].tokens == first


def test_gdsf_keeps_the_deeper_block_of_equal_frequency() -> None:
    # Each cache block stands for 4,096 tokens, so attention makes depth matter.
    cache = KVCache(16, 1, policy=GDSFPolicy(tokens_per_block=4096))
    _serve(cache, "long", [*range(1, 12), 0])
    _serve(cache, "short", [50, 0])  # released later, but its leaf sits at depth 1, not 11
    assert cache.policy.choose_victims(1)[0].depth == 1
    lru = KVCache(16, 1, policy="lru")
    _serve(lru, "long", [*range(1, 12), 0])
    _serve(lru, "short", [50, 0])
    assert lru.policy.choose_victims(1)[0].depth == 11


def _follow_up_hits(policy, rounds: int = 300) -> tuple[KVCache, int]:
    """Each round: a request that generates a short answer, four that generate long ones,
    then the short one's follow-up. Only follow-ups reuse anything. Returns the cache and
    how many of the last 100 follow-ups found their prefix cached."""
    cache = KVCache(16, 1, policy=policy)
    hits = 0
    for i in range(rounds):
        short = [1000 + i, 1, 2, 3, 4]
        _serve(cache, f"s{i}", short, output=10)
        for k in range(4):
            _serve(cache, f"l{i}.{k}", [5000 + 4 * i + k, 6, 7, 8, 9], output=900)
        cached = _serve(cache, f"s{i}b", short, output=10)
        hits += i >= rounds - 100 and cached == 4
    return cache, hits


def test_cost_learns_which_classes_come_back() -> None:
    cache, cost_hits = _follow_up_hits(CostPolicy(tokens_per_block=512))
    learned = cache.policy.learned()
    short_p = max(p for cls, (n, p) in learned.items() if cls[-2] == (10).bit_length())
    long_p = max(p for cls, (n, p) in learned.items() if cls[-2] == (900).bit_length())
    assert short_p > 0.5 > 0.1 > long_p
    _, lru_hits = _follow_up_hits(make_policy("lru"))
    assert lru_hits == 0 and cost_hits >= 90
    cache.check_invariants()


@given(st.lists(st.lists(st.integers(1, 6), min_size=1, max_size=5), max_size=30))
@settings(max_examples=40, deadline=None)
def test_cost_frequency_weight_scales_only_the_reuse_term(prompts) -> None:
    """With the same requests (and room for all, so that no eviction differs), a cached
    block's credit under weight w is its odds x value times (1 + w * min(hits, 3)): the
    weight changes nothing else the policy learns."""
    caches = {w: KVCache(256, 1, policy=CostPolicy(tokens_per_block=64, frequency_weight=w))
              for w in (0.0, 0.5, 1.0)}  # fmt: skip
    for i, prompt in enumerate(prompts):
        for cache in caches.values():
            _serve(cache, f"r{i}", [*prompt, 100 + i])
    learned = {w: cache.policy.learned() for w, cache in caches.items()}
    assert learned[0.0] == learned[0.5] == learned[1.0]
    policies = [cache.policy for cache in caches.values()]
    for prompt in prompts:
        paths = [cache.match(prompt) for cache in caches.values()]
        for node_0, node_half, node_1 in zip(*paths, strict=True):
            assert node_0.hits == node_half.hits == node_1.hits
            base, hits = policies[0].credit(node_0), min(node_0.hits, 3)
            assert policies[1].credit(node_half) == pytest.approx(base * (1 + 0.5 * hits))
            assert policies[2].credit(node_1) == pytest.approx(base * (1 + hits))


@pytest.mark.parametrize("weight", [-1, "high", float("nan")])
def test_cost_rejects_a_bad_frequency_weight(weight) -> None:
    with pytest.raises(ConfigError, match="frequency_weight must be a number >= 0"):
        make_policy("cost", {"frequency_weight": weight})


@pytest.mark.parametrize("ghost_ratio", [4, 0], ids=["ghosts", "no ghosts"])
def test_cost_ghosts_give_back_credit(ghost_ratio: int) -> None:
    cache = KVCache(4, 1, policy=CostPolicy(tokens_per_block=16, ghost_ratio=ghost_ratio))
    policy = cache.policy
    _serve(cache, "a", [1, 2, 0])  # three blocks, never reused; released tail first
    # Each release opens a trial in the never-reused class of its distance from the end.
    never = [(0, from_end, 0, 0, 0) for from_end in (2, 1, 0)]  # depth 0, 1, 2
    assert [policy.classify(n) for n in cache.match([1, 2, 0, 9])] == never
    assert cache.evict(4) == 3
    assert cache.match([1, 2, 0, 9]) == []
    # Evicted: with a ghost history the trials stay open there; without, they close unused.
    closed = (0, 1 / 2) if ghost_ratio else (1, 1 / 3)
    assert policy.learned() == {cls: closed for cls in never}

    _serve(cache, "b", [1, 2, 0])  # recomputed: the ghost history remembers it
    nodes = cache.match([1, 2, 0, 9])
    assert [n.hits for n in nodes] == [0, 0, 0]
    if ghost_ratio:
        # Each re-insert closed its ghost's trial as reused and got one reuse back, so
        # its release put it in the reused-once class (output bucket 0).
        assert policy.learned() == {**{cls: (1, 2 / 3) for cls in never}, (1, 0, 0): (0, 1 / 2)}
        assert [policy.reuses(n) for n in nodes] == [1, 1, 1]
        assert [policy.classify(n) for n in nodes] == [(1, 0, 0)] * 3
    else:  # no history: the trials closed as not reused when evicted, and no credit
        assert policy.learned() == {cls: (1, 1 / 3) for cls in never}
        assert [policy.reuses(n) for n in nodes] == [0, 0, 0]
        assert [policy.classify(n) for n in nodes] == never


def test_learned_keeps_cost_s_lesson_when_the_shadows_agree() -> None:
    cache, hits = _follow_up_hits(LearnedPolicy(tokens_per_block=512, window=64))
    assert hits >= 90 and cache.policy.use_learned
    state = cache.policy.explain()
    assert state["ranking"] == "learned" and state["classes"]
    assert state["shadow_saved"]["learned"] > state["shadow_saved"]["lru"]
    cache.check_invariants()


def test_learned_falls_back_to_release_order_when_lru_s_shadow_wins() -> None:
    policy = LearnedPolicy(tokens_per_block=512)
    policy.bind(1, 64)
    policy.duel.lru.saved, policy.duel.learned.saved = 10.0, 5.0
    policy.duel.referee()
    assert not policy.use_learned and policy.switches == 1
    cache = KVCache(64, 1, policy=policy)
    for i in range(8):  # very different classes and depths, ranked in release order
        _serve(cache, f"r{i}", [100 * i + k for k in range(1 + i % 3)], output=10 + 300 * (i % 2))
    order = [node.tokens[0] // 100 for node in policy.choose_victims(8)]
    assert order == sorted(order)
    policy.duel.lru.saved, policy.duel.learned.saved = 1.0, 5.0
    policy.duel.referee()
    assert policy.use_learned and policy.switches == 2


def _machine_under(policy: str):
    machine = type(f"CacheMachine_{policy}", (CacheMachine,), {"policy_name": policy})
    test = machine.TestCase
    # A tenth of the lru machine's sequences: the lifecycle code is shared, the ranking is not.
    test.settings = settings(test.settings, max_examples=max(MACHINE_EXAMPLES // 10, 50))
    return test


TestInvariantsUnderLFU = _machine_under("lfu")
TestInvariantsUnderGDSF = _machine_under("gdsf")
TestInvariantsUnderCost = _machine_under("cost")
TestInvariantsUnderLearned = _machine_under("learned")
TestInvariantsUnderBelady = _machine_under("belady")
TestInvariantsUnderRateOracle = _machine_under("rate-oracle")
TestInvariantsUnderReturningOracle = _machine_under("returning-oracle")


def test_returning_oracle_knows_a_count_only_once_the_prefix_returned() -> None:
    policy = ReturningOraclePolicy()
    policy.foresee({b"a": [0, 5, 9], b"b": [3], b"c": [1, 2]})
    assert policy.prior == 2.0  # (3 + 1 + 2) / 3 keys
    a, b, unseen = _Node(0, 0, None), _Node(1, 0, None), _Node(2, 0, None)
    a.key, b.key, unseen.key = b"a", b"b", b"z"
    known = []
    for now in (0, 4, 5, 9):
        policy.now = now
        known.append((policy.known_uses(a), policy.known_uses(b), policy.known_uses(unseen)))
    # a: reached once until request 5 returns to it, then its whole count (3); b never returns
    assert known == [(2.0, 2.0, 2.0), (2.0, 2.0, 2.0), (3, 2.0, 2.0), (3, 2.0, 2.0)]


@pytest.mark.parametrize("name", offline_policies())
def test_offline_policies_need_the_future_and_no_engine_runs_them(name: str) -> None:
    with pytest.raises(ConfigError, match=f"policy {name!r} cannot run in a server"):
        build_policy(KVPlugConfig(policy=name), load_model(None))
    cache = KVCache(4, 1, policy=name)
    with pytest.raises(ConfigError, match="runs only in trace replays"):
        _serve(cache, "a", [1, 2])


class _Node:
    """A bare `TreeNode` for driving an `EvictionCore` directly."""

    def __init__(self, serial: int, depth: int, parent: _Node | None) -> None:
        self.serial, self.key, self.depth = serial, f"k{serial}".encode(), depth
        self.hits = self.from_end = self.request_output = 0
        self.request_hit = self.request_session = self.evictable = False
        self.up = parent


_CORE_OPS = st.lists(
    st.tuples(st.sampled_from(["grow", "release", "hit", "evict"]), st.integers(0, 10**6)),
    max_size=120,
)


@pytest.mark.parametrize("name", ["cost", "learned", "gdsf", "lfu", "lru"])
@given(ops=_CORE_OPS)
@settings(deadline=None)
def test_batched_paths_decide_as_one_at_a_time(name: str, ops) -> None:
    """The vLLM pool's batched paths decide as one node at a time: `EvictionCore.pop_victims`
    names and removes the victims `next_victim` and `remove` would, `insert_chain` links
    and inserts as `insert` per node, and a batched release (`release_n`, which `cost` and
    `learned` rank in one loop) ranks as releasing one node at a time, in order: two cores
    driven by the same operations agree on every victim, every rank and what the policy
    learned."""
    params = {"tokens_per_block": 16} if name in ("cost", "learned", "gdsf") else {}
    cores = [EvictionCore(make_policy(name, params)) for _ in range(2)]
    for core in cores:
        core.policy.bind(16, 64)
    nodes: list[list[_Node]] = [[], []]  # per core, every node made (same serials)
    held: list[int] = []  # indices of held, cached nodes (one request's chain each)
    serials = iter(range(10**9))
    for op, pick in ops:
        if op == "grow":  # a request caches a chain of 1-4 blocks below a random node
            cached = [i for i, n in enumerate(nodes[0]) if n.serial >= 0]
            below = cached[pick % len(cached)] if cached and pick % 3 else None
            chain = []
            new: list[_Node] = []  # core 0's, inserted as one chain (`insert_chain`)
            top = None
            for _ in range(1 + pick % 4):
                serial = next(serials)
                for core, made in zip(cores, nodes, strict=True):
                    parent = made[below] if below is not None else None
                    if parent is not None and (parent.serial < 0 or parent.evictable):
                        parent = None
                    node = _Node(serial, 0 if parent is None else parent.depth + 1, parent)
                    if core is cores[0]:
                        if not new:
                            top = parent
                        new.append(node)
                    else:
                        core.insert(node, parent)
                    made.append(node)
                below = len(nodes[0]) - 1
                chain.append(below)
            cores[0].insert_chain(new, top)
            held.extend(chain)
        elif op == "release" and held:
            count = 1 + pick % min(len(held), 5)
            chain, held[:] = held[-count:][::-1], held[:-count]  # tail first, as vLLM frees
            for from_end, i in enumerate(chain):
                for made in nodes:
                    made[i].from_end, made[i].request_output = from_end, pick % 40
                    made[i].request_session = pick % 3 == 0
            cores[0].release_n([nodes[0][i] for i in chain])
            for i in chain:
                cores[1].release(nodes[1][i])
        elif op == "hit":
            evictable = [i for i, n in enumerate(nodes[0]) if n.serial >= 0 and n.evictable]
            if evictable:  # one lookup hits 1-3 nodes (`hit_n` against one at a time)
                chosen = sorted({evictable[(pick + k) % len(evictable)] for k in range(3)})
                chosen = chosen[: 1 + pick % 3]
                for i in chosen:
                    cores[0].reclaim(nodes[0][i])
                    cores[1].reclaim(nodes[1][i])
                    cores[1].hit(nodes[1][i])
                cores[0].hit_n([nodes[0][i] for i in chosen])
                held.extend(chosen)
        elif op == "evict":  # 1-4 victims at once (`pop_victims`) against one at a time
            victims = cores[0].pop_victims(1 + pick % 4)
            for victim in victims:
                expected = cores[1].next_victim()
                assert expected is not None and victim.serial == expected.serial
                cores[1].remove(expected)
            if len(victims) < 1 + pick % 4:  # only when no candidate is left
                assert cores[1].next_victim() is None
            for victim in victims:
                nodes[1][nodes[0].index(victim)].serial = victim.serial = -1
        a, b = cores[0].policy, cores[1].policy
        assert len(a) == len(b) and cores[0].num_evictable == cores[1].num_evictable
        assert a._rank == b._rank  # every rank and release order agrees
        for learned in ("inflation", "_ghosts", "_trial", "_credit", "_tried", "_reused"):
            assert getattr(a, learned, None) == getattr(b, learned, None), learned
        for side in (a, b):
            assert side.chosen == a.chosen


class _SkipsOdd(LFUPolicy):
    """A plugin's `RankedPolicy` that chooses its victims itself: odd serials last."""

    def pop_first(self):
        first = super().pop_first()
        if first is not None and first.serial % 2 and len(self):
            second = super().pop_first()
            self.add_candidate(first)
            return second
        return first


def test_pop_victims_asks_a_policy_that_chooses_its_own_victims() -> None:
    """`EvictionCore.pop_victims` reads the candidate heap itself only for a policy that
    keeps it as `RankedPolicy` does; one that overrides how victims are taken is asked."""
    core = EvictionCore(_SkipsOdd())
    nodes = [_Node(serial, 0, None) for serial in range(4)]
    for node in nodes:
        core.insert(node, None)
    core.release_n(nodes)
    assert [node.serial for node in core.pop_victims(2)] == [0, 2]
