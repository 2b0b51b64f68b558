"""A pytest plugin that runs vLLM's own KV-cache tests on kvplug's pool and manager.

Loaded with ``-p kvplug_pool_plugin`` (this folder on ``sys.path``) before vLLM's test
modules are imported, it rebinds the names vLLM's code and tests look the classes up by:
``BlockPool`` (in ``vllm.v1.core.block_pool`` and the coordinator module) becomes the
kvplug pool class serving the policy named by ``KVPLUG_UPSTREAM_POLICY`` (default
``lru``), each pool built with its own policy instance; ``KVCacheManager`` (in
``vllm.v1.core.kv_cache_manager`` and the scheduler module) becomes
`kvplug.vllm.kv_cache_manager.KVPlugKVCacheManager`. A test that builds either class
itself, or through vLLM's scheduler, gets kvplug's.

After each test every kvplug pool the test built is checked against its invariants
(`KVPlugBlockPool.check_invariants`), unless the test cached blocks the pool does not
own (some of vLLM's unit tests hand `cache_full_blocks` blocks they made themselves:
the pool's own blocks then say nothing about what it cached) or is one of `UNCHECKED`.
"""

from __future__ import annotations

import os
import weakref
from collections.abc import Iterator
from typing import Any

import pytest
from vllm.v1.core import block_pool, kv_cache_coordinator, kv_cache_manager
from vllm.v1.core.sched import scheduler

from kvplug.policies import make_policy
from kvplug.vllm.block_pool import pool_class
from kvplug.vllm.kv_cache_manager import KVPlugKVCacheManager

POLICY = os.environ.get("KVPLUG_UPSTREAM_POLICY", "lru")
# vLLM's tests that change a pool's state behind its back, so its invariants cannot hold
UNCHECKED = {"test_maybe_evict_cached_block": "sets block hashes itself, not through the pool"}

_built: weakref.WeakSet[UpstreamPool] = weakref.WeakSet()
_base = pool_class(make_policy(POLICY))


class UpstreamPool(_base):  # type: ignore[misc, valid-type]
    """kvplug's pool for `POLICY`, built with vLLM's arguments alone."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, policy=make_policy(POLICY), **kwargs)
        self.given_foreign_blocks = False
        _built.add(self)

    def cache_full_blocks(self, request: Any, blocks: list[Any], *args: Any, **kw: Any) -> None:
        own = self.blocks
        for block in blocks:  # (one of vLLM's tests passes a list among the blocks)
            block_id = getattr(block, "block_id", len(own))
            self.given_foreign_blocks |= block_id >= len(own) or own[block_id] is not block
        super().cache_full_blocks(request, blocks, *args, **kw)


UpstreamPool.__name__ = UpstreamPool.__qualname__ = f"UpstreamPool[{POLICY}]"

for module in (block_pool, kv_cache_coordinator):
    module.BlockPool = UpstreamPool
for module in (kv_cache_manager, scheduler):
    module.KVCacheManager = KVPlugKVCacheManager


def pytest_report_header() -> str:
    return f"kvplug: vLLM's BlockPool is {UpstreamPool.__name__}, KVCacheManager is kvplug's"


@pytest.fixture(autouse=True)
def _kvplug_pool_invariants(request: pytest.FixtureRequest) -> Iterator[None]:
    _built.clear()
    yield
    if request.node.originalname in UNCHECKED:
        return
    for pool in list(_built):
        if not pool.given_foreign_blocks:
            pool.check_invariants()
