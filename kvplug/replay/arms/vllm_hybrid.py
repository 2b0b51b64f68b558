"""The hybrid `vllm-stock` arm: vLLM's own KV-cache manager for a hybrid model's state groups.

This is `kvplug.replay.arms.vllm.VLLMStockArm` for a model with more than one kind of
layer (`kvplug.hybrid.spec.HybridSpec`). What runs is the installed vLLM's code: a
`vllm.v1.core.kv_cache_manager.KVCacheManager` with prefix caching on, given a
`KVCacheConfig` with one `KVCacheGroupSpec` per `StateGroup`, so vLLM builds its own
`HybridKVCacheCoordinator`, one single-type manager per group and one `BlockPool` that
pages every group. Given a kvplug `policy`, it is the ``vllm-kvplug:<policy>`` arm: the
same manager built by `build_kvplug_manager`, with kvplug's `KVPlugBlockPool` choosing the
evictions.

One unit is one trace block of ``block_tokens`` tokens; vLLM sees it as one token, with
``block_size=1`` (and ``hash_block_size=1``, ``scheduler_block_size=1``) for every group.
Each group maps to one vLLM spec:

- full attention -> `FullAttentionSpec` (`FullAttentionManager`): a hit needs every block
  before it;
- sliding window -> `SlidingWindowSpec` with ``sliding_window = window_units + 1``, so that
  vLLM's ``cdiv(sliding_window - 1, block_size)``, the contiguous blocks a hit needs, is
  the window in units (`StateGroup.window_units`). `SlidingWindowManager.
  remove_skipped_blocks` frees a running request's blocks outside the window (at its
  next `allocate_slots`); freed blocks keep their hash, so they still serve hits until the
  pool evicts them;
- Mamba -> `MambaSpec` with ``mamba_cache_mode="align"``, what ``vllm serve`` uses by
  default for a hybrid Mamba model: prefix caching is on by default for generative hybrid
  models (`ModelConfig.is_prefix_caching_supported`), and with it
  `MambaModelConfig.verify_and_update_config` turns the default ``"none"`` into
  ``"align"`` and sets ``mamba_block_size`` to the attention block size (vLLM 0.32 has
  no ``"all"`` mode; it sets ``"none"`` only with prefix caching off).
  In align mode a request holds one state block (two across a step boundary): the state
  after the last token of each scheduler step, when that step ends on a block boundary.
  Every such block is cached under the hash of the prefix it ends; the states in between
  are never materialised (null blocks). `MambaManager.find_longest_cache_hit` serves the
  rightmost cached state, so a Mamba group hits only at a position where an earlier
  request ended a step: the end of its prefill or of a decode step, or a split the
  scheduler forced (below). A request sharing only part of an earlier prompt gets no
  Mamba hit, so the hybrid hit is 0 even where the full-attention group has the prefix.

Layer shapes are irrelevant to the manager (only ``block_size`` matters); the pool has
``capacity_bytes // spec.page_bytes(block_tokens)`` usable blocks plus block 0, vLLM's
null block: every group's block costs the same page, the largest group's, as in vLLM's
uniform-page hybrid allocator.

How each arm call maps to what `vllm.v1.core.sched.scheduler.Scheduler` does (as in
`VLLMStockArm`, with these additions):

- each `allocate_slots` is one scheduler step, so `KVCacheManager.new_step_starts` runs
  before it (Mamba defers a hit on a state cached in the same step);
- `admit`: `get_computed_blocks` gives the hybrid hit (the *junction*: the longest length
  every group can serve, found by the coordinator's fixed-point search) and the
  shared-prefix boundary, which is stored on the request as the scheduler does. With a
  Mamba group in align mode the scheduler splits prefill with
  `Scheduler._mamba_block_aligned_split` (called here on a stand-in scheduler with this
  arm's settings): a chunk stops at the last block boundary before ``num_tokens - 1``
  (so a resend of the prompt finds a state) and at the shared-prefix boundary (where the
  full-attention hit ran past the junction; Marconi-style, so a later sibling finds the
  state there). Each chunk is one `allocate_slots`. The first is given
  ``reserved_blocks`` for the later ones (one block per attention group per token, one
  per Mamba group per chunk; an upper bound, exact but for blocks the later chunks free),
  so a refused admission changes nothing and an accepted one always completes, where
  vLLM could admit and then preempt mid-prefill;
- `grow`: one decode step (all `units` in one `allocate_slots`);
- `stats`: KV events, as in `VLLMStockArm`, but with several groups a block hash is cached
  once per group and the events carry ``group_idx``: evictions and churn count per
  ``(group, hash)``. `cached_blocks` is the size of `BlockPool.cached_block_hash_to_block`
  (one entry per group block).

`group_hits` sums, over successful admissions, the units each group kind could serve
alone: each group's own manager class looks the request up (`find_longest_cache_hit` with
the coordinator's maximum length and alignment) for that group only, and a kind takes the
minimum over its groups. The junction never exceeds any group's own hit (asserted).

Sequential mode gives the engine ``prompt + sentinel`` and computes the prompt. For a
Mamba group the step then ends at the prompt's last unit, so the state is cached there
only: a trace prompt whose last unit is a fresh partial block leaves no state a resend can
match (in tokens, vLLM would also stop at the last full block). The realistic mode
computes the whole prompt without a sentinel, so the split at ``num_tokens - 1`` caches
the state at the end of the last full block.
"""

from __future__ import annotations

from types import SimpleNamespace
from typing import TYPE_CHECKING

from kvplug.core.groups import GroupKind
from kvplug.replay.arms.base import ArmStats, CacheArm
from kvplug.replay.arms.vllm import (
    HASH_ALGORITHM,
    MAX_MODEL_LEN,
    _drop_last_tokens,
    build_manager,
    check_vllm,
    make_request,
)

if TYPE_CHECKING:
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.kv_cache_interface import KVCacheSpec
    from vllm.v1.request import Request

    from kvplug.hybrid.spec import HybridSpec, StateGroup
    from kvplug.policies.base import EvictionPolicy

MAMBA_CACHE_MODE = "align"  # vllm serve's default for a Mamba hybrid with prefix caching


def vllm_group_spec(group: StateGroup, block_tokens: int) -> KVCacheSpec:
    """The vLLM spec for one state group, one unit per block (shapes are irrelevant)."""
    import torch
    from vllm.v1.kv_cache_interface import FullAttentionSpec, MambaSpec, SlidingWindowSpec

    shape = dict(block_size=1, num_kv_heads=1, head_size=1, dtype=torch.float16)
    if group.kind is GroupKind.FULL:
        return FullAttentionSpec(**shape)
    if group.kind is GroupKind.SLIDING_WINDOW:
        return SlidingWindowSpec(**shape, sliding_window=group.window_units(block_tokens) + 1)
    if group.kind is GroupKind.MAMBA:
        return MambaSpec(
            block_size=1,
            shapes=((1,),),
            dtypes=(torch.float16,),
            mamba_cache_mode=MAMBA_CACHE_MODE,
        )
    raise ValueError(f"no vLLM spec for state group kind {group.kind!r}")


class VLLMHybridArm(CacheArm):
    """vLLM's `KVCacheManager` for `spec`'s groups in ``capacity_bytes`` of blocks.

    Given a kvplug `policy`, it is the ``vllm-kvplug:<policy>`` arm instead: the same vLLM
    manager with kvplug's `KVPlugBlockPool` choosing the evictions.
    """

    name = "vllm-stock"

    def __init__(
        self,
        spec: HybridSpec,
        capacity_bytes: int,
        block_tokens: int,
        policy: EvictionPolicy | None = None,
    ) -> None:
        check_vllm()
        from vllm.utils.hashing import get_hash_fn_by_name
        from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash
        from vllm.v1.kv_cache_interface import KVCacheConfig, KVCacheGroupSpec

        self.spec = spec
        self.block_tokens = block_tokens
        self.page_bytes = spec.page_bytes(block_tokens)
        num_blocks = capacity_bytes // self.page_bytes + 1  # block 0 is the null block
        if num_blocks - 1 < 1:
            raise ValueError(
                f"capacity_bytes {capacity_bytes} holds no block of {self.page_bytes} bytes "
                f"({spec.name}, {block_tokens} tokens per block)"
            )
        self.capacity_blocks = num_blocks - 1
        groups = [
            KVCacheGroupSpec(
                layer_names=[f"layer.{i}.{j}" for j in range(group.layers)],
                kv_cache_spec=vllm_group_spec(group, block_tokens),
            )
            for i, group in enumerate(spec.groups)
        ]
        config = KVCacheConfig(num_blocks=num_blocks, kv_cache_tensors=[], kv_cache_groups=groups)
        self.manager = build_manager(config, policy)
        if policy is not None:
            self.name = f"vllm-kvplug:{policy.name}"
        self.kinds = [group.kind for group in spec.groups]
        self.group_hits: dict[str, int] = {kind.value: 0 for kind in dict.fromkeys(self.kinds)}
        # Blocks a later prefill chunk can take: one per attention group per token, one
        # per Mamba group per chunk.
        self._attention_groups = sum(kind is not GroupKind.MAMBA for kind in self.kinds)
        self._mamba_groups = len(self.kinds) - self._attention_groups
        self._split_scheduler = split_scheduler() if self._mamba_groups else None
        hash_fn = get_hash_fn_by_name(HASH_ALGORITHM)
        init_none_hash(hash_fn)
        self._block_hasher = get_request_block_hasher(1, hash_fn)
        from vllm.sampling_params import SamplingParams

        self._sampling_params = SamplingParams(max_tokens=MAX_MODEL_LEN)
        self._requests: dict[int, Request] = {}
        self._hits: dict[tuple[int | None, bytes | int], int] = {}  # (group, hash) -> hits
        self._evictions = 0
        self._churn = 0

    def admit(self, req_id: int, prompt: list[int], compute: int) -> int | None:
        from vllm.v1.request import RequestStatus

        if req_id in self._requests:
            raise ValueError(f"request {req_id} is already running")
        request = make_request(req_id, prompt, self._sampling_params, self._block_hasher)
        manager = self.manager
        manager.new_step_starts()
        hit_blocks, num_hits, request.shared_prefix_boundary = manager.get_computed_blocks(request)
        own = self.group_own_hits(request)
        assert all(num_hits <= hit for hit in own), (num_hits, own)
        num_new = max(compute - num_hits, 0)
        chunks = self._prefill_chunks(request, num_hits, num_new)
        first, later = (chunks[0], chunks[1:]) if chunks else (0, [])
        if first or num_hits:  # allocate_slots rejects a step with nothing in it
            reserve = sum(n * self._attention_groups + self._mamba_groups for n in later)
            allocated = manager.allocate_slots(
                request,
                first,
                num_new_computed_tokens=num_hits,
                new_computed_blocks=hit_blocks,
                full_sequence_must_fit=False,
                reserved_blocks=reserve,
            )
            if allocated is None:
                return None
        request.status = RequestStatus.RUNNING
        request.num_computed_tokens = num_hits + first
        for count in later:
            manager.new_step_starts()
            if manager.allocate_slots(request, count) is None:
                raise RuntimeError(
                    f"request {req_id}: a prefill chunk of {count} units did not fit in the "
                    "blocks reserved for it"
                )
            request.num_computed_tokens += count
        self._requests[req_id] = request
        for kind in self.group_hits:
            self.group_hits[kind] += min(
                hit for hit, k in zip(own, self.kinds, strict=True) if k.value == kind
            )
        self._record_hits(hit_blocks)
        self._drain_events()
        return num_hits

    def grow(self, req_id: int, units: list[int]) -> bool:
        request = self._requests[req_id]
        if not units:
            return True
        request.append_output_token_ids(list(units))
        self.manager.new_step_starts()
        if self.manager.allocate_slots(request, len(units)) is None:
            _drop_last_tokens(request, len(units))
            return False
        request.num_computed_tokens += len(units)
        self._drain_events()
        return True

    def finish(self, req_id: int, output_tokens: int = 0) -> None:
        request = self._requests.pop(req_id)
        request.kvplug_output_tokens = output_tokens  # a unit is a trace block, not a token
        self.manager.free(request)

    def stats(self) -> ArmStats:
        self._drain_events()
        return ArmStats(self._evictions, self._churn, self._cached_blocks())

    def bytes_held(self) -> int:
        """Bytes of the blocks the prefix cache holds (cached blocks times the page)."""
        return self._cached_blocks() * self.page_bytes

    def group_own_hits(self, request: Request) -> list[int]:
        """Units each group alone could serve `request` now: its manager class's own
        lookup, for that group only, with the maximum length and alignment that
        `get_computed_blocks` gives the hybrid coordinator."""
        coordinator = self.manager.coordinator
        max_length = request.num_tokens - 1
        hits = []
        for group_id, manager in enumerate(coordinator.single_type_managers):
            _, hit = type(manager).find_longest_cache_hit(
                block_hashes=request.block_hashes,
                max_length=max_length,
                kv_cache_group_ids=[group_id],
                block_pool=manager.block_pool,
                kv_cache_spec=manager.kv_cache_spec,
                drop_eagle_block=False,
                # a one-group model gets vLLM's unitary coordinator, aligned to blocks
                alignment_tokens=getattr(coordinator, "_cache_hit_alignment_tokens", 1),
            )
            hits.append(hit)
        return hits

    def _cached_blocks(self) -> int:
        return len(self.manager.block_pool.cached_block_hash_to_block)

    def _prefill_chunks(self, request: Request, start: int, count: int) -> list[int]:
        """The scheduler steps that compute `count` units after `start`."""
        return prefill_chunks(self._split_scheduler, request, start, count)

    def _record_hits(self, hit_blocks: KVCacheBlocks) -> None:
        from vllm.v1.core.kv_cache_utils import (
            get_block_hash,
            get_group_id,
            maybe_convert_block_hash,
        )

        for blocks in hit_blocks.blocks:
            for block in blocks:
                if block.is_null or block.block_hash is None:
                    continue  # a sliding-window or Mamba position the hit skips
                key = (
                    get_group_id(block.block_hash),
                    maybe_convert_block_hash(get_block_hash(block.block_hash)),
                )
                self._hits[key] = self._hits.get(key, 0) + 1

    def _drain_events(self) -> None:
        from vllm.distributed.kv_events import BlockRemoved, BlockStored

        for event in self.manager.take_events():
            if isinstance(event, BlockStored):
                for key in event.block_hashes:
                    self._hits.setdefault((event.group_idx, key), 0)
            elif isinstance(event, BlockRemoved):
                for key in event.block_hashes:
                    self._evictions += 1
                    # vLLM may cache two blocks under one hash; the hits are per hash.
                    self._churn += self._hits.pop((event.group_idx, key), 0) == 0


def prefill_chunks(
    split_scheduler: SimpleNamespace | None, request: Request, start: int, count: int
) -> list[int]:
    """The scheduler steps that compute `count` units of `request` after `start`: one, or,
    with Mamba in align mode (from `split_scheduler`), the chunks
    vLLM's `Scheduler._mamba_block_aligned_split` cuts."""
    if not count:
        return []
    if split_scheduler is None:
        return [count]
    from vllm.v1.core.sched.scheduler import Scheduler

    chunks = []
    while count:
        # The split reads the start as num_computed_tokens + local hits.
        step = Scheduler._mamba_block_aligned_split(split_scheduler, request, count, start, 0)
        assert step > 0, "vLLM's Mamba split left a prefill chunk empty"
        chunks.append(step)
        start += step
        count -= step
    return chunks


def split_scheduler() -> SimpleNamespace:
    """What `Scheduler._mamba_block_aligned_split` reads of its scheduler, as vLLM's
    `Scheduler.__init__` sets it for this arm's manager: block and hash size 1, no EAGLE,
    no fine-grained (partial) hits, no prefill checkpoint blocks, no chunk-size limit
    (one step computes the whole rest of the prompt, as in `VLLMStockArm`)."""
    return SimpleNamespace(
        cache_config=SimpleNamespace(block_size=1),
        block_size=1,
        hash_block_size=1,
        use_eagle_block_drop=False,
        num_hash_lookahead_tokens=0,  # read from vLLM 0.33 on
        mamba_partial_cache_hit=False,
        mamba_has_prefill_checkpoint_blocks=False,
        mamba_prefill_checkpoint_alignment=None,
        mamba_shared_prefix_checkpoint=False,
        max_num_scheduled_tokens=MAX_MODEL_LEN,
        scheduler_config=SimpleNamespace(long_prefill_token_threshold=0),
    )


__all__ = ["MAMBA_CACHE_MODE", "VLLMHybridArm", "vllm_group_spec"]
