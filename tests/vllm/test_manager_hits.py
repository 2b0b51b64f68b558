"""kvplug's KV cache manager: a touch is a prefix hit only while vLLM takes a request's
cached blocks, and blocks a KV connector loaded are held elsewhere only under the manager
built for a connector."""

from __future__ import annotations

import pytest

pytest.importorskip("vllm", reason="vLLM is not installed (pip install 'kvplug[vllm]')")

from vllm.v1.core.sched import scheduler as vllm_scheduler  # noqa: E402

from kvplug.policies import make_policy  # noqa: E402
from kvplug.replay.arms.base import FRESH_UNIT_BASE as F  # noqa: E402
from kvplug.replay.arms.vllm import VLLMStockArm  # noqa: E402
from kvplug.replay.arms.vllm_offload import VLLMOffloadArm  # noqa: E402
from kvplug.vllm.kv_cache_manager import (  # noqa: E402
    HIT_TOUCH,
    ConnectorKVCacheManager,
    KVPlugKVCacheManager,
    kvplug_classes,
)


@pytest.mark.parametrize("policy", ["lru", "cost"])
def test_a_prefix_hit_counts_and_a_tiers_touch_does_not(policy):
    arm = VLLMStockArm(16, make_policy(policy))
    pool = arm.manager.block_pool
    assert arm.admit(0, [1, 2, 3, F], 3) == 0
    arm.finish(0)
    assert pool.stats.block_hits == 0
    assert arm.admit(1, [1, 2, 3, F + 1], 3) == 3  # a prefix hit on three blocks
    arm.finish(1)
    assert pool.stats.block_hits == 3
    cached = [b for b in pool.blocks if b.block_hash is not None and b.ref_cnt == 0]
    pool.touch(cached[:2])  # another tier holding two free cached blocks while it copies
    assert pool.stats.block_hits == 3
    assert not pool.touch_counts_hits
    pool.free_blocks(cached[:2])


def _loaded_blocks_held_elsewhere(arm: VLLMOffloadArm) -> list[bool]:
    """Cache a prompt, push it out of the GPU into the CPU tier, load it back: whether each
    block holding a loaded unit is held elsewhere."""
    assert arm.admit(0, [1, 2, 3, F], 3) == 0
    arm.finish(0)
    for req_id in range(1, 3):
        assert arm.admit(req_id, [100 + 4 * req_id + k for k in range(4)] + [F + req_id], 4) == 0
        arm.finish(req_id)
    hits = arm.admit(9, [1, 2, 3, 4, F + 9], 4)
    assert hits is not None and arm.loaded > 0
    pool = arm.manager.block_pool
    manager = arm.manager.coordinator.single_type_managers[0]
    loaded = manager.req_to_blocks["9"][hits : hits + arm.loaded]
    return [pool.standing(b).held_elsewhere for b in loaded]


def test_blocks_a_connector_loaded_are_held_elsewhere():
    arm = VLLMOffloadArm(4, host_blocks=64, reload_flops=1.0, target_free=4,
                         policy=make_policy("cost"))  # fmt: skip
    assert isinstance(arm.manager, ConnectorKVCacheManager)
    assert all(_loaded_blocks_held_elsewhere(arm))


def test_without_the_connector_manager_loaded_blocks_are_not_marked():
    class Unmarked(VLLMOffloadArm):
        connector = False

    arm = Unmarked(4, host_blocks=64, reload_flops=1.0, target_free=4, policy=make_policy("cost"))
    assert type(arm.manager) is KVPlugKVCacheManager
    assert not any(_loaded_blocks_held_elsewhere(arm))


@pytest.mark.parametrize("connector", [False, True])
def test_the_scheduler_builds_the_manager_for_its_connector(connector):
    expected = ConnectorKVCacheManager if connector else KVPlugKVCacheManager
    with kvplug_classes(make_policy("cost"), connector=connector):
        assert vllm_scheduler.KVCacheManager is expected
    assert vllm_scheduler.KVCacheManager is not expected


@pytest.mark.parametrize("connector", [False, True])
def test_vllms_scheduler_with_a_kv_connector_gets_the_connector_manager(connector, tmp_path):
    """kvplug's scheduler, built as vLLM's engine core builds it, with vLLM's
    SimpleCPUOffloadConnector configured or not."""
    import torch
    from vllm.config import KVTransferConfig
    from vllm.v1.kv_cache_interface import (
        FullAttentionSpec,
        KVCacheConfig,
        KVCacheGroupSpec,
        KVCacheTensor,
    )
    from vllm.v1.structured_output import StructuredOutputManager

    import kvplug.vllm
    from kvplug.bench.vllm_step import Workload, build_vllm_config
    from kvplug.tools.tiny_model import build_tiny_model

    workload, blocks = Workload(), 64
    config = build_vllm_config(build_tiny_model(tmp_path / "tiny", "llama"), workload, blocks)
    config.additional_config = {"kvplug": {"policy": "cost"}}
    if connector:
        config.kv_transfer_config = KVTransferConfig(
            kv_connector="SimpleCPUOffloadConnector",
            kv_role="kv_both",
            kv_connector_extra_config={"cpu_bytes_to_use": 1 << 22},
        )
    spec = FullAttentionSpec(block_size=16, num_kv_heads=1, head_size=32, dtype=torch.float32)
    page = spec.page_size_bytes
    tensor = KVCacheTensor(size=page * blocks, layers=["layer"], layer_stride=page * blocks,
                           block_stride=page)  # fmt: skip
    kv_cache_config = KVCacheConfig(
        num_blocks=blocks,
        kv_cache_tensors=[tensor],
        kv_cache_groups=[KVCacheGroupSpec(layer_names=["layer"], kv_cache_spec=spec)],
    )
    scheduler = kvplug.vllm.Scheduler(
        vllm_config=config,
        kv_cache_config=kv_cache_config,
        structured_output_manager=StructuredOutputManager(config),
        block_size=16,
        hash_block_size=16,
        log_stats=False,
    )
    assert (scheduler.connector is not None) == connector
    expected = ConnectorKVCacheManager if connector else KVPlugKVCacheManager
    assert type(scheduler.kv_cache_manager) is expected


def test_a_vllm_without_the_hit_call_is_refused(monkeypatch):
    from vllm.v1.core import single_type_kv_cache_manager as single

    monkeypatch.delattr(single.SingleTypeKVCacheManager, HIT_TOUCH)
    for cls in vars(single).values():
        if isinstance(cls, type) and HIT_TOUCH in vars(cls):
            monkeypatch.delattr(cls, HIT_TOUCH)
    with pytest.raises(RuntimeError, match=HIT_TOUCH):
        VLLMStockArm(16, make_policy("cost"))
