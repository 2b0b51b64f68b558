"""LMCache's eviction-aware lazy offload reading kvplug's free queue, in-process.

LMCache's ``EvictionAwareStoreQueue`` (its vLLM integration's lazy-offload policy) buffers
store operations and releases those whose GPU blocks sit within the *danger depth* of
vLLM's free queue, walking ``free_block_queue.fake_free_list_head.next_free_block`` from
the head, on the assumption that the head is what the allocator takes next. It is
LMCache's own code (the pure-Python policy; LMCache's transfers need a GPU and do not
run here), built over kvplug's pool inside vLLM's KV-cache manager. Under a ranked policy
whose order is not vLLM's release order, the stores it releases must be exactly those of
the blocks the next allocation evicts, and they differ from what it would release beside
vLLM's own pool.

Each check runs in a child process (this file run as a script): once LMCache's modules
are loaded, vLLM's kernel dispatcher, which scans every loaded module when an in-process
engine starts, trips over one of LMCache's objects, so they must never load in the test
process that also starts engines.
"""

from __future__ import annotations

import importlib.util
import subprocess
import sys
from itertools import count
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

pytest.importorskip("vllm", reason="vLLM is not installed (pip install 'kvplug[vllm]')")
if __name__ == "__main__":  # a child process of the tests below: conftest.py's helpers path
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "support"))

from ranked_policies import NewestFirst  # noqa: E402

from kvplug.policies import make_policy  # noqa: E402
from kvplug.replay.arms.base import FRESH_UNIT_BASE  # noqa: E402
from kvplug.replay.arms.vllm import VLLMStockArm  # noqa: E402

F = FRESH_UNIT_BASE
GPU_BLOCKS = 8
STEP_BLOCKS = 1  # blocks allocated per step: LMCache's danger depth is 2.5x, so 3


def lmcache_modules() -> Any:
    """LMCache's policy modules (in the child process only)."""
    from lmcache.integration.vllm.lazy_offload_policy import base, eviction_aware

    return SimpleNamespace(policy=eviction_aware, DrainSignals=base.DrainSignals)


def in_child(check: str, policy: str) -> None:
    """Run `check` (a function of this file) for `policy` in a child process."""
    if importlib.util.find_spec("lmcache") is None:
        pytest.skip(
            "LMCache's lazy-offload policy is not installed (pip install --no-deps lmcache)"
        )
    done = subprocess.run(
        [sys.executable, __file__, check, policy], capture_output=True, text=True, timeout=300
    )
    assert done.returncode == 0, done.stdout + done.stderr


def filled(policy: Any) -> VLLMStockArm:
    """Every block cached and free, in an order ranked policies disagree with vLLM on."""
    arm = VLLMStockArm(GPU_BLOCKS, policy)
    fresh = count(F)
    for req_id, prompt in enumerate([[1, 2, 3], [1, 2, 3], [4, 5], [6, 7, 8], [9, 10, 11]]):
        assert arm.admit(req_id, [*prompt, next(fresh)], len(prompt)) is not None
        arm.finish(req_id)
    assert arm.manager.block_pool.get_num_free_blocks() == GPU_BLOCKS
    return arm


def drained_blocks(lmcache: Any, arm: VLLMStockArm) -> list[int]:
    """One buffered store per cached block; the blocks of the stores LMCache releases."""
    pool = arm.manager.block_pool
    policy = lmcache.policy
    queue = policy.EvictionAwareStoreQueue(policy.EvictionAwarePolicyConfig(), pool)
    for block in pool.blocks:
        if not block.is_null and block.block_hash is not None:
            store = SimpleNamespace(
                request_id=f"b{block.block_id}", op=SimpleNamespace(start=0, end=1)
            )
            queue.add(store, {block.block_id: block.block_hash})
    signals = lmcache.DrainSignals(
        new_blocks_allocated=STEP_BLOCKS,
        est_next_step_blocks=STEP_BLOCKS,
        finished_request_ids=set(),
        blocked_request_ids=set(),
    )
    drain = queue.drain(signals)
    return [block_id for item in drain.items for _, hashes in item.metadatas for block_id in hashes]


def policy_named(name: str) -> Any:
    return (
        NewestFirst() if name == "newest-first" else None if name == "stock" else make_policy(name)
    )


def check_stores_what_the_pool_evicts_next(policy: str) -> None:
    lmcache = lmcache_modules()
    arm = filled(policy_named(policy))
    released = drained_blocks(lmcache, arm)
    assert len(released) == 3, released
    assert arm.admit(100, [50, 51, 52, F + 100], 3) == 0
    handed_out = sorted(arm.manager.get_block_ids("100")[0])
    assert handed_out == sorted(released), (handed_out, released)
    arm.manager.block_pool.check_invariants()


def check_other_blocks_beside_vllms_pool(policy: str) -> None:
    lmcache = lmcache_modules()

    def hashes(arm: VLLMStockArm) -> set[Any]:
        pool = arm.manager.block_pool
        return {pool.blocks[block_id].block_hash for block_id in drained_blocks(lmcache, arm)}

    assert hashes(filled(policy_named(policy))) != hashes(filled(None))


@pytest.mark.parametrize("policy", ["newest-first", "lfu", "cost"])
def test_lmcache_stores_what_the_pool_evicts_next(policy: str) -> None:
    in_child("check_stores_what_the_pool_evicts_next", policy)


def test_beside_vllms_pool_it_would_store_other_blocks() -> None:
    """The same requests on vLLM's own pool: its walk releases other blocks, so the test
    above tells kvplug's order from vLLM's."""
    in_child("check_other_blocks_beside_vllms_pool", "newest-first")


if __name__ == "__main__":  # a child process of the tests above
    globals()[sys.argv[1]](sys.argv[2])
