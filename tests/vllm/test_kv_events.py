"""vLLM's KV cache events stay true with kvplug's block pool.

vLLM publishes a ``BlockStored`` event for each block it adds to its prefix-cache map,
a ``BlockRemoved`` when a block leaves it, and ``AllBlocksCleared`` on a prefix-cache reset
(``kv_events_config``; ZMQ multipart ``[topic, 8-byte sequence number, msgpack
KVEventBatch]``, sent by a background thread). kvplug replaces the block pool's free
queue and decides which cached block to evict, so the events are only right if kvplug
evicts through vLLM's own code paths.

For a tiny Llama (one KV cache group) and a tiny Gemma3 (hybrid: a sliding-window group
and a full-attention group sharing one pool), an in-process `LLM` with
``scheduler_cls="kvplug.vllm.Scheduler"`` (policy ``cost``) and a small pool runs batches
of prompts with shared prefixes while a ZMQ subscriber in the test collects the events.
Each test proves that:

- no batch was lost (sequence numbers are consecutive) and evictions happened;
- replaying the events after the reset (+1 per stored hash, -1 per removed hash, per
  medium and group) gives exactly the multiset of hashes in the pool's
  ``cached_block_hash_to_block`` (a hash can map to several blocks);
- every ``BlockRemoved`` after the reset is one of kvplug's evictions (the counts agree),
  and kvplug tracks exactly the blocks that vLLM's map holds;
- ``KVPlugBlockPool.check_invariants()`` holds after every batch.

A router fed by these events (llm-d's scorer, Dynamo's KV router) sees what the replay
sees: with two tenants' requests interleaved, and the default tenant's keys salted or
vLLM's own (``namespace.salt_kv_events``), the replay equals the pool after every batch.
"""

from __future__ import annotations

import gc
import random
from collections import Counter
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest

pytest.importorskip("vllm", reason="vLLM is not installed (pip install 'kvplug[vllm]')")

from kv_event_log import TOPIC, EventLog, HashKey, replay, since_last_clear, subscriber  # noqa: E402,F401
from vllm import LLM, SamplingParams  # noqa: E402
from vllm.distributed.kv_events import (  # noqa: E402
    BlockRemoved,
    BlockStored,
)
from vllm.v1.core.kv_cache_utils import (  # noqa: E402
    get_block_hash,
    get_group_id,
    maybe_convert_block_hash,
)
from vllm_server_util import free_port  # noqa: E402

from kvplug.tools.tiny_model import build_tiny_model  # noqa: E402
from kvplug.vllm.block_pool import KVPlugBlockPool  # noqa: E402
from kvplug.vllm.compat import cached_items  # noqa: E402

pytestmark = pytest.mark.vllm_engine

WORDS = [
    "the", "cache", "block", "token", "prefix", "model", "layer",
    "window", "memory", "request", "page", "pool", "hash",
]  # fmt: skip
# Small pools, so that the workload (about 48 distinct full blocks per group) evicts; the
# hybrid model needs more blocks to fit one 1024-token request in both of its groups.
NUM_BLOCKS = {"llama": 40, "gemma3": 72}
GROUPS = {"llama": {0}, "gemma3": {0, 1}}


@contextmanager
def kvplug_llm(
    model: Path, num_blocks: int, port: int, config: dict | None = None
) -> Iterator[LLM]:
    """An in-process engine with kvplug's scheduler (`config`, default: policy cost) and a
    ZMQ event publisher on `port`."""
    with pytest.MonkeyPatch.context() as env:
        env.setenv("VLLM_ENABLE_V1_MULTIPROCESSING", "0")  # the pool lives in this process
        llm = LLM(
            model=str(model),
            enforce_eager=True,
            block_size=32,
            max_model_len=1024,
            num_gpu_blocks_override=num_blocks,
            gpu_memory_utilization=0.25,
            seed=0,
            scheduler_cls="kvplug.vllm.Scheduler",
            additional_config={"kvplug": config or {"policy": "cost"}},
            kv_events_config={
                "enable_kv_cache_events": True,
                "publisher": "zmq",
                "endpoint": f"tcp://*:{port}",
                "topic": TOPIC,
            },
        )
        try:
            yield llm
        finally:
            llm.llm_engine.engine_core.shutdown()
            del llm
            gc.collect()


def block_pool(llm: LLM) -> KVPlugBlockPool:
    pool = llm.llm_engine.engine_core.engine_core.scheduler.kv_cache_manager.block_pool
    assert isinstance(pool, KVPlugBlockPool)
    return pool


def text(rng: random.Random, n: int) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(n))


def workload(seed: int = 0) -> list[list[str]]:
    """Batches of three prompts: three shared prefixes (~7 blocks), four questions each."""
    rng = random.Random(seed)
    prefixes = [text(rng, 220) for _ in range(3)]
    prompts = [f"{prefix} {text(rng, 50)}" for _ in range(4) for prefix in prefixes]
    return [prompts[i : i + 3] for i in range(0, len(prompts), 3)]


def wait_for_subscription(llm: LLM, events: EventLog, tries: int = 30) -> None:
    """ZMQ drops what a PUB socket sends before a subscription reaches it (the slow-joiner
    problem): run one-off requests until their events arrive."""
    params = SamplingParams(max_tokens=1, temperature=0)
    for i in range(tries):
        llm.generate([f"warm up {i} " * 40], params, use_tqdm=False)
        if events.drain(quiet_s=0.5):
            return
    pytest.fail(f"no KV event arrived after {tries} requests")


def pool_hashes(pool: KVPlugBlockPool) -> tuple[Counter[HashKey], set[int]]:
    """Each hash in vLLM's prefix-cache map, as the events name it, with the number of
    blocks it maps to; and the ids of those blocks."""
    held: Counter[HashKey] = Counter()
    block_ids: set[int] = set()
    # BlockHashToBlockMap has no public iteration; its layout differs by release.
    for key, blocks in cached_items(pool.cached_block_hash_to_block):
        ids = [block.block_id for block in blocks]
        external = maybe_convert_block_hash(get_block_hash(key))
        held[(pool.medium, get_group_id(key), external)] += len(ids)
        block_ids.update(ids)
    return held, block_ids


@pytest.fixture(scope="module")
def models(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("models")
    return {arch: build_tiny_model(root / arch, arch=arch) for arch in NUM_BLOCKS}


@pytest.mark.parametrize("arch", ["llama", "gemma3"])
def test_kv_events_replay_to_the_pool(models: dict[str, Path], arch: str) -> None:
    port = free_port()
    with subscriber(port) as events, kvplug_llm(models[arch], NUM_BLOCKS[arch], port) as llm:
        pool = block_pool(llm)
        wait_for_subscription(llm, events)
        # A clean start: whatever was published before the subscription took is cleared.
        assert llm.reset_prefix_cache()
        evictions_before = pool.stats.evictions
        params = SamplingParams(max_tokens=40, temperature=0, ignore_eos=True)
        cached_tokens = []
        for batch in workload():
            outputs = llm.generate(batch, params, use_tqdm=False)
            cached_tokens += [output.num_cached_tokens for output in outputs]
            pool.check_invariants()
        events.settle()

        sequence = [seq for seq, _ in events.batches]
        assert sequence == list(range(sequence[0], sequence[0] + len(sequence))), "lost batches"
        recent = since_last_clear(events.events())
        stored = [e for e in recent if isinstance(e, BlockStored)]
        removed = [e for e in recent if isinstance(e, BlockRemoved)]
        evictions = pool.stats.evictions - evictions_before
        assert evictions > 0, "the workload did not fill the pool"
        assert sum(cached_tokens) > 0, "the workload had no prefix hits"
        assert {e.group_idx for e in stored} == GROUPS[arch]
        assert sum(len(e.block_hashes) for e in removed) == evictions

        expected, block_ids = pool_hashes(pool)
        assert replay(recent) == expected
        assert pool.num_cached_blocks() == len(block_ids)
        pool.check_invariants()


@pytest.mark.parametrize("salted", [False, True], ids=["vllm-keys", "salted-keys"])
def test_a_router_fed_by_the_events_sees_the_pool_after_every_batch(
    models: dict[str, Path], salted: bool
) -> None:
    """Two tenants' requests interleaved (the default tenant and ``acme``, whose keys are
    always salted), the default tenant's keys salted or not: after every batch, the
    events since the reset replay to exactly the hashes the pool holds."""
    port = free_port()
    config = {"policy": "cost", "namespace": {"salt_kv_events": salted}}
    with (
        subscriber(port) as events,
        kvplug_llm(models["llama"], NUM_BLOCKS["llama"], port, config) as llm,
    ):
        pool = block_pool(llm)
        wait_for_subscription(llm, events)
        assert llm.reset_prefix_cache()
        evictions_before = pool.stats.evictions
        mismatches, batches = 0, workload(seed=1)
        for i, batch in enumerate(batches):
            params = [
                SamplingParams(
                    max_tokens=40,
                    temperature=0,
                    ignore_eos=True,
                    extra_args={"kvplug_tenant": "acme"} if (i + j) % 2 else None,
                )
                for j in range(len(batch))
            ]
            llm.generate(batch, params, use_tqdm=False)
            events.settle(quiet_s=0.5)
            expected, _ = pool_hashes(pool)
            mismatches += replay(since_last_clear(events.events())) != expected
            pool.check_invariants()
        assert mismatches == 0, f"{mismatches} of {len(batches)} batches"
        assert pool.stats.evictions > evictions_before, "the workload did not fill the pool"
