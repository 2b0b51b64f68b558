"""SGLang's radix cache for a hybrid model (sliding window or Mamba), as a replay arm.

`SGLangHybridArm` is the `sglang-stock` / `sglang-kvplug` arm (`kvplug.replay.arms.sglang`:
SGLang 0.5.23's `UnifiedRadixCache`, Python tree core, ``page_size=1``, KV cache events on,
driven as SGLang's scheduler drives it) for a model described by a `HybridSpec`: the tree
gets SGLang's ``SWA`` or ``MAMBA`` component next to ``FULL``, over the pools SGLang builds
for that model type, as the test kit ``sglang.test.kits.unified_radix_cache`` builds them:

- sliding window: `SWAKVPool` with `SWATokenToKVPoolAllocator` (every token takes a full
  slot and an SWA slot) and a `ReqToTokenPool`;
- Mamba: `HybridReqToTokenPool` (its Mamba state pool; every running request holds one
  state) with `HybridLinearKVPool` and a `TokenToKVPoolAllocator` for the full layers.

The pools hold one layer of head size 1 (the tensors are irrelevant; only slot counts
matter). A model with both SWA and Mamba groups is refused (no preset has one).

``kvplug=False``: SGLang's own components and eviction strategy `policy` (``lru``, ...).
``kvplug=True``: the cache ``--radix-cache-backend kvplug`` builds
(`kvplug.sglang.backend.build_cache`: kvplug's tree core and its FULL / SWA / Mamba
components), ranked by kvplug's policy `policy` with `policy_config`.

Units. One replay unit (a trace block of `block_tokens` tokens) is one SGLang token.

Sliding window. SGLang's SWA match validator (`SWAComponent.create_match_validator`)
accepts a hit ending at position ``k`` only if the ``sliding_window_size`` tokens just
before ``k`` (``[k - W, k)``) all hold SWA state, or the whole path from the root does
(``k < W``). kvplug's rule is that a hit at ``k`` needs the `window_units` units before
``k`` (`StateGroup.window_units`: the units covering the ``window - 1`` tokens before the
first computed token). So SGLang's ``sliding_window_size`` is set to
``window_units(block_tokens)`` units (2 for a 1024-token window in 512-token blocks).

Pool sizes. `capacity_bytes` is split as SGLang's memory configurator splits the KV
memory, with its defaults:

- sliding window (`pool_configurator`, ``--swa-full-tokens-ratio`` default 0.8): the
  SWA pool holds ``0.8`` times as many tokens as the full pool, so
  ``full = capacity // (full_unit + 0.8 * swa_unit)`` and ``swa = int(0.8 * full)``,
  ``full_unit`` / ``swa_unit`` being `HybridSpec.kind_unit_bytes` of every full /
  sliding-window group together;
- Mamba (`kv_cache_configurator`, ``--mamba-full-memory-ratio`` default 0.9,
  ``--max-mamba-cache-size`` unset): ``0.9 / 1.9`` of the memory goes to Mamba states,
  ``states = capacity * 0.9 / 1.9 // state`` (one state is every Mamba group's
  ``checkpoint_bytes`` together), the rest to the full pool in units. SGLang's extra padding
  slot is not modelled.

Requests. `admit` does what the stock arm's does (``Req.init_next_round_input``, lock,
``alloc_req_slots``, ``alloc_token_slots``), with the hybrid's extra needs, all through
SGLang's own calls: ``alloc_req_slots`` reclaims a Mamba state for the request's running
state (``ensure_mamba_capacity``, evicting cached states through the tree), and the SWA
allocator evicts full and SWA slots for new tokens (``evict_to_free_tokens``). A prefill
holds SWA slots for its whole prompt (no chunked prefill). Once a request decodes, SGLang
slides its window (``ScheduleBatch.maybe_evict_swa`` from the second decode step on, every
``SGLANG_SWA_EVICTION_INTERVAL`` = 128 tokens, less than a unit): its SWA slots before the
last ``window`` units are freed (``tree_cache.evict_sliding_windows``). The arm does that
after every `grow`, and in `finish` when the request generated at least two tokens; the
tokens whose SWA was freed are inserted as SWA tombstones, so a later request can hit
such a request's prefix only at its end (or where another request refilled the SWA).
The admission check is every pool's free plus evictable size (full, SWA, Mamba states,
request rows) once the prefix is locked; None changes nothing but the match's recency, as
in the stock arm. `finish` is SGLang's ``release_kv_cache(req, tree_cache,
checkpoint=True)``: the tree inserts the request's held tokens and, for Mamba, its final
state at its last held position. That is SGLang's ``no_buffer`` Mamba strategy, so no
state is kept at intermediate positions. (SGLang's ``--mamba-radix-cache-strategy auto``
picks ``extra_buffer`` instead when the overlap scheduler is on and the model supports it;
that strategy's state tracking is done by the model runner during the forward pass, which
the arm does not run, so it is not modelled.)

Hits. `admit` returns ``req.prefix_len``, SGLang's ``device_prefix_len``: the longest
prefix every component accepts (the junction). SGLang's `MatchResult` also carries
``full_kv_hit_length``, the full-attention match alone, but no per-component length for
SWA or Mamba alone, so `group_hits` reports ``full_kv_hit_length`` as
``"full_attention"`` and the junction as ``"sliding_window"`` / ``"mamba"``.

`stats` comes from SGLang's KV events as in the stock arm (full-attention units);
`bytes_held` is every component's evictable (cached, unlocked) size times its bytes.
"""

from __future__ import annotations

from array import array
from functools import cache
from typing import TYPE_CHECKING, Any

from kvplug.core.groups import GroupKind
from kvplug.errors import UnknownPolicyError
from kvplug.replay.arms.sglang import (
    DEFAULT_MAX_RUNNING_REQUESTS,
    SUPPORTED_SGLANG_VERSION,
    EventLedger,
    SGLangStockArm,
    _check_native_hash,
    check_sglang,
    sglang_policies,
)

if TYPE_CHECKING:
    from sglang.srt.managers.schedule_batch import Req

    from kvplug.hybrid.spec import HybridSpec

SWA_FULL_TOKENS_RATIO = 0.8  # SGLang's --swa-full-tokens-ratio default
MAMBA_FULL_MEMORY_RATIO = 0.9  # SGLang's --mamba-full-memory-ratio default


@cache
def _hybrid_context() -> Any:
    """SGLang's runtime configuration for a CPU scheduler (the stock arm's), with the
    Mamba chunk size preset as SGLang's test kit presets it: the dummy model has no HF
    config to derive it from (SGLang's `MambaComponent` reads it at construction; without
    ``--enable-mamba-extra-buffer`` it does not change what is cached at page size 1)."""
    from sglang.kernels.ops.attention.fla.chunk_delta_h import CHUNK_SIZE
    from sglang.srt.runtime_context import create_context
    from sglang.srt.server_args import ServerArgs

    args = ServerArgs(model_path="dummy", device="cpu")
    args._mamba_cache_chunk_size = CHUNK_SIZE
    return create_context(args, role="scheduler")


class SGLangHybridArm(SGLangStockArm):
    """SGLang's `UnifiedRadixCache` for the hybrid model `spec` in `capacity_bytes`
    (see the module doc)."""

    def __init__(
        self,
        spec: HybridSpec,
        capacity_bytes: int,
        block_tokens: int,
        policy: str = "lru",
        kvplug: bool = False,
        policy_config: dict | None = None,
        *,
        max_running_requests: int = DEFAULT_MAX_RUNNING_REQUESTS,
    ) -> None:
        prefix = "sglang-hybrid-kvplug" if kvplug else "sglang-hybrid-stock"
        check_sglang(prefix)
        if kvplug:
            from kvplug.policies import policy_class

            policy_class(policy)  # raises UnknownPolicyError listing kvplug's policies
        elif policy.lower() not in sglang_policies():
            raise UnknownPolicyError(
                f"unknown SGLang eviction policy {policy!r}; SGLang "
                f"{SUPPORTED_SGLANG_VERSION} accepts: {', '.join(sglang_policies())}"
            )
        kinds = spec.kinds()
        if GroupKind.FULL not in kinds:
            raise ValueError(f"{spec.name}: SGLang's hybrid caches need full-attention layers")
        if {GroupKind.SLIDING_WINDOW, GroupKind.MAMBA} <= kinds:
            raise ValueError(f"{spec.name}: sliding window and Mamba together are not served")
        self.name = f"{prefix}:{policy}"
        self.spec = spec
        self.block_tokens = block_tokens
        self.kvplug = kvplug
        self.policy_config = dict(policy_config or {})
        self.has_swa = GroupKind.SLIDING_WINDOW in kinds
        self.has_mamba = GroupKind.MAMBA in kinds
        self.unit_bytes = {
            kind: spec.kind_unit_bytes(kind, block_tokens) for kind in GroupKind if kind in kinds
        }
        full_unit = self.unit_bytes[GroupKind.FULL]
        self.swa_tokens = self.mamba_states = 0
        self.window = 0
        if self.has_swa:
            swa_unit = self.unit_bytes[GroupKind.SLIDING_WINDOW]
            self.full_tokens = int(capacity_bytes // (full_unit + SWA_FULL_TOKENS_RATIO * swa_unit))
            self.swa_tokens = int(self.full_tokens * SWA_FULL_TOKENS_RATIO)
            group = next(g for g in spec.groups if g.kind is GroupKind.SLIDING_WINDOW)
            self.window = max(1, group.window_units(block_tokens))
        elif self.has_mamba:
            state = self.unit_bytes[GroupKind.MAMBA]
            budget = capacity_bytes * MAMBA_FULL_MEMORY_RATIO / (1 + MAMBA_FULL_MEMORY_RATIO)
            self.mamba_states = int(budget // state)
            self.full_tokens = int((capacity_bytes - self.mamba_states * state) // full_unit)
        else:
            self.full_tokens = int(capacity_bytes // full_unit)
        if self.full_tokens < 1 or (self.has_swa and self.swa_tokens < 1):
            raise ValueError(f"capacity_bytes {capacity_bytes} holds no token of {spec.name}")
        if self.has_mamba and self.mamba_states < 1:
            raise ValueError(f"capacity_bytes {capacity_bytes} holds no Mamba state")
        rows = min(max_running_requests, self.full_tokens)
        if self.has_mamba:
            rows = min(rows, self.mamba_states)
        self._context = _hybrid_context()
        _check_native_hash()
        with self._sglang():
            self._build(rows, policy)
        self.requests: dict[int, Req] = {}
        self.group_hits: dict[str, int] = {kind.value: 0 for kind in self.unit_bytes}
        self._events = EventLedger()
        self._last_match: Any = None

    # ------------------------------------------------------------------ building

    def _build(self, rows: int, policy: str) -> None:
        import torch
        from sglang.srt.mem_cache.allocator import TokenToKVPoolAllocator
        from sglang.srt.mem_cache.cache_init_params import CacheInitParams
        from sglang.srt.mem_cache.memory_pool import ReqToTokenPool
        from sglang.srt.mem_cache.unified_cache.component_type import ComponentType

        dtype, columns = torch.bfloat16, self.full_tokens
        components = [ComponentType.FULL]
        if self.has_swa:
            from sglang.srt.mem_cache.allocator.swa import SWATokenToKVPoolAllocator
            from sglang.srt.mem_cache.swa_memory_pool import SWAKVPool

            kv = SWAKVPool(
                size=self.full_tokens,
                size_swa=self.swa_tokens,
                page_size=1,
                dtype=dtype,
                head_num=1,
                head_dim=1,
                swa_attention_layer_ids=[0],
                full_attention_layer_ids=[1],
                device="cpu",
            )
            self.allocator = SWATokenToKVPoolAllocator(
                size=self.full_tokens,
                size_swa=self.swa_tokens,
                page_size=1,
                dtype=dtype,
                device="cpu",
                kvcache=kv,
                need_sort=False,
            )
            self.req_to_token_pool = ReqToTokenPool(
                size=rows, max_context_len=columns, device="cpu", enable_memory_saver=False
            )
            components.append(ComponentType.SWA)
        elif self.has_mamba:
            from sglang.srt.configs.mamba_utils import Mamba2CacheParams, Mamba2StateShape
            from sglang.srt.mem_cache.memory_pool import HybridLinearKVPool, HybridReqToTokenPool

            shape = Mamba2StateShape.create(
                tp_world_size=1,
                intermediate_size=16,
                n_groups=1,
                num_heads=1,
                head_dim=16,
                state_size=1,
                conv_kernel=2,
            )
            self.req_to_token_pool = HybridReqToTokenPool(
                size=rows,
                mamba_size=self.mamba_states,
                mamba_spec_state_size=rows,
                max_context_len=columns,
                device="cpu",
                enable_memory_saver=False,
                cache_params=Mamba2CacheParams(shape=shape, layers=[0]),
                mamba_layer_ids=[0],
                enable_mamba_extra_buffer=False,
                speculative_num_draft_tokens=3,
            )
            kv = HybridLinearKVPool(
                size=self.full_tokens,
                dtype=dtype,
                page_size=1,
                head_num=1,
                head_dim=1,
                full_attention_layer_ids=[1],
                device="cpu",
                enable_memory_saver=False,
                mamba_pool=self.req_to_token_pool.mamba_pool,
            )
            self.allocator = TokenToKVPoolAllocator(
                self.full_tokens, dtype, "cpu", kvcache=kv, need_sort=False
            )
            components.append(ComponentType.MAMBA)
        else:
            self.allocator = TokenToKVPoolAllocator(
                self.full_tokens, dtype, "cpu", kvcache=None, need_sort=False
            )
            self.req_to_token_pool = ReqToTokenPool(
                size=rows, max_context_len=columns, device="cpu", enable_memory_saver=False
            )
        params = CacheInitParams(
            disable=False,
            req_to_token_pool=self.req_to_token_pool,
            token_to_kv_pool_allocator=self.allocator,
            page_size=1,
            eviction_policy=policy,
            enable_kv_cache_events=True,
            tree_components=tuple(components),
            tree_core_backend="python",
            sliding_window_size=self.window if self.has_swa else None,
        )
        if self.kvplug:
            from kvplug.config import KVPlugConfig
            from kvplug.sglang.backend import build_cache

            config = KVPlugConfig(policy=policy, policy_config=self.policy_config)
            self.cache = build_cache(params, config)
        else:
            from sglang.srt.mem_cache.unified_radix_cache import UnifiedRadixCache

            self.cache = UnifiedRadixCache(params)
        # The scheduler's match goes through `match_prefix`; keep its result for the
        # per-component hit lengths (an instance attribute: the class is untouched).
        match = self.cache.match_prefix

        def recording_match(params: Any) -> Any:
            self._last_match = match(params)
            return self._last_match

        self.cache.match_prefix = recording_match

    # ------------------------------------------------------------------ arm calls

    def admit(self, req_id: int, prompt: list[int], compute: int) -> int | None:
        from sglang.srt.managers.schedule_batch import Req
        from sglang.srt.mem_cache.allocation import alloc_req_slots, alloc_token_slots
        from sglang.srt.sampling.sampling_params import SamplingParams

        if req_id in self.requests:
            raise ValueError(f"request {req_id} is already running")
        if not 1 <= compute <= len(prompt):
            raise ValueError(f"compute must be in [1, len(prompt) = {len(prompt)}], got {compute}")
        with self._sglang():
            req = Req(str(req_id), "", array("q", prompt), SamplingParams())
            self._last_match = None
            req.init_next_round_input(self.cache)
            hits = req.prefix_len
            full_hit = hits
            if self._last_match is not None:
                full_hit = max(hits, int(self._last_match.full_kv_hit_length))
            held = max(hits, compute)
            req.lock = self.cache.lock(req.last_node)
            if not self._fits(held - hits, new_request=True):
                self.cache.unlock(req.lock)
                return None
            alloc_req_slots(self.req_to_token_pool, [req], self.cache)
            row = req.kv.req_pool_idx
            self.req_to_token_pool.write(
                (row, slice(0, hits)), self.cache.prefix_device_indices(req)
            )
            self.req_to_token_pool.write(
                (row, slice(hits, held)), alloc_token_slots(self.cache, held - hits)
            )
            req.kv.kv_allocated_len = req.kv.kv_committed_len = held
        self.requests[req_id] = req
        self.group_hits[GroupKind.FULL.value] += full_hit
        for kind in self.group_hits:
            if kind != GroupKind.FULL.value:
                self.group_hits[kind] += hits
        self._events.drain(self.cache)
        self._events.record_hits(prompt[:hits])
        return hits

    def bytes_held(self) -> int:
        """Bytes of cached, unlocked state: each component's evictable size (full and SWA
        in tokens, Mamba in states) times its bytes per unit."""
        from sglang.srt.mem_cache.unified_cache.component_type import ComponentType

        tree = self.cache.tree_core
        held = tree.component_evictable_size(ComponentType.FULL) * self.unit_bytes[GroupKind.FULL]
        if self.has_swa:
            swa = tree.component_evictable_size(ComponentType.SWA)
            held += swa * self.unit_bytes[GroupKind.SLIDING_WINDOW]
        if self.has_mamba:
            held += (
                tree.component_evictable_size(ComponentType.MAMBA)
                * self.unit_bytes[GroupKind.MAMBA]
            )
        return int(held)

    # ------------------------------------------------------------------ helpers

    def _fits(self, units: int, *, new_request: bool = False) -> bool:
        """Whether SGLang's allocations succeed: `units` full (and SWA) slots from free
        plus evictable ones; a new request also needs a request row and, with Mamba, its
        running state (plus SGLang's tracking slots) from free plus evictable states."""
        from sglang.srt.mem_cache.unified_cache.component_type import ComponentType

        tree = self.cache.tree_core
        if self.has_swa:
            full_free = self.allocator.full_available_size()
            swa_free = self.allocator.swa_available_size()
            swa_evictable = tree.component_evictable_size(ComponentType.SWA)
            if units > swa_free + swa_evictable:
                return False
        else:
            full_free = self.allocator.available_size()
        if units > full_free + tree.component_evictable_size(ComponentType.FULL):
            return False
        if not new_request:
            return True
        if not self.req_to_token_pool.available_size():
            return False
        if self.has_mamba:
            pool = self.req_to_token_pool
            needed = 1 + pool.mamba_initial_tracking_slots
            free = pool.mamba_allocator.schedulable_available_size()
            if needed > free + tree.component_evictable_size(ComponentType.MAMBA):
                return False
        return True

    def _after_step(self, req: Req, finished_output: int | None = None) -> None:
        """Free the request's SWA slots outside its window, as the scheduler's next step
        does (``ScheduleBatch.maybe_evict_swa``): after each decode step, and at the end
        of a request that decoded past its first step."""
        if self.has_swa and (finished_output is None or finished_output >= 2):
            self.cache.evict_sliding_windows(req, req.kv.kv_allocated_len)


__all__ = ["MAMBA_FULL_MEMORY_RATIO", "SWA_FULL_TOKENS_RATIO", "SGLangHybridArm"]
