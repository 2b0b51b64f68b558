"""The cache state machine: random operation sequences against the cache's invariants.

Besides `KVCache.check_invariants` (states, reference counts, index shape, policy
candidates), the state machine keeps its own model of what each physical block holds,
written only through the copies and appends the cache asks for. After every step every
live request's blocks must hold exactly its tokens, every lookup must return blocks
holding exactly the prompt's tokens, and no block handed out may have been touched by a
step that has not been fenced. A block shared wrongly, recycled early or published before
its write would break one of these. Retentions (`KVCache.retain`) hold a finished
request's prefix: while one is live its blocks stay cached and matchable, and none is
ended for room unless the room is then had.
"""

from __future__ import annotations

import hashlib
import os

import pytest
from hypothesis import assume, event, settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    Bundle,
    RuleBasedStateMachine,
    consumes,
    initialize,
    invariant,
    multiple,
    precondition,
    rule,
)

from kvplug.core.cache import KVCache
from kvplug.core.keys import Namespace
from kvplug.core.pool import BlockState
from kvplug.core.queue_protection import QueueProtection
from kvplug.core.retention import RetentionBook
from kvplug.errors import (
    CapacityError,
    DuplicateRequestError,
    FenceError,
    OutOfBlocksError,
    UnknownRequestError,
)
from kvplug.policies import EvictionPolicy, make_policy
from kvplug.policies.base import RankedPolicy
from kvplug.policies.offline.belady import BeladyPolicy
from kvplug.policies.offline.rate_oracle import RateOraclePolicy

# Sequences for the lifecycle machine under `lru` (the policies' suite runs a tenth of it
# under each other policy): 10,000 in CI, the profile's count in a developer's run.
MACHINE_EXAMPLES = (
    10_000 if os.environ.get("HYPOTHESIS_PROFILE") == "ci" else settings().max_examples
)

BASES = ([1, 2, 3, 4, 5, 6, 7, 8, 9], [1, 2, 3, 4, 9, 9, 9, 9], [7, 7, 7, 7, 7, 7])
TENANTS = (Namespace(tenant="a"), Namespace(tenant="b"))


def random_future(node, now: int) -> float:
    """A deterministic stand-in future for `belady`, which only runs in replays."""
    return now + 1 + int.from_bytes(hashlib.blake2b(node.key, digest_size=2).digest(), "big")


prompts = st.builds(
    lambda base, cut, tail: BASES[base][:cut] + tail,
    st.integers(0, len(BASES) - 1),
    st.one_of(st.just(9), st.integers(0, 9)),
    st.lists(st.integers(0, 3), max_size=6),
).filter(bool)


class CacheMachine(RuleBasedStateMachine):
    requests = Bundle("requests")
    policy_name = "lru"  # subclasses run the same machine under other policies

    def make_policy(self) -> EvictionPolicy:
        policy = make_policy(self.policy_name)
        if isinstance(policy, BeladyPolicy):
            policy.set_oracle(random_future)
        if isinstance(policy, RateOraclePolicy):
            policy.set_oracle(lambda node: random_future(node, 0))
        return policy

    @initialize(
        num_blocks=st.integers(3, 24),
        block_size=st.sampled_from([1, 2, 2, 3, 4, 4]),
        caching=st.booleans(),
        max_model_len=st.sampled_from([None, 24]),
        retention_cap=st.integers(0, 12),
    )
    def setup(
        self, num_blocks: int, block_size: int, caching: bool, max_model_len, retention_cap: int
    ) -> None:
        self.now = 0.0
        self.cache = KVCache(
            num_blocks,
            block_size,
            policy=self.make_policy(),
            enable_prefix_caching=caching,
            max_model_len=max_model_len,
            retention=RetentionBook(retention_cap),
            clock=lambda: self.now,
        )
        self.bs = block_size
        self.content: dict[int, list[int]] = {}  # block id -> tokens written into it
        self.touched: dict[int, int] = {}  # block id -> last step that read or wrote it
        self.tokens: dict[str, list[int]] = {}
        self.next_id = 0

    # -------------------------------------------------------------- helpers

    def _new_id(self) -> str:
        self.next_id += 1
        return f"r{self.next_id}"

    def _mark_touched(self, req_id: str) -> None:
        for block_id in self.cache.block_table(req_id):
            self.touched[block_id] = self.cache.step

    def _check_fresh(self, new_blocks: list[int]) -> None:
        for block_id in new_blocks:
            assert self.touched.get(block_id, 0) <= self.cache.last_fence, (
                f"block {block_id} recycled before the fence of step {self.touched[block_id]}"
            )

    def _append(self, req_id: str, tokens: list[int]) -> bool:
        before = len(self.tokens[req_id])
        try:
            result = self.cache.append(req_id, tokens)
        except (OutOfBlocksError, CapacityError) as exc:
            event(f"append refused: {type(exc).__name__}")
            return False
        if result.copies:
            event("copy-on-write")
        self._check_fresh(result.new_blocks)
        for copy in result.copies:
            self.content[copy.dst] = list(self.content[copy.src][: copy.num_tokens])
        for block_id in result.new_blocks:
            self.content.setdefault(block_id, [])
            if block_id not in {c.dst for c in result.copies}:
                self.content[block_id] = []
        table = self.cache.block_table(req_id)
        for offset, token in enumerate(tokens):
            pos = before + offset
            block = self.content[table[pos // self.bs]]
            del block[pos % self.bs :]
            block.append(token)
        self.tokens[req_id].extend(tokens)
        self._mark_touched(req_id)
        return True

    # -------------------------------------------------------------- rules

    @rule(
        target=requests,
        prompt=prompts,
        tenant=st.sampled_from(TENANTS),
        prefill=st.booleans(),
        fence=st.booleans(),
    )
    def add(self, prompt: list[int], tenant: Namespace, prefill: bool, fence: bool):
        req_id = self._new_id()
        try:
            cached = self.cache.add_request(req_id, prompt, namespace=tenant)
        except CapacityError:
            return multiple()
        assert cached % self.bs == 0 and cached < len(prompt)
        if cached:
            event("prefix hit")
        table = self.cache.block_table(req_id)
        for i, block_id in enumerate(table):
            assert self.content[block_id] == prompt[i * self.bs : (i + 1) * self.bs]
        self.tokens[req_id] = list(prompt[:cached])
        if prefill:
            self._append(req_id, prompt[cached:])
        if fence:
            self.cache.complete_step()
        return req_id

    @rule(req_id=requests, tokens=st.lists(st.integers(0, 3), min_size=1, max_size=5))
    def append(self, req_id: str, tokens: list[int]) -> None:
        assume(req_id in self.tokens)
        self.cache.expire_retentions()
        before = self.cache.num_reclaimable
        retained = self.cache.num_retained_only
        needed = self.cache.blocks_needed(req_id, len(tokens))
        ok = self._append(req_id, tokens)
        if not ok:
            assert self.cache.num_reclaimable == before
        else:
            assert needed <= before + retained
            if needed > before:
                event("a retention ended for room")

    @rule(
        req_id=consumes(requests),
        seconds=st.sampled_from([0.5, 2.0, 10.0]),
        tenant=st.sampled_from([None, "a", "b"]),
    )
    def retain_and_finish(self, req_id: str, seconds: float, tenant) -> None:
        assume(req_id in self.tokens)
        retention = self.cache.retain(req_id, seconds, tenant=tenant)
        self.cache.finish(req_id)
        del self.tokens[req_id]
        if retention is None:
            return
        event("retained")
        for block_id in retention.blocks:  # held: cached, and no policy may take it
            block = self.cache.pool.blocks[block_id]
            assert block.node is not None and block.state is BlockState.PUBLISHED

    @rule(
        prompt=prompts,
        tenant=st.sampled_from(TENANTS),
        seconds=st.sampled_from([0.5, 2.0, 10.0]),
    )
    def run_and_retain(self, prompt: list[int], tenant: Namespace, seconds: float) -> None:
        """A whole request, prefilled and fenced, that asks to keep its prefix."""
        req_id = self.add(prompt, tenant, prefill=True, fence=True)
        if req_id in self.tokens:
            self.retain_and_finish(req_id, seconds, None)

    @rule(seconds=st.sampled_from([0.25, 1.0, 5.0]))
    def time_passes(self, seconds: float) -> None:
        self.now += seconds
        if self.cache.expire_retentions():
            event("a retention expired")
        assert all(r.until > self.now for r in self.cache.retention.live.values())

    @rule(n=st.integers(1, 12))
    def make_room(self, n: int) -> None:
        self.cache.expire_retentions()
        live = len(self.cache.retention)
        if self.cache.make_room(n):
            assert self.cache.num_reclaimable >= n
            if len(self.cache.retention) < live:
                event("retentions ended for room")
        else:  # none ended in vain
            assert self.cache.num_reclaimable < n and len(self.cache.retention) == live

    @rule(target=requests, req_id=requests)
    def fork(self, req_id: str):
        assume(req_id in self.tokens)
        child = self._new_id()
        self.cache.fork(req_id, child)
        self.tokens[child] = list(self.tokens[req_id])
        return child

    @rule(req_id=consumes(requests))
    def finish(self, req_id: str) -> None:
        assume(req_id in self.tokens)
        self.cache.finish(req_id)
        del self.tokens[req_id]
        if self.cache.usage().blocks_by_state["draining"]:
            event("finish left blocks draining")
        with pytest.raises(UnknownRequestError):  # a double free is refused
            self.cache.finish(req_id)

    @rule(req_id=requests)
    def read(self, req_id: str) -> None:
        assume(req_id in self.tokens)
        self.cache.touch(req_id)
        self._mark_touched(req_id)

    @rule()
    def complete_step(self) -> None:
        self.cache.complete_step()

    @rule()
    def issue_next_step(self) -> None:
        self.cache.next_step()

    @precondition(lambda self: self.cache.step - 1 > self.cache.last_fence)
    @rule(data=st.data())
    def fence_older_step(self, data) -> None:
        step = data.draw(st.integers(self.cache.last_fence, self.cache.step - 1))
        self.cache.fence(step)

    @precondition(lambda self: self.cache.last_fence > 0)
    @rule()
    def fence_backwards_is_refused(self) -> None:
        with pytest.raises(FenceError):
            self.cache.fence(self.cache.last_fence - 1)
        with pytest.raises(FenceError):
            self.cache.fence(self.cache.step + 1)

    @rule(n=st.integers(1, 4))
    def evict(self, n: int) -> None:
        reclaimable = self.cache.num_reclaimable
        evicted = self.cache.evict(n)
        if evicted:
            event("evicted")
        assert evicted <= n
        assert self.cache.num_reclaimable == reclaimable  # evicted blocks became free

    @rule(prompt=prompts, tenant=st.sampled_from(TENANTS))
    def match(self, prompt: list[int], tenant: Namespace) -> None:
        nodes = self.cache.match(prompt, namespace=tenant)
        assert len(nodes) <= (len(prompt) - 1) // self.bs
        for i, node in enumerate(nodes):
            block = node.block
            assert block.state in (BlockState.PUBLISHED, BlockState.EVICTABLE)
            assert block.write_step <= self.cache.last_fence, "unfenced block visible"
            assert self.content[block.block_id] == prompt[i * self.bs : (i + 1) * self.bs]

    @rule(waiting=st.lists(st.tuples(prompts, st.sampled_from(TENANTS)), max_size=3))
    def waiting_requests_claim(self, waiting: list) -> None:
        """Requests waiting to start claim what they would hit (queue protection): an
        eviction then takes an unclaimed candidate while one is left."""
        if not isinstance(self.cache.policy, RankedPolicy):
            return
        claims = [self.cache.match(prompt, namespace=tenant) for prompt, tenant in waiting]
        protection = getattr(self, "protection", None)
        if protection is None:
            protection = self.protection = QueueProtection(2, self.cache)
        protection.refresh(claims)
        claimed = {id(node) for claim in claims[:2] for node in claim}
        eviction = self.cache.prefix.eviction
        unclaimed = [
            node
            for node in self.cache.index.nodes()
            if node.evictable and node.cached_children == 0 and id(node) not in claimed
        ]
        victim = eviction.next_victim()
        if unclaimed and victim is not None:
            assert id(victim) not in claimed, "a claimed block before an unclaimed one"
            event("claimed blocks passed over")

    @rule(tenant=st.sampled_from((None, *TENANTS)))
    def invalidate(self, tenant) -> None:
        self.cache.invalidate(tenant)
        if tenant is not None:
            assert self.cache.match(BASES[0], namespace=tenant) == []

    @rule(req_id=requests)
    def duplicate_id_is_refused(self, req_id: str) -> None:
        assume(req_id in self.tokens)
        with pytest.raises(DuplicateRequestError):
            self.cache.add_request(req_id, [1, 2, 3])

    # -------------------------------------------------------------- invariants

    @invariant()
    def audit(self) -> None:
        self.cache.check_invariants()
        for req_id, tokens in self.tokens.items():
            table = self.cache.block_table(req_id)
            held = [t for block_id in table for t in self.content[block_id]]
            assert held == tokens, f"{req_id} reads {held}, wrote {tokens}"
        usage = self.cache.usage()
        assert sum(usage.blocks_by_state.values()) == len(self.cache.pool)
