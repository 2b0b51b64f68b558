"""The paged KV cache: block tables, sharing, fences, the prefix index and eviction.

`KVCache` is kvplug's engine-neutral block manager and the one object that changes the
cache's state. An engine adapter (or the replay) calls it with token ids and request
ids; it answers with block ids and copy operations. It keeps the requests and their
block tables itself and delegates the rest: `kvplug.core.fences.StepClock` (steps and
what waits for a fence), `kvplug.core.prefix_cache.PrefixCache` (keys, the index and
the eviction core) and `kvplug.core.audit` (the invariants below, and usage gauges).

Steps and fences. Work is issued in numbered steps. Every append tags the blocks it
writes, and the request's whole table as read, with the current step (`step`). The caller
reports that steps up to ``f`` are finished with ``fence(f)``. Until then:

- a block filled in an unfenced step is not visible to lookups (it is WRITING);
- a block released by a request whose last step is unfenced is not recycled: it is
  DRAINING (or, if it is in the index, EVICTABLE but not yet offered to the policy).

At the fence, full blocks are sealed and published in the order they were filled, and
drained blocks go back to the pool (a full block of a cancelled request whose write was
in flight is published instead, if it can be).

Invariants (checked by `check_invariants`, see `kvplug.core.pool` for the states):

- every block is in exactly one state, and that state agrees with the free queue, the
  index and the block tables;
- ``ref_cnt`` equals the number of tables and live retentions holding the block plus one
  if it is indexed (a retention holds a finished request's prompt prefix: `retain`);
- a request's table holds its whole chain: if a table holds an indexed block, the
  block's index ancestors are the table's earlier blocks. Hence every EVICTABLE block that
  no in-flight step pins can be evicted leaves first, and `num_reclaimable` is exact;
- the index is prefix-closed and the policy's candidates are exactly the unpinned
  EVICTABLE leaves;
- no FREE block was touched by an unfenced step.

Every public method either completes or raises with the cache unchanged.
"""

from __future__ import annotations

import time
from collections import Counter
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Any, NamedTuple

from kvplug.core import audit
from kvplug.core.events import EventSink
from kvplug.core.fences import PendingWrite, StepClock
from kvplug.core.groups import CacheGroupSpec
from kvplug.core.index import Node, PrefixIndex
from kvplug.core.keys import DEFAULT_HASH, BlockHasher, BlockKey, MMFeature, Namespace, block_extras
from kvplug.core.metrics import CacheMetrics, Usage
from kvplug.core.pool import Block, BlockPool, BlockState
from kvplug.core.prefix_cache import PrefixCache
from kvplug.core.retention import Retention, RetentionBook, check_seconds
from kvplug.errors import (
    CapacityError,
    ConfigError,
    DuplicateRequestError,
    KVPlugError,
    OutOfBlocksError,
    UnknownRequestError,
)
from kvplug.policies import EvictionPolicy, make_policy

if TYPE_CHECKING:
    from kvplug.config import KVPlugConfig

RequestId = str | int


@dataclass(slots=True, eq=False)
class Request:
    """One sequence's view of the cache: its tokens, block table and full-block keys."""

    req_id: RequestId
    namespace: Namespace
    root_key: BlockKey
    mm_features: tuple[MMFeature, ...]
    max_tokens: int | None
    tokens: list[int] = field(default_factory=list)
    table: list[Block] = field(default_factory=list)
    keys: list[BlockKey] = field(default_factory=list)  # one per full block
    last_step: int = 0  # the last step that read or wrote this request's blocks
    num_cached_tokens: int = 0
    prompt_len: int = 0


class Copy(NamedTuple):
    """Copy the first `num_tokens` slots of block `src` into block `dst` (copy-on-write)."""

    src: int
    dst: int
    num_tokens: int


class AppendResult(NamedTuple):
    new_blocks: list[int]  # ids of blocks attached to the table by this append
    copies: list[Copy]  # to run before the step's writes


class KVCache:
    """Block tables, copy-on-write sharing, fenced publication, prefix reuse and eviction.

    Args:
        num_blocks: blocks in the pool (ignored when `pool` is given).
        block_size: tokens per block, any integer >= 1.
        policy: an `EvictionPolicy` or a registered policy name.
        enable_prefix_caching: publish full blocks and reuse them across requests.
        namespace: the default namespace of requests that name none.
        hash_algo: one of `kvplug.core.keys.HASH_ALGORITHMS`.
        share_across_tenants: ignore `Namespace.tenant` when keying blocks.
        max_model_len: the default maximum tokens per request (None: unbounded).
        pool, group: share one `BlockPool` between several caches, one per group.
        event_sink: called with a `BlockStored` or `BlockRemoved` each time a block enters
            or leaves the prefix index (what vLLM publishes as KV events).
        retention: the book of retentions (`retain`); by default each tenant may retain
            a quarter of the blocks.
        clock: seconds, for retention times (default `time.monotonic`; a replay passes
            its own clock).
    """

    def __init__(
        self,
        num_blocks: int,
        block_size: int,
        *,
        policy: EvictionPolicy | str = "lru",
        enable_prefix_caching: bool = True,
        namespace: Namespace | None = None,
        hash_algo: str = DEFAULT_HASH,
        share_across_tenants: bool = False,
        max_model_len: int | None = None,
        pool: BlockPool | None = None,
        group: int = 0,
        spec: CacheGroupSpec | None = None,
        event_sink: EventSink | None = None,
        retention: RetentionBook | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        if not isinstance(block_size, int) or isinstance(block_size, bool) or block_size < 1:
            raise ConfigError(f"block_size must be an integer >= 1, got {block_size!r}")
        if max_model_len is not None and max_model_len < 1:
            raise ConfigError(f"max_model_len must be >= 1 or None, got {max_model_len!r}")
        self.block_size = block_size
        self.spec = spec or CacheGroupSpec(block_size=block_size)
        if self.spec.block_size != block_size:
            raise ConfigError(
                f"group spec block_size {self.spec.block_size} != cache block_size {block_size}"
            )
        self.pool = pool if pool is not None else BlockPool(num_blocks, self.spec.page_bytes)
        if pool is not None and pool.page_bytes != self.spec.page_bytes:
            raise ConfigError(
                f"group page size {self.spec.page_bytes} B does not match the shared pool's "
                f"{pool.page_bytes} B; groups sharing a pool need equal page sizes"
            )
        self.group = group
        policy = make_policy(policy) if isinstance(policy, str) else policy
        policy.bind(block_size, len(self.pool))
        self.enable_prefix_caching = enable_prefix_caching
        self.namespace = namespace or Namespace()
        self.share_across_tenants = share_across_tenants
        self.max_model_len = max_model_len
        self.metrics = CacheMetrics()
        self.prefix = PrefixCache(
            policy,
            block_size,
            hash_algo,
            self.metrics,
            enabled=enable_prefix_caching,
            event_sink=event_sink,
        )
        self.clock: StepClock[Request] = StepClock()
        self.requests: dict[RequestId, Request] = {}
        self.retention = retention if retention is not None else RetentionBook(len(self.pool) // 4)
        self.now = clock
        self.retention_holds: Counter[int] = Counter()  # block id -> live retentions of it

    @classmethod
    def from_config(
        cls,
        config: KVPlugConfig,
        num_blocks: int,
        block_size: int | None = None,
        namespace: Namespace | None = None,
        **kwargs: Any,
    ) -> KVCache:
        """A cache set up by `config`. `block_size` is the engine's, used when the config
        names none; `namespace` carries what the engine knows (model, tokenizer, dtype)."""
        size = config.block_size or block_size
        if size is None:
            raise ConfigError("block_size is set neither in the kvplug config nor by the engine")
        ns = namespace or Namespace()
        if config.namespace.model_revision:
            ns = replace(ns, revision=config.namespace.model_revision)
        if config.namespace.tenant:
            ns = replace(ns, tenant=config.namespace.tenant)
        return cls(
            num_blocks,
            size,
            policy=make_policy(config.policy, config.policy_config),
            enable_prefix_caching=config.enable_prefix_caching,
            namespace=ns,
            hash_algo=config.hash_algo,
            share_across_tenants=config.namespace.share_across_tenants,
            **kwargs,
        )

    # ------------------------------------------------------------------ queries

    @property
    def policy(self) -> EvictionPolicy:
        return self.prefix.policy

    @property
    def index(self) -> PrefixIndex:
        return self.prefix.index

    @property
    def hasher(self) -> BlockHasher:
        return self.prefix.hasher

    @property
    def step(self) -> int:
        """The step being issued."""
        return self.clock.step

    @property
    def last_fence(self) -> int:
        """Every step up to this one has finished."""
        return self.clock.last_fence

    @property
    def num_free_blocks(self) -> int:
        return self.pool.num_free

    @property
    def num_reclaimable(self) -> int:
        """Blocks an allocation can get now: free ones plus evictable ones no step pins."""
        return self.pool.num_free + self.prefix.num_evictable

    def resolve_namespace(self, namespace: Namespace | None = None) -> Namespace:
        """The namespace blocks are keyed under: the cache's block size is always part of it,
        and the tenant is dropped when tenants are configured to share."""
        ns = (namespace or self.namespace).with_block_size(self.block_size)
        if self.share_across_tenants and ns.tenant:
            ns = replace(ns, tenant="")
        return ns

    def match(
        self,
        prompt: Sequence[int],
        namespace: Namespace | None = None,
        mm_features: Sequence[MMFeature] = (),
    ) -> list[Node]:
        """The indexed blocks that serve the longest cached prefix of `prompt`.

        At most ``(len(prompt) - 1) // block_size`` blocks: the last prompt token is always
        computed, so the model produces logits. Changes nothing.
        """
        if not self.enable_prefix_caching:
            return []
        ns = self.resolve_namespace(namespace)
        nodes, _ = self.prefix.lookup(prompt, ns, tuple(mm_features))
        return nodes

    def protect_n(self, nodes: list[Node], levels: list[int]) -> None:
        """Give each of `nodes` (indexed) its protection level (0: none): a waiting
        request will hit it, so it is evicted after every candidate of a lower level
        (`kvplug.core.queue_protection`)."""
        self.prefix.eviction.protect_n(nodes, levels)

    def admission_blocks(self, nodes: Sequence[Node], num_tokens: int) -> int:
        """How much of `num_reclaimable` admitting a request takes, when a lookup matched
        `nodes` and its first `num_tokens` tokens are to be held: the new blocks, plus the
        matched blocks that were evictable and stop being so."""
        new = -(-num_tokens // self.block_size) - len(nodes)
        revived = sum(
            1
            for node in nodes
            if node.block is not None
            and node.block.state is BlockState.EVICTABLE
            and not node.block.pinned
        )
        return max(new, 0) + revived

    def blocks_needed(self, req_id: RequestId, num_tokens: int) -> int:
        """New blocks `append(req_id, num_tokens tokens)` would allocate."""
        req = self._get(req_id)
        return self._blocks_needed(req, num_tokens)

    def can_append(self, req_id: RequestId, num_tokens: int) -> bool:
        return self.blocks_needed(req_id, num_tokens) <= self.num_reclaimable

    def block_table(self, req_id: RequestId) -> list[int]:
        return [block.block_id for block in self._get(req_id).table]

    # ------------------------------------------------------------------ requests

    def add_request(
        self,
        req_id: RequestId,
        prompt: Sequence[int],
        *,
        namespace: Namespace | None = None,
        mm_features: Sequence[MMFeature] = (),
        max_tokens: int | None = None,
    ) -> int:
        """Start a request and attach the cached blocks of its longest cached prefix.

        Returns the number of prompt tokens served from the cache. The caller then appends
        ``prompt[returned:]`` (and later the generated tokens) with `append`.
        """
        if req_id in self.requests:
            raise DuplicateRequestError(f"request {req_id!r} is already in the cache")
        if not prompt:
            raise KVPlugError(f"request {req_id!r} has an empty prompt")
        limit = max_tokens if max_tokens is not None else self.max_model_len
        if limit is not None and len(prompt) > limit:
            raise CapacityError(
                f"request {req_id!r}: prompt of {len(prompt)} tokens exceeds its limit of {limit}"
            )
        ns = self.resolve_namespace(namespace)
        features = tuple(mm_features)
        nodes, keys = self.prefix.lookup(prompt, ns, features)
        req = Request(req_id, ns, self.prefix.root_key(ns), features, limit)
        for node in nodes:
            self._acquire(node)
        req.table = [node.block for node in nodes]  # type: ignore[misc]
        req.keys = keys[: len(nodes)]
        req.tokens = list(prompt[: len(nodes) * self.block_size])
        req.num_cached_tokens = len(req.tokens)
        req.prompt_len = len(prompt)
        self.requests[req_id] = req
        self.metrics.requests += 1
        self.metrics.lookups += 1
        self.metrics.lookup_tokens += len(prompt)
        self.metrics.matched_tokens += req.num_cached_tokens
        return req.num_cached_tokens

    def append(self, req_id: RequestId, tokens: Sequence[int]) -> AppendResult:
        """Attach blocks for `tokens`, which the current step will write.

        A shared, partly filled tail block is first copied (copy-on-write). Evicts cached
        blocks as needed; raises `OutOfBlocksError` (changing nothing) if even that is not
        enough, and `CapacityError` past the request's `max_tokens`.
        """
        req = self._get(req_id)
        if not tokens:
            return AppendResult([], [])
        if req.max_tokens is not None and len(req.tokens) + len(tokens) > req.max_tokens:
            raise CapacityError(
                f"request {req_id!r}: appending {len(tokens)} tokens to {len(req.tokens)} "
                f"would pass its limit of {req.max_tokens} tokens"
            )
        self._reserve(self._blocks_needed(req, len(tokens)))

        new_blocks: list[int] = []
        copies: list[Copy] = []
        bs = self.block_size
        tail_fill = len(req.tokens) % bs
        if tail_fill and req.table[-1].ref_cnt > 1:
            shared = req.table[-1]
            private = self._allocate()
            private.num_tokens = tail_fill
            private.write_step = self.step
            shared.ref_cnt -= 1
            shared.busy_until = max(shared.busy_until, self.step)  # the copy reads it
            req.table[-1] = private
            copies.append(Copy(shared.block_id, private.block_id, tail_fill))
            new_blocks.append(private.block_id)
            self.metrics.cow_copies += 1

        pos = 0
        while pos < len(tokens):
            fill = len(req.tokens) % bs
            if fill == 0:
                req.table.append(self._allocate())
                new_blocks.append(req.table[-1].block_id)
            block = req.table[-1]
            take = min(bs - fill, len(tokens) - pos)
            req.tokens.extend(tokens[pos : pos + take])
            pos += take
            block.num_tokens += take
            block.write_step = self.step
            if block.num_tokens == bs:
                self._key_full_block(req)
                self.clock.write_pending(req, len(req.table) - 1)
        req.last_step = self.step
        return AppendResult(new_blocks, copies)

    def touch(self, req_id: RequestId) -> None:
        """Record that the current step reads `req_id`'s blocks without appending."""
        self._get(req_id).last_step = self.step

    def fork(self, parent_id: RequestId, child_id: RequestId) -> None:
        """Start `child_id` sharing every block of `parent_id` (parallel sampling, beams).

        Full blocks stay shared; the first append of either into a shared partial tail
        copies it first.
        """
        parent = self._get(parent_id)
        if child_id in self.requests:
            raise DuplicateRequestError(f"request {child_id!r} is already in the cache")
        child = Request(
            child_id,
            parent.namespace,
            parent.root_key,
            parent.mm_features,
            parent.max_tokens,
            tokens=list(parent.tokens),
            table=list(parent.table),
            keys=list(parent.keys),
            last_step=parent.last_step,
            num_cached_tokens=parent.num_cached_tokens,
            prompt_len=parent.prompt_len,
        )
        for block in child.table:
            block.ref_cnt += 1
        self.requests[child_id] = child
        self.metrics.requests += 1

    def finish(
        self, req_id: RequestId, *, output_tokens: int | None = None, session: bool = False
    ) -> None:
        """End a request (done or cancelled) and release its blocks, tail first.

        Blocks that an unfenced step may still read or write stay out of the pool until
        that fence. `output_tokens` is how many tokens the request generated, for callers
        whose tokens are not model tokens; by default, the tokens appended past its prompt.
        The released index nodes record it, with their distance from the request's end,
        whether it reused the cache and whether it named a `session`
        (`kvplug.core.sessions`), for the eviction policy.
        """
        req = self.requests.pop(req_id, None)
        if req is None:
            raise UnknownRequestError(
                f"request {req_id!r} is not in the cache (never added, or already finished)"
            )
        if output_tokens is None:
            output_tokens = max(len(req.tokens) - req.prompt_len, 0)
        for from_end, block in enumerate(reversed(req.table)):
            block.ref_cnt -= 1
            block.busy_until = max(block.busy_until, req.last_step)
            if block.node is not None:
                block.node.from_end = from_end
                block.node.request_hit = req.num_cached_tokens > 0
                block.node.request_output = output_tokens
                block.node.request_session = session
            if block.ref_cnt - (block.node is not None) == 0:
                block.released_at_fence = self.last_fence
                self._settle(block)

    cancel = finish

    # ------------------------------------------------------------------ retention

    def retain(
        self, req_id: RequestId, seconds: object, *, tenant: str | None = None
    ) -> Retention | None:
        """Keep `req_id`'s cached prompt prefix for `seconds` (call it before `finish`):
        its prompt's leading indexed blocks are held, as a request holds them, until the
        retention ends (`kvplug.core.retention`: it expires, its tenant's cap needs room,
        or nothing else is left to evict: `make_room`). The tenant is the request's
        namespace's unless named. Returns the retention, or None when nothing is retained
        (no indexed prompt block, or more than the tenant's cap); never fails for room.
        A bad `seconds` raises `ConfigError`, changing nothing."""
        req = self._get(req_id)
        check_seconds(seconds, self.retention.max_seconds)
        self.expire_retentions()
        blocks = []
        for block in req.table[: req.prompt_len // self.block_size]:
            if block.node is None:
                break
            blocks.append(block.block_id)
        who = req.namespace.tenant if tenant is None else tenant
        retention, lapsed = self.retention.retain(who, blocks, seconds, self.now())
        if retention is not None:
            for block_id in retention.blocks:
                self.pool.blocks[block_id].ref_cnt += 1
                self.retention_holds[block_id] += 1
        for ended in lapsed:
            self._release_retention(ended)
        return retention

    def expire_retentions(self) -> int:
        """End the retentions whose time has passed; returns how many ended."""
        ended = self.retention.expire(self.now())
        for retention in ended:
            self._release_retention(retention)
        return len(ended)

    def make_room(self, num_blocks: int) -> bool:
        """Whether `num_blocks` blocks can be had now (`num_reclaimable`), ending expired
        retentions and then, if that is not enough and would be with them, the oldest
        live ones (a retained block goes only when nothing else can)."""
        self.expire_retentions()
        if self.num_reclaimable >= num_blocks:
            return True
        if self.num_reclaimable + self.num_retained_only < num_blocks:
            return False
        while self.num_reclaimable < num_blocks:
            retention = self.retention.lapse_oldest()
            if retention is None:
                break
            self._release_retention(retention)
        return self.num_reclaimable >= num_blocks

    @property
    def num_retained_only(self) -> int:
        """Blocks that only retentions hold, and no step pins: reclaimable once they end."""
        blocks = self.pool.blocks
        return sum(
            1
            for block_id, holds in self.retention_holds.items()
            if blocks[block_id].ref_cnt - (blocks[block_id].node is not None) == holds
            and not self.clock.busy(blocks[block_id])
        )

    def _release_retention(self, retention: Retention) -> None:
        """Let go of `retention`'s holds, tail first, as `finish` lets go of a table."""
        for block_id in reversed(retention.blocks):
            block = self.pool.blocks[block_id]
            block.ref_cnt -= 1
            self.retention_holds[block_id] -= 1
            if not self.retention_holds[block_id]:
                del self.retention_holds[block_id]
            if block.ref_cnt - (block.node is not None) == 0:
                block.released_at_fence = self.last_fence
                self._settle(block)

    # ------------------------------------------------------------------ steps

    def next_step(self) -> int:
        """Start issuing a new step (without fencing the current one); returns its number."""
        return self.clock.next_step()

    def complete_step(self) -> int:
        """Fence the current step and start the next; returns the step fenced."""
        done = self.step
        self.fence(done)
        return done

    def fence(self, step: int) -> None:
        """Every step up to and including `step` has finished reading and writing."""
        for write in self.clock.fence(step):
            self._complete_write(write)
        for block in self.clock.drained():
            waiting = block.state is BlockState.DRAINING or (
                block.state is BlockState.EVICTABLE and block.pinned
            )
            if waiting and not self.clock.busy(block):
                block.pinned = False
                self._settle(block)

    # ------------------------------------------------------------------ eviction

    def evict(self, num_blocks: int) -> int:
        """Evict up to `num_blocks` cached blocks the policy ranks first; returns how many."""
        evicted = 0
        while evicted < num_blocks:
            # One at a time: a victim's parent may become the next candidate (vLLM's order).
            victim = self.prefix.next_victim()
            if victim is None:
                break
            self._evict(victim)
            evicted += 1
        return evicted

    def invalidate(self, namespace: Namespace | None = None) -> int:
        """Drop every index entry (or those of one namespace) from lookups.

        Blocks still held by requests stay with them (SEALED) and are freed when released;
        the rest are freed now, or at their fence. Returns the entries dropped.
        """
        scope = None if namespace is None else self.resolve_namespace(namespace)
        dropped = 0
        for node in self.prefix.nodes(scope):
            self._unindex(node)
            dropped += 1
        self.metrics.invalidations += dropped
        return dropped

    # ------------------------------------------------------------------ reports

    def usage(self) -> Usage:
        """What the live requests and the cache hold now (O(total))."""
        return audit.usage(self)

    def check_invariants(self) -> None:
        """Audit every block, table and index entry (O(total)); raise AssertionError on a
        breach. The invariants are listed in the module doc."""
        audit.check_invariants(self)

    # ------------------------------------------------------------------ internals

    def _get(self, req_id: RequestId) -> Request:
        req = self.requests.get(req_id)
        if req is None:
            raise UnknownRequestError(
                f"request {req_id!r} is not in the cache (never added, or already finished)"
            )
        return req

    def blocks_of_group(self) -> Iterable[Block]:
        """This group's blocks, and the free ones (which belong to no group)."""
        return (b for b in self.pool.blocks if b.group == self.group or b.state is BlockState.FREE)

    def _blocks_needed(self, req: Request, num_tokens: int) -> int:
        bs = self.block_size
        have = len(req.tokens)
        grow = -(-(have + num_tokens) // bs) - len(req.table)
        cow = num_tokens > 0 and have % bs != 0 and req.table[-1].ref_cnt > 1
        return grow + cow

    def _key_full_block(self, req: Request) -> None:
        """Compute the key of the request's block that just became full."""
        start = len(req.keys) * self.block_size
        parent = req.keys[-1] if req.keys else req.root_key
        tokens = req.tokens[start : start + self.block_size]
        req.keys.append(self.prefix.block_key(parent, tokens, req.mm_features, start))

    def _allocate(self) -> Block:
        block = self.pool.allocate(self.group)
        self.metrics.allocations += 1
        return block

    def _reserve(self, num_blocks: int) -> None:
        """Make `num_blocks` free blocks available, evicting if needed (retained blocks
        only when nothing else is left: `make_room`), or raise unchanged."""
        if self.retention.live:  # an expired retention's blocks are the policy's again
            self.expire_retentions()
        missing = num_blocks - self.pool.num_free
        if missing <= 0:
            return
        if missing > self.prefix.num_evictable and not self.make_room(num_blocks):
            raise OutOfBlocksError(
                f"need {num_blocks} blocks: {self.pool.num_free} free and "
                f"{self.prefix.num_evictable} evictable; the rest are in use or awaiting a fence"
            )
        missing = num_blocks - self.pool.num_free  # (an ended retention may have freed some)
        if missing <= 0:
            return
        evicted = self.evict(missing)
        assert evicted == missing, "policy candidates out of step with reclaimable blocks"

    def _acquire(self, node: Node) -> None:
        """A new request takes an indexed block (a lookup hit)."""
        block = node.block
        assert block is not None
        if block.state is BlockState.EVICTABLE:
            block.pinned = False  # a pinned block was never offered to the policy
            block.state = BlockState.PUBLISHED
        block.ref_cnt += 1
        self.prefix.hit(node)

    def _settle(self, block: Block) -> None:
        """Place a block that no table holds: evictable, draining, or free."""
        busy = self.clock.busy(block)
        if block.node is not None:
            block.state = BlockState.EVICTABLE
            if busy:
                block.pinned = True
                self.clock.wait_for_fence(block)
                return
            self._record_release(block)
            self.prefix.offer(block.node)
        elif busy:
            block.state = BlockState.DRAINING
            self.clock.wait_for_fence(block)
        else:
            self._record_release(block)
            self._free(block)

    def _record_release(self, block: Block) -> None:
        """Record, once, how many steps had to finish between the block's release and its
        becoming reusable (0 when nothing in flight touched it)."""
        if block.released_at_fence >= 0:
            self.metrics.record_release(self.last_fence - block.released_at_fence)
            block.released_at_fence = -1

    def _free(self, block: Block) -> None:
        self.pool.free(block)
        self.metrics.frees += 1

    def _complete_write(self, write: PendingWrite[Request]) -> None:
        """At its fence: a filled block is sealed, then published if it can be."""
        req, i = write.request, write.index
        block = req.table[i]
        if block.state is BlockState.WRITING:
            block.state = BlockState.SEALED
        if not self.enable_prefix_caching or block.state not in (
            BlockState.SEALED,
            BlockState.DRAINING,
        ):
            return
        parent = req.table[i - 1].node if i else None
        if i and parent is None:  # the block before it is not indexed: keep the index closed
            return
        size = self.block_size
        tokens = tuple(req.tokens[i * size : (i + 1) * size])
        extras = block_extras(req.mm_features, i * size, (i + 1) * size)
        node = self.prefix.publish(
            req.namespace, req.root_key, parent, req.keys[i], tokens, extras, block
        )
        if node is None:
            return
        block.node = node
        block.ref_cnt += 1
        if block.state is BlockState.DRAINING:  # its request was cancelled mid-write
            block.state = BlockState.EVICTABLE
            self._settle(block)
        else:
            block.state = BlockState.PUBLISHED

    def _evict(self, node: Node) -> None:
        self.metrics.evictions += 1
        self.metrics.churn += node.hits == 0
        self._unindex(node)

    def _unindex(self, node: Node) -> None:
        """Remove a leaf from lookups; free its block if nothing else holds it."""
        block = node.block
        assert block is not None
        self.prefix.unindex(node)
        block.node = None
        block.ref_cnt -= 1
        if block.ref_cnt == 0:
            block.pinned = False
            self._settle(block)
        else:  # held: indexed blocks are always fully written
            block.state = BlockState.SEALED
