"""kvplug inside a real in-process vLLM engine (``scheduler_cls="kvplug.vllm.Scheduler"``).

Each test builds a tiny random-weight model (`kvplug.tools.tiny_model`) and runs vLLM 0.32's
`LLM` on CPU with a small KV budget (``num_gpu_blocks_override``), so that requests evict.

- kvplug's pool is the one in use under all three of vLLM's KV cache coordinators (no
  prefix caching, unitary, hybrid sliding-window + full attention);
- with ``policy: lru`` every request's cached-token count equals stock vLLM's, on the
  Llama-style and on the Gemma3-style (hybrid) model;
- with ``policy: cost`` the counts follow kvplug's rule instead: a reused prefix survives
  a scan of one-off prompts that flushes it from stock vLLM;
- outputs with kvplug (greedy, and seeded sampling with n = 2) are token for token those
  of vLLM without prefix caching, over shared prefixes, evictions and aborts;
- tenants do not share cache; an untested vLLM version is refused unless overridden.
"""

from __future__ import annotations

import gc
import os
import random
from collections.abc import Iterator

import pytest

pytest.importorskip("vllm", reason="vLLM is not installed (pip install 'kvplug[vllm]')")
pytest.importorskip("transformers")

os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"  # the engine core runs in this process

from vllm import LLM, SamplingParams  # noqa: E402
from vllm.sampling_params import RequestOutputKind  # noqa: E402

from kvplug.tools.tiny_model import build_tiny_model  # noqa: E402
from kvplug.vllm.block_pool import KVPlugBlockPool  # noqa: E402
from kvplug.vllm.version import UnsupportedEngineError  # noqa: E402

pytestmark = pytest.mark.vllm_engine  # in-process engines: vLLM's CPU build

BLOCK = 32
WORDS = [
    "alpha",
    "beta",
    "gamma",
    "delta",
    "epsilon",
    "zeta",
    "theta",
    "kappa",
    "lambda",
    "sigma",
    "omega",
]


@pytest.fixture(scope="module")
def models(tmp_path_factory) -> dict[str, str]:
    root = tmp_path_factory.mktemp("models")
    return {arch: str(build_tiny_model(root / arch, arch=arch)) for arch in ("llama", "gemma3")}


def make_llm(model: str, policy: str | None, blocks: int, **kwargs) -> LLM:
    """An in-process engine; `policy` None means stock vLLM."""
    kwargs.setdefault("max_model_len", 1024)
    if policy is not None:
        kwargs["scheduler_cls"] = "kvplug.vllm.Scheduler"
        kwargs["additional_config"] = {"kvplug": {"policy": policy}}
    return LLM(
        model=model,
        enforce_eager=True,
        block_size=BLOCK,
        num_gpu_blocks_override=blocks,
        gpu_memory_utilization=0.25,
        dtype="float32",
        seed=0,
        **kwargs,
    )


@pytest.fixture
def engines() -> Iterator[list[LLM]]:
    """Engines created by a test, shut down after it (their KV caches are freed)."""
    made: list[LLM] = []
    yield made
    for llm in made:
        llm.llm_engine.engine_core.shutdown()
    made.clear()
    gc.collect()


def scheduler_of(llm: LLM):
    return llm.llm_engine.engine_core.engine_core.scheduler


def text(rng: random.Random, words: int) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(words))


def skewed_prompts(seed: int = 0, n: int = 45) -> list[str]:
    """A few shared system prompts, reused with a skew, each with its own question."""
    rng = random.Random(seed)
    systems = [text(rng, 60) for _ in range(4)]
    return [
        systems[min(int(rng.expovariate(1.0)), 3)] + " " + text(rng, rng.randint(5, 50))
        for _ in range(n)
    ]


def cached_tokens(llm: LLM, prompts: list[str], batch: int = 3) -> list[int]:
    params = SamplingParams(temperature=0, max_tokens=4)
    counts = []
    for i in range(0, len(prompts), batch):
        outputs = llm.generate(prompts[i : i + batch], params, use_tqdm=False)
        counts += [o.num_cached_tokens for o in outputs]
    return counts


# -- the pool is kvplug's under every coordinator ------------------------------------------


@pytest.mark.parametrize(
    ("arch", "caching", "coordinator"),
    [
        ("llama", True, "UnitaryKVCacheCoordinator"),
        ("llama", False, "KVCacheCoordinatorNoPrefixCache"),
        ("gemma3", True, "HybridKVCacheCoordinator"),
    ],
)
def test_kvplug_pool_serves_every_coordinator(models, engines, arch, caching, coordinator):
    llm = make_llm(models[arch], "cost", 96, enable_prefix_caching=caching)
    engines.append(llm)
    scheduler = scheduler_of(llm)
    pool = scheduler.kv_cache_manager.block_pool
    assert type(scheduler.kv_cache_manager.coordinator).__name__ == coordinator
    assert isinstance(pool, KVPlugBlockPool)
    counts = cached_tokens(llm, skewed_prompts(n=12))
    pool.check_invariants()
    assert (max(counts) > 0) == caching
    assert scheduler.kvplug_stats.requests == 12
    assert scheduler.kvplug_stats.matched_tokens == sum(counts)


# -- cached-token counts: lru is stock vLLM, cost follows its own rule ---------------------


@pytest.mark.parametrize(("arch", "blocks"), [("llama", 48), ("gemma3", 100)])
def test_lru_reproduces_stock_vllm_cached_tokens(models, engines, arch, blocks):
    prompts = skewed_prompts()
    stock = make_llm(models[arch], None, blocks)
    engines.append(stock)
    expected = cached_tokens(stock, prompts)
    kvplug = make_llm(models[arch], "lru", blocks)
    engines.append(kvplug)
    got = cached_tokens(kvplug, prompts)
    assert got == expected
    assert scheduler_of(kvplug).kvplug_stats.evictions > 0  # the budget really was tight
    scheduler_of(kvplug).kv_cache_manager.block_pool.check_invariants()


def scan_workload(seed: int = 1) -> tuple[list[str], str]:
    """A 10-block prefix used three times, then two one-off prompts of about 10 blocks
    each (the cache has 24), then the prefix again. Returns (all but the last, the last)."""
    rng = random.Random(seed)
    hot = text(rng, 70)
    warm = [hot + " " + text(rng, 8) for _ in range(3)]
    scan = [text(rng, 60) for _ in range(2)]
    return warm + scan, hot + " " + text(rng, 8)


def test_cost_keeps_a_reused_prefix_through_a_scan_that_evicts_it_in_stock(models, engines):
    prompts, last = scan_workload()
    counts = {}
    for policy in (None, "lru", "cost"):
        llm = make_llm(models["llama"], policy, 24, max_model_len=512)
        engines.append(llm)
        counts[policy] = cached_tokens(llm, [*prompts, last], batch=1)
    whole_prefix = counts[None][1]
    assert whole_prefix >= 9 * BLOCK
    assert counts["lru"] == counts[None]
    # Stock: the prefix was released before the one-off prompts' blocks, so the second
    # one-off prompt evicts it, tail first.
    assert counts[None][-1] < whole_prefix
    # cost: the prefix's blocks were reused twice (rank 3 x P x value) and the one-off
    # blocks never (1 x P x value), so the one-off blocks go first and the prefix stays.
    assert counts["cost"][:-1] == counts[None][:-1]
    assert counts["cost"][-1] == whole_prefix


# -- outputs ---------------------------------------------------------------------------------


def run_with_aborts(llm: LLM, prompts: list[str]) -> dict[str, list[list[int]]]:
    """Add requests in waves, abort some mid-decode; the token ids of every other one."""
    engine = llm.llm_engine
    final = RequestOutputKind.FINAL_ONLY  # one output per request, with all its samples
    greedy = SamplingParams(temperature=0, max_tokens=12, output_kind=final)
    # vLLM refuses n > 1 with greedy sampling; a per-request seed makes sampling repeatable.
    pair = SamplingParams(temperature=1.0, max_tokens=12, n=2, seed=7, output_kind=final)
    done: dict[str, list[list[int]]] = {}
    aborted: set[str] = set()
    for wave in range(0, len(prompts), 6):
        for i, prompt in enumerate(prompts[wave : wave + 6], start=wave):
            engine.add_request(f"r{i}", prompt, pair if i % 5 == 0 else greedy)
        for step in range(200):
            if step == 3:
                victims = [f"r{i}" for i in range(wave, wave + 6) if i % 4 == 1]
                engine.abort_request(victims)
                aborted.update(victims)
            for output in engine.step():
                if output.finished and output.request_id not in aborted:
                    done[output.request_id] = [list(c.token_ids) for c in output.outputs]
            if not engine.has_unfinished_requests():
                break
    return done


@pytest.mark.parametrize(("arch", "blocks"), [("llama", 48), ("gemma3", 100)])
def test_outputs_match_vllm_without_prefix_caching(models, engines, arch, blocks):
    """On the hybrid Gemma3-style model the pool's cross-group rule is on: a victim takes
    the other sliding-window groups' blocks at its position with it."""
    prompts = skewed_prompts(seed=3, n=24)
    reference_llm = make_llm(models[arch], None, blocks, enable_prefix_caching=False)
    engines.append(reference_llm)
    reference = run_with_aborts(reference_llm, prompts)
    kvplug = make_llm(models[arch], "cost", blocks)
    engines.append(kvplug)
    got = run_with_aborts(kvplug, prompts)
    stats = scheduler_of(kvplug).kvplug_stats
    assert stats.matched_tokens > 0 and stats.evictions > 0
    hybrid = arch == "gemma3"
    assert bool(scheduler_of(kvplug).kv_cache_manager.block_pool.group_kinds) == hybrid
    assert (stats.retired > 0) == hybrid
    assert got == reference
    assert any(len(samples) == 2 for samples in got.values())
    assert len(got) < len(prompts)  # some were aborted
    pool = scheduler_of(kvplug).kv_cache_manager.block_pool
    pool.check_invariants()
    assert pool.get_num_free_blocks() == pool.num_gpu_blocks - 1  # aborts leaked nothing


# -- namespaces and versions ---------------------------------------------------------------


def test_tenants_do_not_share_cache(models, engines):
    llm = make_llm(models["llama"], "cost", 64)
    engines.append(llm)
    prompt = skewed_prompts(n=1)[0]

    def cached(tenant: str) -> int:
        params = SamplingParams(temperature=0, max_tokens=2, extra_args={"kvplug_tenant": tenant})
        return llm.generate([prompt], params, use_tqdm=False)[0].num_cached_tokens

    assert cached("a") == 0
    assert cached("a") > 0
    assert cached("b") == 0
    assert cached("b") > 0


@pytest.mark.parametrize("salt_kv_events", [False, True])
def test_kv_events_keep_vllm_hashes_for_a_router_unless_salted(models, salt_kv_events):
    """With KV events on, a default-tenant request keeps vLLM's own block hashes (what a
    router recomputing them from the prompt, such as llm-d's precise prefix-cache scorer,
    derives), unless ``namespace.salt_kv_events``; another tenant is always salted."""
    from vllm.config import KVEventsConfig
    from vllm.utils.hashing import get_hash_fn_by_name
    from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash
    from vllm.v1.request import Request

    import kvplug.vllm
    from kvplug.bench.vllm_step import Workload, build_vllm_config, scheduler_kwargs

    workload = Workload(block_size=BLOCK)
    config = build_vllm_config(models["llama"], workload, 64)
    config.kv_events_config = KVEventsConfig(enable_kv_cache_events=True, publisher="null")
    config.additional_config = {"kvplug": {"namespace": {"salt_kv_events": salt_kv_events}}}
    scheduler = kvplug.vllm.Scheduler(**scheduler_kwargs(config, workload, 64))
    hash_fn = get_hash_fn_by_name(config.cache_config.prefix_caching_hash_algo)
    init_none_hash(hash_fn)
    hasher = get_request_block_hasher(BLOCK, hash_fn)
    prompt = list(range(10, 10 + 3 * BLOCK))

    def added(name: str, tenant: str | None) -> Request:
        extra = {"kvplug_tenant": tenant} if tenant else None
        params = SamplingParams(max_tokens=2, extra_args=extra)
        request = Request(name, prompt, params, None, block_hasher=hasher)
        scheduler.add_request(request)
        return request

    router_view = Request("router", prompt, SamplingParams(max_tokens=2), None, block_hasher=hasher)
    default, other = added("default", None), added("other", "acme")
    assert len(router_view.block_hashes) == 3
    if salt_kv_events:
        assert default.cache_salt and default.block_hashes != router_view.block_hashes
    else:
        assert default.cache_salt is None and default.block_hashes == router_view.block_hashes
    assert other.cache_salt and other.block_hashes[0] != router_view.block_hashes[0]


def test_untested_vllm_is_refused_unless_overridden(models, engines, monkeypatch):
    monkeypatch.setattr("kvplug.vllm.version.installed_vllm_version", lambda: "0.31.2")
    with pytest.raises(UnsupportedEngineError, match=r"supports vLLM .*0\.32.*0\.31\.2"):
        make_llm(models["llama"], "cost", 48)
    gc.collect()
    llm = LLM(
        model=models["llama"],
        enforce_eager=True,
        block_size=BLOCK,
        num_gpu_blocks_override=48,
        max_model_len=512,
        gpu_memory_utilization=0.25,
        scheduler_cls="kvplug.vllm.Scheduler",
        additional_config={"kvplug": {"strict_version": False}},
    )
    engines.append(llm)
    assert isinstance(scheduler_of(llm).kv_cache_manager.block_pool, KVPlugBlockPool)
