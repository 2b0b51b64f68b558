"""vLLM's KV cache manager with kvplug's pool: the one place it is built.

vLLM's KV cache coordinator constructs the block pool itself, with vLLM's own
arguments. `kvplug_classes` rebinds, for the duration of one construction and under a
lock, the two names vLLM looks up: `BlockPool` in the coordinator module (so the pool
built is the class that serves the policy, chosen by `pool_class`, given the policy) and
`KVCacheManager` in the scheduler module (so the scheduler builds a
`KVPlugKVCacheManager`, or with a KV connector a `ConnectorKVCacheManager`).
`attach_policy` then gives the pool its policy. The scheduler (`kvplug.vllm.scheduler`)
and the replay's ``vllm-kvplug`` arm (`build_kvplug_manager`) both go through these two
functions.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import threading
from collections.abc import Iterator
from typing import Any

from vllm.utils.math_utils import cdiv
from vllm.v1.core import kv_cache_coordinator
from vllm.v1.core.kv_cache_manager import KVCacheManager
from vllm.v1.core.sched import scheduler as vllm_scheduler
from vllm.v1.kv_cache_interface import FullAttentionSpec, MambaSpec, SlidingWindowSpec

from kvplug.core.groups import GroupKind
from kvplug.core.sessions import SESSION_ARG, names_session
from kvplug.policies.base import EvictionPolicy
from kvplug.vllm.block_pool import KVPlugBlockPool, pool_class
from kvplug.vllm.stats import PoolStats

_swap_lock = threading.Lock()
logger = logging.getLogger(__name__)
# vLLM's spec classes kvplug maps to state-group kinds (exact types: subclasses such as
# chunked local attention or cross attention have other hit rules)
SPEC_KINDS = {
    FullAttentionSpec: GroupKind.FULL,
    SlidingWindowSpec: GroupKind.SLIDING_WINDOW,
    MambaSpec: GroupKind.MAMBA,
}


def request_names_session(request: Any, stats: PoolStats) -> bool:
    """Whether `request` names a session (`kvplug.core.sessions`): ``kvplug_session`` in
    its ``SamplingParams.extra_args`` (``vllm_xargs``; the plugin copies the OpenAI
    ``user`` field there), decided and counted once per request (a preempted request is
    freed again)."""
    named = getattr(request, "kvplug_session", None)
    if named is None:
        params = request.sampling_params
        extra = (getattr(params, "extra_args", None) or {}) if params is not None else {}
        asked = extra.get(SESSION_ARG)
        named = names_session(asked, None, stats, request.request_id, logger)
        request.kvplug_session = named
    return named


def matched_tokens(request: Any) -> int:
    """Prompt tokens its first prefill found in the prefix cache (0 if never scheduled)."""
    return getattr(request, "kvplug_matched_tokens", 0)


class KVPlugKVCacheManager(KVCacheManager):
    """vLLM's KV cache manager; it notes each request's prefix hit and tells the pool
    which request is releasing blocks.

    The pool counts a touch as a prefix hit only inside the call where vLLM's
    single-type managers take a request's cached blocks (`HIT_TOUCH`, wrapped on each
    manager instance): any other touch is another tier holding blocks while it copies
    them out. Wrapping that call, made once per admitted request, costs nothing on the
    calls made for every scheduled request (``allocate_slots``)."""

    block_pool: KVPlugBlockPool

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        for manager in self.coordinator.single_type_managers:
            _count_hits_in(manager, self.block_pool)

    def get_computed_blocks(self, request: Any, *args: Any, **kwargs: Any) -> Any:
        # (blocks, hit tokens, shared prefix boundary): with a sliding-window group, the
        # boundary is the full-attention hit when it is longer than the junction (vLLM's
        # "uncached common prefix"), else 0: where `request` leaves the cached tree, a
        # position later requests may resume at (`kvplug_branch`, an anchor)
        # (vLLM 0.33+ passes a max_cache_hit_length on)
        result = super().get_computed_blocks(request, *args, **kwargs)
        if request.num_output_tokens == 0:  # its first prefill, not a resume
            request.kvplug_matched_tokens = result[1]
            request.kvplug_branch = result[2]
        return result

    def free(self, request: Any) -> None:
        pool = self.block_pool
        if not pool.tracked:  # lru: nothing is ranked, so nothing to tell
            super().free(request)
            return
        rules = pool.rules
        if rules is not None and rules.windows:  # the request's end: an anchor
            managers, request_id = self.coordinator.single_type_managers, request.request_id
            anchored: list[Any] = []
            for group, window in rules.windows.items():
                manager = managers[group]
                blocks = manager.req_to_blocks.get(request_id)
                if blocks:
                    end = manager.num_cached_block.get(request_id, 0)
                    anchored += blocks[max(end - window, 0) : end]
            if anchored:
                rules.anchor(anchored)
        # its output is its output tokens, or ``kvplug_output_tokens`` where a caller
        # whose tokens are not model tokens sets it (the replay: a unit is a trace block)
        # (set on the pool's one `Release` and reset after, not a new one per request)
        output = getattr(request, "kvplug_output_tokens", None)
        releasing = pool.releasing
        releasing.output_tokens = request.num_output_tokens if output is None else output
        releasing.request_hit = matched_tokens(request) > 0
        releasing.session = request_names_session(request, pool.stats)
        try:
            super().free(request)
        finally:
            releasing.output_tokens, releasing.request_hit, releasing.session = 0, False, False


class ConnectorKVCacheManager(KVPlugKVCacheManager):
    """The manager of a scheduler with a KV connector (an offload tier, LMCache): the
    blocks that hold a connector's external tokens were loaded from another tier, which
    keeps its copy, so the pool values them as a reload (`mark_held_elsewhere`)."""

    def allocate_slots(self, request: Any, *args: Any, **kwargs: Any) -> Any:
        # vLLM's scheduler passes the external tokens by keyword; they follow the local hit
        result = super().allocate_slots(request, *args, **kwargs)
        external = kwargs.get("num_external_computed_tokens", 0)
        if external and result is not None:
            local = request.num_computed_tokens + kwargs.get("num_new_computed_tokens", 0)
            manager = self.coordinator.single_type_managers[0]
            blocks = manager.req_to_blocks[request.request_id]
            size = manager.block_size
            self.block_pool.mark_held_elsewhere(blocks[local // size : (local + external) // size])
        return result


# the single-type manager call that touches a request's prefix hits (vLLM 0.32-0.34)
HIT_TOUCH = "add_local_computed_blocks"


def _count_hits_in(manager: Any, pool: KVPlugBlockPool) -> None:
    """While `manager` takes a request's cached blocks, `pool` counts its touches as hits."""
    taking = getattr(manager, HIT_TOUCH, None)
    if taking is None:
        raise RuntimeError(
            f"kvplug: vLLM's {type(manager).__name__} has no {HIT_TOUCH}: this vLLM release "
            "takes prefix hits in a call kvplug does not know (kvplug.vllm.version lists "
            "the releases it supports)"
        )

    @functools.wraps(taking)
    def counting_hits(*args: Any, **kwargs: Any) -> Any:
        pool.touch_counts_hits = True
        try:
            return taking(*args, **kwargs)
        finally:
            pool.touch_counts_hits = False

    setattr(manager, HIT_TOUCH, counting_hits)


def manager_class(connector: bool) -> type[KVPlugKVCacheManager]:
    """kvplug's manager class for a scheduler with a KV `connector` or without one."""
    return ConnectorKVCacheManager if connector else KVPlugKVCacheManager


@contextlib.contextmanager
def kvplug_classes(
    policy: EvictionPolicy, connector: bool = False, kv_cache_config: Any = None
) -> Iterator[None]:
    """While open, vLLM builds kvplug's pool (the class that serves `policy` on the model
    of `kv_cache_config`, with it) and manager classes in place of its own
    (`manager_class`)."""
    kinds = group_kinds(kv_cache_config) if kv_cache_config is not None else None
    swaps = [
        (
            kv_cache_coordinator,
            "BlockPool",
            functools.partial(pool_class(policy, kinds), policy=policy),
        ),
        (vllm_scheduler, "KVCacheManager", manager_class(connector)),
    ]
    with _swap_lock:
        originals = [getattr(module, name) for module, name, _ in swaps]
        for module, name, replacement in swaps:
            setattr(module, name, replacement)
        try:
            yield
        finally:
            for (module, name, _), original in zip(swaps, originals, strict=True):
                setattr(module, name, original)


def tree_groups(kv_cache_config: Any) -> set[int]:
    """The KV cache groups whose hits need every block before them (full attention)."""
    groups = kv_cache_config.kv_cache_groups
    return {i for i, group in enumerate(groups) if type(group.kv_cache_spec) is FullAttentionSpec}


def group_kinds(kv_cache_config: Any) -> dict[int, GroupKind]:
    """Each KV cache group's kind, for a hybrid model (groups of more than one kind);
    empty for a single-kind model, or, with one warning naming them, when a group's spec
    is one kvplug cannot map: vLLM's own coordinator then decides hits as always, and
    kvplug ranks each block on its own."""
    specs = [type(group.kv_cache_spec) for group in kv_cache_config.kv_cache_groups]
    unknown = sorted({spec.__name__ for spec in specs if spec not in SPEC_KINDS})
    if unknown:
        logger.warning(
            "kvplug: KV cache groups of type %s have no cross-group rule in kvplug (it maps "
            "%s); each block is ranked on its own under vLLM's coordinator",
            ", ".join(unknown),
            ", ".join(spec.__name__ for spec in SPEC_KINDS),
        )
        return {}
    kinds = {i: SPEC_KINDS[spec] for i, spec in enumerate(specs)}
    return kinds if len(set(kinds.values())) > 1 else {}


def windows(kv_cache_config: Any) -> dict[int, int]:
    """Each sliding-window group's window in its blocks: the blocks a hit needs before it
    (vLLM's ``cdiv(sliding_window - 1, block_size)``)."""
    found = {}
    for i, group in enumerate(kv_cache_config.kv_cache_groups):
        spec = group.kv_cache_spec
        if type(spec) is SlidingWindowSpec:
            found[i] = cdiv(spec.sliding_window - 1, spec.block_size)
    return found


def attach_policy(
    manager: KVPlugKVCacheManager, policy: EvictionPolicy, kv_cache_config: Any
) -> PoolStats:
    """Give the manager's pool `policy`; returns the statistics the pool counts into."""
    stats = PoolStats()
    # a touch outside a single-type manager's hit call is another tier holding blocks
    # while it copies them out (vLLM's offload connector), not a use
    manager.block_pool.touch_counts_hits = False
    manager.block_pool.use_policy(
        policy,
        stats,
        tree_groups(kv_cache_config),
        group_kinds(kv_cache_config),
        windows(kv_cache_config),
    )
    return stats


def build_kvplug_manager(
    policy: EvictionPolicy, connector: bool = False, **kwargs: Any
) -> KVPlugKVCacheManager:
    """A `KVPlugKVCacheManager` built from vLLM's own arguments, its pool ranked by
    `policy` (a `ConnectorKVCacheManager` if a `connector` loads external tokens)."""
    with kvplug_classes(policy, connector, kwargs["kv_cache_config"]):
        manager = manager_class(connector)(**kwargs)
    attach_policy(manager, policy, kwargs["kv_cache_config"])
    return manager
