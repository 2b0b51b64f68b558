"""The paged KV cache: block tables, sharing, fences, the prefix index and eviction.

`KVCache` is kvplug's engine-neutral block manager. An engine adapter calls it with
token ids and request ids; it answers with block ids and copy operations.

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
- ``ref_cnt`` equals the number of tables holding the block plus one if it is indexed;
- a request's table holds its whole chain: if a table holds an indexed block, the
  block's index ancestors are the table's earlier blocks. Hence every EVICTABLE block that
  no in-flight step pins can be evicted leaves first, and `num_reclaimable` is exact;
- the index is prefix-closed and the policy's candidates are exactly the unpinned
  EVICTABLE leaves;
- no FREE block was touched by an unfenced step.

Every public method either completes or raises with the cache unchanged.
"""

from __future__ import annotations

from collections import Counter, deque
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field, replace
from heapq import heappop, heappush
from itertools import count
from typing import TYPE_CHECKING, Any, NamedTuple

from kvplug.core.events import BlockRemoved, BlockStored, EventSink
from kvplug.core.groups import CacheGroupSpec
from kvplug.core.index import Node, PrefixIndex
from kvplug.core.keys import DEFAULT_HASH, BlockHasher, BlockKey, MMFeature, Namespace, block_extras
from kvplug.core.metrics import CacheMetrics, Usage
from kvplug.core.pool import Block, BlockPool, BlockState
from kvplug.errors import (
    CapacityError,
    ConfigError,
    DuplicateRequestError,
    FenceError,
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


class _Pending(NamedTuple):
    """A full block whose write is in flight, to seal and publish at its fence."""

    step: int
    req: Request
    index: int  # position of the block in req.table


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
        self.policy = make_policy(policy) if isinstance(policy, str) else policy
        self.policy.bind(block_size, len(self.pool))
        self.enable_prefix_caching = enable_prefix_caching
        self.namespace = namespace or Namespace()
        self.hasher = BlockHasher(hash_algo)
        self.share_across_tenants = share_across_tenants
        self.max_model_len = max_model_len
        self.index = PrefixIndex()
        self.metrics = CacheMetrics()
        self.requests: dict[RequestId, Request] = {}
        self.step = 1  # the step being issued
        self.last_fence = 0  # every step <= last_fence is finished
        self._pending: deque[_Pending] = deque()
        # (busy until step, tie-breaker, block): blocks waiting for a fence to settle
        self._draining: list[tuple[int, int, Block]] = []
        self._drain_seq = count()
        self._num_reclaimable = 0  # EVICTABLE blocks known to the policy
        self.event_sink = event_sink

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
            policy=make_policy(config.policy, **config.policy_config),
            enable_prefix_caching=config.enable_prefix_caching,
            namespace=ns,
            hash_algo=config.hash_algo,
            share_across_tenants=config.namespace.share_across_tenants,
            **kwargs,
        )

    # ------------------------------------------------------------------ queries

    @property
    def num_free_blocks(self) -> int:
        return self.pool.num_free

    @property
    def num_reclaimable(self) -> int:
        """Blocks an allocation can get now: free ones plus evictable ones no step pins."""
        return self.pool.num_free + self._num_reclaimable

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
        nodes, _ = self._lookup(prompt, self.resolve_namespace(namespace), tuple(mm_features))
        return nodes

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
        nodes, keys = self._lookup(prompt, ns, features)
        req = Request(req_id, ns, self.hasher.root_key(ns), features, limit)
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
                self._pending.append(_Pending(self.step, req, len(req.table) - 1))
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

    def finish(self, req_id: RequestId, *, output_tokens: int | None = None) -> None:
        """End a request (done or cancelled) and release its blocks, tail first.

        Blocks that an unfenced step may still read or write stay out of the pool until
        that fence. `output_tokens` is how many tokens the request generated, for callers
        whose tokens are not model tokens; by default, the tokens appended past its prompt.
        The released index nodes record it, with their distance from the request's end and
        whether it reused the cache, for the eviction policy.
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
            if block.ref_cnt - (block.node is not None) == 0:
                block.released_at_fence = self.last_fence
                self._settle(block)

    cancel = finish

    # ------------------------------------------------------------------ steps

    def next_step(self) -> int:
        """Start issuing a new step (without fencing the current one); returns its number."""
        self.step += 1
        return self.step

    def complete_step(self) -> int:
        """Fence the current step and start the next; returns the step fenced."""
        done = self.step
        self.fence(done)
        return done

    def fence(self, step: int) -> None:
        """Every step up to and including `step` has finished reading and writing."""
        if step < self.last_fence:
            raise FenceError(f"fence {step} is older than fence {self.last_fence} already seen")
        if step > self.step:
            raise FenceError(f"fence {step} names a step not issued yet (current step {self.step})")
        self.last_fence = step
        if step == self.step:
            self.step += 1
        while self._pending and self._pending[0].step <= step:
            self._complete_write(self._pending.popleft())
        while self._draining and self._draining[0][0] <= step:
            _, _, block = heappop(self._draining)
            waiting = block.state is BlockState.DRAINING or (
                block.state is BlockState.EVICTABLE and block.pinned
            )
            if waiting and not self._busy(block):
                block.pinned = False
                self._settle(block)

    # ------------------------------------------------------------------ eviction

    def evict(self, num_blocks: int) -> int:
        """Evict up to `num_blocks` cached blocks the policy ranks first; returns how many."""
        evicted = 0
        while evicted < num_blocks:
            # One at a time: a victim's parent may become the next candidate (vLLM's order).
            victims = self.policy.choose_victims(1)
            if not victims:
                break
            self._evict(victims[0])
            evicted += 1
        return evicted

    def invalidate(self, namespace: Namespace | None = None) -> int:
        """Drop every index entry (or those of one namespace) from lookups.

        Blocks still held by requests stay with them (SEALED) and are freed when released;
        the rest are freed now, or at their fence. Returns the entries dropped.
        """
        if namespace is None:
            roots = list(self.index.roots.values())
        else:
            root = self.index.roots.get(self.resolve_namespace(namespace))
            roots = [root] if root is not None else []
        dropped = 0
        for root in roots:
            for node in list(self.index.walk(root)):
                self._unindex(node)
                dropped += 1
        self.metrics.invalidations += dropped
        return dropped

    # ------------------------------------------------------------------ reports

    def usage(self) -> Usage:
        held: dict[int, Block] = {}
        logical = entries = 0
        for req in self.requests.values():
            logical += len(req.tokens)
            entries += len(req.table)
            for block in req.table:
                held[block.block_id] = block
        slots = len(held) * self.block_size
        filled = sum(block.num_tokens for block in held.values())
        states = Counter(block.state.value for block in self._my_blocks())
        return Usage(
            logical_tokens=logical,
            physical_token_slots=slots,
            tail_waste=slots - filled,
            block_table_entries=entries,
            blocks_by_state={state.value: states.get(state.value, 0) for state in BlockState},
            cached_blocks=len(self.index),
        )

    def check_invariants(self) -> None:
        """Audit every block, table and index entry (O(total)); raise AssertionError on a breach."""
        tables: Counter[int] = Counter()
        for req in self.requests.values():
            assert len(req.table) == -(-len(req.tokens) // self.block_size), req.req_id
            assert len(req.keys) == len(req.tokens) // self.block_size, req.req_id
            for i, block in enumerate(req.table):
                tables[block.block_id] += 1
                assert block.state is not BlockState.FREE, f"{req.req_id} holds free block"
                full = (i + 1) * self.block_size <= len(req.tokens)
                expected = self.block_size if full else len(req.tokens) - i * self.block_size
                assert block.num_tokens == expected, (req.req_id, i, block)
                if block.node is not None:  # the table holds the block's whole index chain
                    assert block.node.depth == i and block.node.key == req.keys[i]
                    parent = block.node.parent
                    assert parent is not None
                    assert (parent.block is None) if i == 0 else (parent.block is req.table[i - 1])

        free_ids = self.pool.free_ids()
        indexed = {node.block.block_id for node in self.index.nodes() if node.block is not None}
        counts: Counter[BlockState] = Counter()
        reclaimable = 0
        candidates = 0
        for block in self._my_blocks():
            counts[block.state] += 1
            n_tables = tables[block.block_id]
            in_index = block.node is not None
            assert in_index == (block.block_id in indexed), block
            assert block.ref_cnt == n_tables + in_index, (block, n_tables)
            assert block.ref_cnt >= 0
            assert (block.state is BlockState.FREE) == (block.block_id in free_ids), block
            assert block.pinned == (block.state is BlockState.EVICTABLE and self._busy(block))
            full = block.num_tokens == self.block_size
            state = block.state
            if state is BlockState.FREE:
                assert block.ref_cnt == 0 and not self._busy(block), block
            elif state is BlockState.WRITING:
                assert (
                    n_tables and not in_index and (not full or block.write_step > self.last_fence)
                )
            elif state is BlockState.SEALED:
                assert n_tables and not in_index and full and block.write_step <= self.last_fence
            elif state is BlockState.PUBLISHED:
                assert n_tables and in_index, block
            elif state is BlockState.EVICTABLE:
                assert not n_tables and in_index, block
                if not block.pinned:
                    reclaimable += 1
                    candidates += block.node.is_leaf  # type: ignore[union-attr]
            else:  # DRAINING
                assert not n_tables and not in_index and self._busy(block), block
        assert reclaimable == self._num_reclaimable, (reclaimable, self._num_reclaimable)
        assert candidates == len(self.policy), (candidates, len(self.policy))
        for node in self.index.nodes():
            block = node.block
            assert block is not None and block.node is node
            assert block.state in (BlockState.PUBLISHED, BlockState.EVICTABLE)
            assert node.parent is not None and node.parent.children.get(node.key) is node
            assert len(node.tokens) == self.block_size
        assert sum(counts.values()) == sum(1 for _ in self._my_blocks())

    # ------------------------------------------------------------------ internals

    def _get(self, req_id: RequestId) -> Request:
        req = self.requests.get(req_id)
        if req is None:
            raise UnknownRequestError(
                f"request {req_id!r} is not in the cache (never added, or already finished)"
            )
        return req

    def _my_blocks(self) -> Iterable[Block]:
        """This group's blocks, and the free ones (which belong to no group)."""
        return (b for b in self.pool.blocks if b.group == self.group or b.state is BlockState.FREE)

    @staticmethod
    def _busy_step(block: Block) -> int:
        return max(block.busy_until, block.write_step)

    def _busy(self, block: Block) -> bool:
        return self._busy_step(block) > self.last_fence

    def _blocks_needed(self, req: Request, num_tokens: int) -> int:
        bs = self.block_size
        have = len(req.tokens)
        grow = -(-(have + num_tokens) // bs) - len(req.table)
        cow = num_tokens > 0 and have % bs != 0 and req.table[-1].ref_cnt > 1
        return grow + cow

    def _lookup(
        self, prompt: Sequence[int], ns: Namespace, features: tuple[MMFeature, ...]
    ) -> tuple[list[Node], list[BlockKey]]:
        nodes: list[Node] = []
        keys: list[BlockKey] = []
        if not self.enable_prefix_caching:
            return nodes, keys
        node = self.index.roots.get(ns)
        if node is None:
            return nodes, keys
        bs = self.block_size
        parent_key = node.key
        for i in range((len(prompt) - 1) // bs):
            tokens = tuple(prompt[i * bs : (i + 1) * bs])
            extras = block_extras(features, i * bs, (i + 1) * bs)
            parent_key = self.hasher.block_key(parent_key, tokens, extras)
            node = self.index.child(node, parent_key, tokens, extras)  # type: ignore[assignment]
            if node is None:
                break
            nodes.append(node)
            keys.append(parent_key)
        return nodes, keys

    def _key_full_block(self, req: Request) -> None:
        """Compute the key of the request's block that just became full."""
        i = len(req.keys)
        bs = self.block_size
        parent = req.keys[-1] if req.keys else req.root_key
        tokens = req.tokens[i * bs : (i + 1) * bs]
        req.keys.append(
            self.hasher.block_key(
                parent, tokens, block_extras(req.mm_features, i * bs, (i + 1) * bs)
            )
        )

    def _allocate(self) -> Block:
        block = self.pool.allocate(self.group)
        self.metrics.allocations += 1
        return block

    def _reserve(self, num_blocks: int) -> None:
        """Make `num_blocks` free blocks available, evicting if needed, or raise unchanged."""
        missing = num_blocks - self.pool.num_free
        if missing <= 0:
            return
        if missing > self._num_reclaimable:
            raise OutOfBlocksError(
                f"need {num_blocks} blocks: {self.pool.num_free} free and "
                f"{self._num_reclaimable} evictable; the rest are in use or awaiting a fence"
            )
        evicted = self.evict(missing)
        assert evicted == missing, "policy candidates out of step with reclaimable blocks"

    def _acquire(self, node: Node) -> None:
        """A new request takes an indexed block (a lookup hit)."""
        block = node.block
        assert block is not None
        if block.state is BlockState.EVICTABLE:
            if block.pinned:
                block.pinned = False
            else:
                self.policy.discard_candidate(node)
                self._num_reclaimable -= 1
            block.state = BlockState.PUBLISHED
        block.ref_cnt += 1
        node.hits += 1
        self.policy.hit(node)

    def _settle(self, block: Block) -> None:
        """Place a block that no table holds: evictable, draining, or free."""
        if block.node is not None:
            block.state = BlockState.EVICTABLE
            if self._busy(block):
                block.pinned = True
                self._wait_for_fence(block)
                return
            self._record_release(block)
            self.policy.release(block.node)
            self._num_reclaimable += 1
            if block.node.is_leaf:
                self.policy.add_candidate(block.node)
        elif self._busy(block):
            block.state = BlockState.DRAINING
            self._wait_for_fence(block)
        else:
            self._record_release(block)
            self._free(block)

    def _wait_for_fence(self, block: Block) -> None:
        heappush(self._draining, (self._busy_step(block), next(self._drain_seq), block))

    def _record_release(self, block: Block) -> None:
        """Record, once, how many steps had to finish between the block's release and its
        becoming reusable (0 when nothing in flight touched it)."""
        if block.released_at_fence >= 0:
            self.metrics.record_release(self.last_fence - block.released_at_fence)
            block.released_at_fence = -1

    def _free(self, block: Block) -> None:
        self.pool.free(block)
        self.metrics.frees += 1

    def _complete_write(self, entry: _Pending) -> None:
        """At its fence: a filled block is sealed, then published if it can be."""
        req, i = entry.req, entry.index
        block = req.table[i]
        if block.state is BlockState.WRITING:
            block.state = BlockState.SEALED
        if not self.enable_prefix_caching or block.state not in (
            BlockState.SEALED,
            BlockState.DRAINING,
        ):
            return
        if i == 0:
            parent = self.index.root(req.namespace, req.root_key, create=True)
        else:
            parent = req.table[i - 1].node
        if parent is None:  # the block before it is not indexed: keep the index prefix-closed
            return
        bs = self.block_size
        tokens = tuple(req.tokens[i * bs : (i + 1) * bs])
        extras = block_extras(req.mm_features, i * bs, (i + 1) * bs)
        key = req.keys[i]
        if key in parent.children:  # the same content was published first by another request
            return
        if not self.policy.admit(Node(-1, key, tokens, extras, parent, block, parent.depth + 1)):
            self.metrics.rejected += 1
            self.index.discard_root_if_empty(req.namespace)
            return
        node = self.index.insert(parent, key, tokens, extras, block)
        if self.event_sink is not None:
            parent_key = parent.key if parent.block is not None else None
            self.event_sink(BlockStored(key, parent_key, len(tokens)))
        self.policy.discard_candidate(parent)  # it is no longer a leaf
        block.node = node
        block.ref_cnt += 1
        self.metrics.published += 1
        self.policy.insert(node)
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
        parent = node.parent
        if block.state is BlockState.EVICTABLE and not block.pinned:
            self.policy.discard_candidate(node)
            self._num_reclaimable -= 1
        self.index.remove(node)
        self.policy.remove(node)
        if self.event_sink is not None:
            self.event_sink(BlockRemoved(node.key))
        block.node = None
        block.ref_cnt -= 1
        if block.ref_cnt == 0:
            block.pinned = False
            self._settle(block)
        else:  # held: indexed blocks are always fully written
            block.state = BlockState.SEALED
        if (
            parent is not None
            and parent.block is not None
            and parent.is_leaf
            and parent.block.state is BlockState.EVICTABLE
            and not parent.block.pinned
        ):
            self.policy.add_candidate(parent)
