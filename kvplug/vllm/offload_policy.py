"""kvplug's policy for vLLM's CPU offload tier (``OffloadingConnector``'s CPU manager).

vLLM's native offloading keeps chunks of KV in CPU memory and asks a `CachePolicy`
(vLLM's ``lru`` or ``arc`` by default) which chunk to drop when a store needs room.
`KVPlugCachePolicy` is that policy with kvplug's decision: the chunks are nodes of
kvplug's eviction core (`kvplug.core.eviction.EvictionCore`) ranked by the configured
kvplug policy (``cost`` by default), so the tier keeps what saves the most prefill
compute, and evicts a prefix's tail before its head (a load needs every chunk before
it). kvplug's vLLM entry point registers it as ``kvplug`` (the configured policy) and
``kvplug-<name>`` (kvplug's policy ``<name>``, every one a server can run):

    --kv-transfer-config '{"kv_connector": "OffloadingConnector", "kv_role": "kv_both",
      "kv_connector_extra_config": {"cpu_bytes_to_use": 8000000000,
                                    "eviction_policy": "kvplug"}}'

The policy's keys come from ``$KVPLUG_CONFIG`` (kvplug's config file), as for kvplug's
scheduler; ``block_size`` there is the tier's chunk size in tokens (vLLM's GPU block
size, 16, if unset), which prices a chunk by its depth.

What vLLM tells a policy, and what kvplug makes of it:

- ``insert`` (a store began; the chunk is not ready): a node below the chunk before it in
  the storing request (by the request's token positions), held until ``mark_evictable``;
- ``mark_evictable`` / ``mark_non_evictable`` (no transfer reads it any more / a load
  reads it): released (ranked) / held;
- ``on_request_finished``: the chunks a request reused are hits, re-ranked if idle;
- ``evict(n, protected)``: the policy's n first victims, leaves first, skipping
  `protected` (and what hangs above a protected chunk), or None and nothing changed;
- ``remove`` (a failed store) and ``clear`` (a cache reset).

Invariants (`check_invariants`): every chunk vLLM holds has exactly one node, under its
key; a node is evictable exactly while its chunk's reference count is 0; the eviction
core's own invariants hold (the candidates are the idle chunks with no cached child).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from functools import cache
from itertools import count
from typing import Any

from vllm.v1.kv_offload.cpu.policies.base import CachePolicy, ChunkStatus

from kvplug.config import KVPlugConfig, build_policy
from kvplug.core.eviction import EvictionCore, live_parent
from kvplug.core.model_spec import load_model

DEFAULT_CHUNK_TOKENS = 16  # vLLM's default block size
NAME = "kvplug"  # the name registered with vLLM's CachePolicyFactory


class ChunkNode:
    """One stored chunk as kvplug's eviction core and policies see it."""

    __slots__ = (
        "serial", "key", "depth", "hits", "from_end", "request_hit", "request_output",
        "request_session", "held_elsewhere", "parent", "parent_serial", "cached_children",
        "evictable", "chunk", "position",
    )  # fmt: skip

    def __init__(self, serial: int, key: bytes, chunk: ChunkStatus, position: int | None):
        self.serial = serial
        self.key = key
        self.chunk = chunk
        self.position = position
        self.depth = 0
        self.hits = 0
        self.from_end = 0
        self.request_hit = False
        self.request_output = 0
        self.request_session = False
        self.held_elsewhere = False  # the GPU may hold it too; the tier cannot know
        self.parent: ChunkNode | None = None
        self.parent_serial = -1
        self.cached_children = 0
        self.evictable = False


@dataclass
class _RequestChains:
    """A request's chunks seen so far, per KV cache group, in the order seen: (token
    position, key) entries, and each key's index among them."""

    owner: object
    generation: int
    groups: dict[int, list[tuple[int | None, bytes]]] = field(default_factory=dict)
    index: dict[bytes, int] = field(default_factory=dict)


def _group_of(key: bytes) -> int:
    return int.from_bytes(key[-4:], "big", signed=False)  # vLLM's get_offload_group_idx


class KVPlugCachePolicy(CachePolicy):
    """vLLM's CPU-tier `CachePolicy` deciding with kvplug (see the module doc)."""

    policy_name: str | None = None  # set by `policy_class`: kvplug's policy to serve

    def __init__(self, cache_capacity: int, config: KVPlugConfig | None = None) -> None:
        super().__init__(cache_capacity)
        if config is None:
            config = KVPlugConfig.load(None).with_policy(self.policy_name)
        self.config = config
        self.chunk_tokens = self.config.block_size or DEFAULT_CHUNK_TOKENS
        self._model = load_model(None)
        self._serials = count()
        self._generation = 0
        self.clear()

    # -- vLLM's CachePolicy interface ------------------------------------------------------
    def get(self, key: Any) -> ChunkStatus | None:
        node = self.nodes.get(key)
        return None if node is None else node.chunk

    def insert(self, key: Any, chunk: ChunkStatus, req_context: Any = None) -> None:
        """A chunk is stored (vLLM 0.32 names no request: the one whose store missed
        last, `on_store_miss`, is storing)."""
        if req_context is None:
            req_context = self._storing
        position = self._position(key, req_context)
        node = ChunkNode(next(self._serials), key, chunk, position)
        if position is not None:
            node.depth = max(position // self.chunk_tokens - 1, 0)
        parent = self._parent(key, position, req_context)
        if parent is not None and position is None:
            node.depth = parent.depth + 1
        self.nodes[key] = node
        self.eviction.insert(node, parent)
        self._seen(req_context, ((position, key),))
        if chunk.ref_cnt == 0:
            self.eviction.release(node)

    def remove(self, key: Any) -> None:
        node = self.nodes.pop(key)
        self.eviction.remove(node)
        node.serial = -1  # chunks that name it as parent see a dead link

    def touch(self, keys: Iterable[Any], req_context: Any) -> None:
        """vLLM 0.32 and 0.33: the request accessed `keys` (hits are counted when it
        finishes); they only extend its chains."""
        self.on_request_access(keys, req_context)

    def on_store_miss(self, keys: Iterable[Any], req_context: Any) -> None:
        self._storing = req_context
        self.on_request_access(keys, req_context)

    def on_request_access(self, keys: Iterable[Any], req_context: Any) -> None:
        self._seen(req_context, ((self._position(key, req_context), key) for key in keys))

    def on_request_finished(
        self,
        key_groups: Sequence[Sequence[Any]],
        insertion_only_keys: set[Any],
        reused_keys: set[Any],
        req_context: Any,
    ) -> None:
        nodes, core = self.nodes, self.eviction
        request_hit = bool(reused_keys)
        for keys in key_groups:
            last = len(keys) - 1
            for index, key in enumerate(keys):
                node = nodes.get(key)
                if node is None:
                    continue
                reused = key in reused_keys
                if reused:
                    core.hit(node)
                if key in insertion_only_keys or reused:
                    node.from_end = last - index
                    node.request_hit = request_hit
                if node.evictable:  # idle: ranked again with what it now knows
                    core.reclaim(node)
                    core.release(node)

    def evict(self, n: int, protected: set[Any]) -> list[tuple[Any, ChunkStatus]] | None:
        if n == 0:
            return []
        core, nodes = self.eviction, self.nodes
        shielded = [nodes[key] for key in protected if key in nodes and nodes[key].evictable]
        for node in shielded:  # held for the walk, so what hangs above them stays too
            core.reclaim(node)
        chosen: list[ChunkNode] = []
        for node in core.iter_victims():
            chosen.append(node)
            if len(chosen) == n:
                break
        if len(chosen) == n:
            for node in chosen:
                core.policy.chosen = node.serial  # the policy's own victim (its clock)
                core.remove(node)
                node.serial = -1
                del nodes[node.key]
        if shielded:
            core.restore_n(shielded)
        if len(chosen) < n:
            return None
        return [(node.key, node.chunk) for node in chosen]

    def clear(self) -> None:
        policy = build_policy(self.config, self._model)
        policy.bind(self.chunk_tokens, self.cache_capacity)
        self.eviction: EvictionCore[ChunkNode] = EvictionCore(policy)
        self.nodes: dict[Any, ChunkNode] = {}
        self._storing: Any = None  # the request whose store missed last (vLLM 0.32)
        self._generation += 1

    def mark_evictable(self, key: Any) -> None:
        self.eviction.release(self.nodes[key])

    def mark_non_evictable(self, key: Any) -> None:
        self.eviction.reclaim(self.nodes[key])

    # -- helpers ---------------------------------------------------------------------------
    @staticmethod
    def _position(key: Any, req_context: Any) -> int | None:
        if req_context is None or not hasattr(req_context, "get_offload_key_position"):
            return None
        return req_context.get_offload_key_position(key)

    def _chains(self, req_context: Any) -> _RequestChains | None:
        if req_context is None:
            return None
        state = req_context.get_state(_RequestChains)
        if state is None or state.owner is not self or state.generation != self._generation:
            state = _RequestChains(self, self._generation)
            req_context.set_state(state)
        return state

    def _seen(self, req_context: Any, items: Iterable[tuple[int | None, bytes]]) -> None:
        chains = self._chains(req_context)
        if chains is None:
            return
        index = chains.index
        for item in items:
            if item[1] in index:
                continue
            chain = chains.groups.setdefault(_group_of(item[1]), [])
            index[item[1]] = len(chain)
            chain.append(item)

    def _parent(self, key: Any, position: int | None, req_context: Any) -> ChunkNode | None:
        """The cached chunk before `key` in its request's chain: the latest seen before
        it whose position is lower (the one seen just before it, without positions)."""
        chains = self._chains(req_context)
        if chains is None:
            return None
        chain = chains.groups.get(_group_of(key), [])
        at = chains.index.get(key, len(chain))
        for seen_position, seen in reversed(chain[max(at - 8, 0) : at]):
            if position is None or seen_position is None or seen_position < position:
                return self.nodes.get(seen)
        return None

    def check_invariants(self) -> None:
        """Raise AssertionError if an invariant of the module doc does not hold."""
        children: dict[int, int] = {}
        for key, node in self.nodes.items():
            assert node.key == key
            assert node.evictable == (node.chunk.ref_cnt == 0), f"chunk {key!r}: evictable"
            parent = live_parent(node)
            if parent is not None:
                children[parent.serial] = children.get(parent.serial, 0) + 1
        leaves = 0
        for node in self.nodes.values():
            assert node.cached_children == children.get(node.serial, 0)
            leaves += node.evictable and node.cached_children == 0
        assert len(self.eviction) == leaves, "the candidates are not the idle leaves"


_CLASS_PREFIX = "KVPlugCachePolicy_"


@cache
def policy_class(policy: str) -> type[KVPlugCachePolicy]:
    """The `KVPlugCachePolicy` serving kvplug's policy `policy` (vLLM builds a policy from
    its class alone, so the name is bound in a subclass)."""
    return type(_CLASS_PREFIX + policy, (KVPlugCachePolicy,), {"policy_name": policy})


def __getattr__(name: str) -> Any:
    """vLLM's factory loads ``kvplug-<name>`` as this module's ``KVPlugCachePolicy_<name>``."""
    if name.startswith(_CLASS_PREFIX):
        return policy_class(name.removeprefix(_CLASS_PREFIX))
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def register() -> None:
    """Register ``kvplug`` and ``kvplug-<name>`` with vLLM's CachePolicyFactory."""
    from vllm.v1.kv_offload.cpu.policies.factory import CachePolicyFactory

    from kvplug.policies import online_policies

    names = {NAME: KVPlugCachePolicy.__name__}
    names |= {f"{NAME}-{policy}": _CLASS_PREFIX + policy for policy in online_policies()}
    for name, class_name in names.items():
        if name not in CachePolicyFactory._registry:
            CachePolicyFactory.register_cache_policy(name, __name__, class_name)
