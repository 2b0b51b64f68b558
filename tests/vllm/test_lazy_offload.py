"""vLLM's own lazy CPU offload beside kvplug's pool: it copies out what kvplug evicts next.

`SimpleCPUOffloadScheduler` (the scheduler side of vLLM's ``SimpleCPUOffloadConnector``
with ``lazy_offload``) is vLLM's code, built here in-process over kvplug's pool inside
vLLM's own KV-cache manager. Its worker side (the CUDA copies) does not run on a CPU;
the test reports its stores complete as the worker would (`SimpleCPUOffloadWorkerMetadata`).
The engine configuration it reads is a stand-in naming only the fields it reads.

Each step of the scheduler's loop is the connector's: it walks the GPU free queue from
its head (``iter_blocks_after``) for the blocks the allocator takes next, holds them
while it copies (``touch``), and frees them when the copy is done (vLLM 0.34 with
``evict_first``, earlier releases without). Under ranked policies whose order is not
vLLM's release order, the blocks it copied must then be exactly the blocks the next
allocation evicts, and a request whose prefix was evicted finds it on the CPU. Without
that, an offloader copies blocks the GPU keeps and loses the ones it evicts.
"""

from __future__ import annotations

import dataclasses
from itertools import count
from types import SimpleNamespace
from typing import Any

import pytest

pytest.importorskip("vllm", reason="vLLM is not installed (pip install 'kvplug[vllm]')")
pytest.importorskip("vllm.v1.simple_kv_offload.manager", reason="this vLLM has no lazy CPU offload")

from ranked_policies import NewestFirst, TrackedLRU  # noqa: E402
from vllm.v1.kv_cache_interface import KVCacheTensor  # noqa: E402
from vllm.v1.outputs import KVConnectorOutput  # noqa: E402
from vllm.v1.request import Request  # noqa: E402
from vllm.v1.simple_kv_offload.manager import SimpleCPUOffloadScheduler  # noqa: E402
from vllm.v1.simple_kv_offload.metadata import SimpleCPUOffloadWorkerMetadata  # noqa: E402

from kvplug.policies import make_policy  # noqa: E402
from kvplug.replay.arms.base import FRESH_UNIT_BASE  # noqa: E402
from kvplug.replay.arms.vllm import MAX_MODEL_LEN, VLLMStockArm  # noqa: E402

F = FRESH_UNIT_BASE
PAGE_BYTES = 64  # any size: the CPU pool's block count is a ratio of bytes
GPU_BLOCKS = 8
CPU_BLOCKS = 16
BATCHED_TOKENS = 2  # the lazy walk covers 2 x this many blocks of one token


def policy_named(name: str) -> Any:
    tests_own = {"newest-first": NewestFirst, "tracked-lru": TrackedLRU}
    return tests_own[name]() if name in tests_own else make_policy(name)


def engine_config() -> Any:
    """The fields of vLLM's `VllmConfig` the offload scheduler reads (a real one needs a
    model)."""
    return SimpleNamespace(
        kv_events_config=None,
        parallel_config=SimpleNamespace(decode_context_parallel_size=1, world_size=1),
        model_config=SimpleNamespace(max_model_len=MAX_MODEL_LEN),
        max_in_flight_tokens=BATCHED_TOKENS,
        num_prefill_lookahead_tokens=0,
        num_hash_lookahead_tokens=0,  # vLLM 0.34
        speculative_config=None,
        scheduler_config=SimpleNamespace(max_num_batched_tokens=BATCHED_TOKENS),
    )


def offloader_for(arm: VLLMStockArm) -> SimpleCPUOffloadScheduler:
    """vLLM's lazy offload scheduler bound to `arm`'s pool, as vLLM's scheduler binds it."""
    pool = arm.manager.block_pool
    num_blocks = len(pool.blocks)
    fields = {f.name for f in dataclasses.fields(KVCacheTensor)}
    tensor = {"size": PAGE_BYTES * num_blocks}
    if "layers" in fields:
        tensor |= {"layers": ["layer.0"], "layer_stride": PAGE_BYTES * num_blocks}
        tensor |= {"block_stride": PAGE_BYTES, "offset": 0}
    else:
        tensor["shared_by"] = ["layer.0"]
    config = dataclasses.replace(
        arm.manager.kv_cache_config, kv_cache_tensors=[KVCacheTensor(**tensor)]
    )
    offloader = SimpleCPUOffloadScheduler(
        engine_config(),
        config,
        cpu_capacity_bytes=PAGE_BYTES * CPU_BLOCKS,
        scheduler_block_size=1,
        hash_block_size=1,
        lazy_offload=True,
    )
    offloader.bind_gpu_block_pool(pool)
    return offloader


def fill(arm: VLLMStockArm) -> None:
    """Every GPU block cached and free, released in an order the policies disagree on:
    four chains, the first reused, the last evicting (so `cost`'s clock has moved)."""
    fresh = count(F)
    prompts = [[1, 2, 3], [1, 2, 3], [4, 5], [6, 7, 8], [9, 10, 11]]
    for req_id, prompt in enumerate(prompts):
        assert arm.admit(req_id, [*prompt, next(fresh)], len(prompt)) is not None
        arm.finish(req_id)
    pool = arm.manager.block_pool
    assert pool.get_num_free_blocks() == GPU_BLOCKS
    assert all(block.block_hash is not None for block in pool.blocks if not block.is_null)


def store_once(offloader: SimpleCPUOffloadScheduler) -> list[int]:
    """One scheduler step of the offloader: it picks and holds blocks, the worker copies
    them, and the completion frees them. The GPU blocks it copied."""
    meta = offloader.build_connector_meta(SimpleNamespace(preempted_req_ids=set()))
    copied = list(meta.store_gpu_blocks)
    if copied:
        done = SimpleCPUOffloadWorkerMetadata(completed_store_events={meta.store_event: 1})
        offloader.update_connector_output(KVConnectorOutput(kv_connector_worker_meta=done))
    return copied


@pytest.mark.parametrize("policy", ["tracked-lru", "newest-first", "lfu", "cost", "learned"])
def test_the_offloader_copies_what_the_pool_evicts_next(policy: str) -> None:
    arm = VLLMStockArm(GPU_BLOCKS, policy_named(policy))
    pool = arm.manager.block_pool
    fill(arm)
    offloader = offloader_for(arm)
    copied = store_once(offloader)
    assert len(copied) == 2 * BATCHED_TOKENS
    pool.check_invariants()
    assert pool.get_num_free_blocks() == GPU_BLOCKS  # the offloader let go of them
    # the next allocation of that many blocks evicts exactly what was copied
    assert arm.admit(100, [*range(50, 50 + len(copied)), F + 100], len(copied)) == 0
    handed_out = list(arm.manager.get_block_ids("100")[0])
    assert sorted(handed_out) == sorted(copied)
    pool.check_invariants()


def test_an_evicted_prefix_is_found_on_the_cpu() -> None:
    """Under a ranking that evicts the newest chain first, the copies are that chain, so a
    request for it misses on the GPU and hits on the CPU."""
    arm = VLLMStockArm(GPU_BLOCKS, NewestFirst())
    fill(arm)
    offloader = offloader_for(arm)
    copied = store_once(offloader)
    assert arm.admit(100, [*range(50, 50 + len(copied)), F + 100], len(copied)) == 0
    request = Request("again", [9, 10, 11, F + 200], arm._sampling_params, None,
                      block_hasher=arm._block_hasher)  # fmt: skip
    gpu_hit = arm.manager.get_computed_blocks(request)[1]
    cpu_hit, is_async = offloader.get_num_new_matched_tokens(request, gpu_hit)
    assert gpu_hit == 0 and cpu_hit == 3 and is_async


def test_the_walk_sees_the_policys_order_not_vllms() -> None:
    """The same requests on vLLM's own pool: its lazy walk picks other blocks (it walks
    the release order), so the test above can tell the two apart."""
    ranked, stock = VLLMStockArm(GPU_BLOCKS, NewestFirst()), VLLMStockArm(GPU_BLOCKS)
    fill(ranked)
    fill(stock)
    hashes = []
    for arm in (ranked, stock):
        pool = arm.manager.block_pool
        copied = store_once(offloader_for(arm))
        hashes.append({pool.blocks[block_id].block_hash for block_id in copied})
    assert hashes[0] != hashes[1]
