"""kvplug's SGLang entry point and the ``kvplug`` radix-cache backend, at launch.

The backend is called here as SGLang's scheduler calls it, with a real
`TreeCacheBuildContext` over real CPU pools, under SGLang's runtime configuration:

- the entry point adds the ``kvplug-<name>`` choices (no offline policy), their
  strategies and the two backends, and changes nothing SGLang selects by default;
- ``--radix-cache-backend kvplug`` alone serves kvplug's default policy (``cost``) and
  says so once in the log; ``kvplug-<name>`` picks another; config keys come from
  ``--radix-eviction-policy-config`` or ``$KVPLUG_CONFIG``;
- bad input stops the launch with a clear error: an unknown ``kvplug-`` policy (SGLang's
  own argument check, listing kvplug's choices), a bad config key or value, an SGLang
  policy with the kvplug backend, an unsupported SGLang version, a missing private name,
  an option the backend does not serve;
- tenants never share cached state; the metrics keep vLLM's names.
"""

from __future__ import annotations

import json
import logging
from array import array
from contextlib import contextmanager
from typing import Any

import pytest

pytest.importorskip("sglang", reason="SGLang is not installed (see requirements/sglang-replay.txt)")

import torch  # noqa: E402
from sglang.srt.mem_cache import utils as sglang_cache_utils  # noqa: E402
from sglang.srt.mem_cache.allocator import TokenToKVPoolAllocator  # noqa: E402
from sglang.srt.mem_cache.cache_init_params import CacheInitParams  # noqa: E402
from sglang.srt.mem_cache.memory_pool import ReqToTokenPool  # noqa: E402
from sglang.srt.mem_cache.registry import (  # noqa: E402
    TreeCacheBuildContext,
    get_radix_cache_factory,
)
from sglang.srt.runtime_context import use_context  # noqa: E402
from sglang.srt.server_args import ServerArgs  # noqa: E402

from kvplug.engine_version import UnsupportedEngineError  # noqa: E402
from kvplug.errors import ConfigError  # noqa: E402
from kvplug.replay.arms.sglang import _scheduler_context  # noqa: E402
from kvplug.sglang import plugin  # noqa: E402
from kvplug.sglang.backend import KVPlugRadixCache, kvplug_radix_cache  # noqa: E402
from kvplug.sglang.namespace import RequestNamespace  # noqa: E402
from kvplug.sglang.tree_core import KVPlugTreeCore  # noqa: E402
from kvplug.sglang.version import check_private_names  # noqa: E402

plugin.register()


@contextmanager
def scheduler() -> Any:
    with use_context(_scheduler_context()):
        yield


def make_ctx(policy: str = "lru", config: dict | None = None, **flags: Any) -> Any:
    """What SGLang's scheduler hands a radix-cache factory, over 64 CPU slots."""
    allocator = TokenToKVPoolAllocator(64, torch.float16, "cpu", kvcache=None, need_sort=False)
    params = CacheInitParams(
        disable=False,
        req_to_token_pool=ReqToTokenPool(
            size=8, max_context_len=64, device="cpu", enable_memory_saver=False
        ),
        token_to_kv_pool_allocator=allocator,
        page_size=1,
        eviction_policy=policy,
        eviction_policy_config=config,
        enable_metrics=flags.pop("enable_metrics", False),
    )
    server_args = ServerArgs(model_path="dummy", device="cpu")
    server_args.hicache_storage_backend = flags.pop("hicache_storage_backend", None)
    server_args._radix_eviction_policy_explicitly_set = flags.pop("explicit", policy != "lru")
    return TreeCacheBuildContext(
        server_args=server_args,
        params=params,
        is_hybrid_swa=flags.pop("is_hybrid_swa", False),
        is_hybrid_ssm=False,
        enable_hierarchical_cache=flags.pop("enable_hierarchical_cache", False),
        disable_radix_cache=False,
        tp_worker=None,
        model_config=None,
        tp_size=1,
        tp_rank=0,
        tp_group=None,
        full_tokens_per_layer=flags.pop("full_tokens_per_layer", None),
    )


def build(*args: Any, **kwargs: Any) -> Any:
    with scheduler():
        return get_radix_cache_factory("kvplug")(make_ctx(*args, **kwargs))


def test_entry_point_is_declared() -> None:
    from importlib.metadata import entry_points

    (entry,) = [ep for ep in entry_points(group="sglang.srt.plugins") if ep.name == "kvplug"]
    assert entry.value == "kvplug.sglang.plugin:register"


def test_plugin_adds_choices_strategies_and_backends() -> None:
    from sglang.srt.arg_groups.choices import RADIX_EVICTION_POLICY_CHOICES
    from sglang.srt.mem_cache.unified_cache.tree_core_registry import (
        registered_tree_core_backends,
    )

    for name in ("kvplug-cost", "kvplug-lru", "kvplug-lfu", "kvplug-gdsf"):
        assert name in RADIX_EVICTION_POLICY_CHOICES
        assert name in sglang_cache_utils._EVICTION_POLICY_FACTORIES
    assert "kvplug-belady" not in RADIX_EVICTION_POLICY_CHOICES  # offline only
    assert get_radix_cache_factory("kvplug") is kvplug_radix_cache
    assert "kvplug" in registered_tree_core_backends()
    plugin.register()  # idempotent


def test_third_party_policies_appear(monkeypatch: pytest.MonkeyPatch) -> None:
    from kvplug.policies import registry as policies
    from kvplug.policies.lru import LRUPolicy
    from kvplug.sglang.strategy import policy_choices

    class MinePolicy(LRUPolicy):
        name = "mine"

    registry = policies._registry()
    monkeypatch.setattr(policies, "_registry", lambda: {**registry, "mine": MinePolicy})
    assert "kvplug-mine" in policy_choices()


def test_default_sglang_cache_is_unchanged() -> None:
    """Without --radix-cache-backend kvplug, SGLang builds and ranks as before."""
    from sglang.srt.mem_cache.evict_policy import LRUStrategy
    from sglang.srt.mem_cache.registry import default_radix_cache_factory

    with scheduler():
        ctx = make_ctx()
        ctx.params.tree_core_backend = "python"
        cache = default_radix_cache_factory(ctx)
    assert type(cache).__name__ == "UnifiedRadixCache"
    assert type(cache.tree_core).__name__ == "UnifiedTreeCore"
    assert isinstance(cache.tree_core.eviction_strategy, LRUStrategy)


def test_kvplug_policy_without_the_backend_is_refused() -> None:
    """``--radix-eviction-policy kvplug-cost`` on SGLang's own cache gets kvplug's
    message, naming the flag: from the Python tree core (which would rank it as recency)
    and from the Rust core's adapter (which would die on the name), both of which build
    the strategy by name before anything else."""
    from sglang.srt.mem_cache.registry import default_radix_cache_factory
    from sglang.srt.mem_cache.rust_tree_core.adapter import RustUnifiedTreeCore
    from sglang.srt.mem_cache.unified_cache.component_type import ComponentType

    with scheduler():
        ctx = make_ctx("kvplug-cost")
        ctx.params.tree_core_backend = "python"
        with pytest.raises(ConfigError, match="add --radix-cache-backend kvplug"):
            default_radix_cache_factory(ctx)
        ctx.params.tree_components = (ComponentType.FULL,)
        with pytest.raises(ConfigError, match="kvplug-cost is kvplug's policy"):
            RustUnifiedTreeCore(ctx.params)


def test_backend_alone_serves_cost_and_logs_once(
    caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A full-attention model runs on SGLang's Rust core, kvplug naming its victims; the
    log says which core runs, and why."""
    from kvplug.sglang.rust_core import KVPlugRustTreeCore

    monkeypatch.delenv("KVPLUG_SGLANG_TREE_CORE", raising=False)
    for core, kind, named in (
        (None, KVPlugRustTreeCore, "Rust core"),
        ("rust", KVPlugRustTreeCore, "Rust core"),
        ("python", KVPlugTreeCore, "Python core"),
    ):
        if core is not None:
            monkeypatch.setenv("KVPLUG_SGLANG_TREE_CORE", core)
        caplog.clear()
        with caplog.at_level(logging.INFO, logger="sglang.kvplug"):
            cache = build()
        assert isinstance(cache, KVPlugRadixCache)
        assert isinstance(cache.tree_core, kind)
        assert cache.tree_core.eviction_strategy.config.policy == "cost"
        active = [r.getMessage() for r in caplog.records if "kvplug is active" in r.getMessage()]
        assert len(active) == 1 and "policy=cost" in active[0] and named in active[0]


def test_backend_installs_kvplug_components_for_every_state() -> None:
    """On the Python core (a hybrid model's), the backend's parameters name kvplug's
    component for full attention, sliding window and Mamba, keeping any other override."""
    from sglang.srt.mem_cache.unified_cache.component_type import ComponentType

    from kvplug.config import KVPlugConfig
    from kvplug.sglang.backend import apply_kvplug
    from kvplug.sglang.components import (
        KVPlugFullComponent,
        KVPlugMambaComponent,
        KVPlugSWAComponent,
    )

    other = object()
    params = CacheInitParams.__new__(CacheInitParams)
    params.component_registry_override = {ComponentType.C128: other}
    params.tree_components = (ComponentType.FULL, ComponentType.SWA)  # a hybrid: Python core
    assert apply_kvplug(params, KVPlugConfig.load({"policy": "lru"}))[0] == "python"
    assert params.component_registry_override == {
        ComponentType.FULL: KVPlugFullComponent,
        ComponentType.SWA: KVPlugSWAComponent,
        ComponentType.MAMBA: KVPlugMambaComponent,
        ComponentType.C128: other,
    }


def test_policy_and_config_from_sglang_arguments() -> None:
    cache = build("kvplug-lfu")
    assert cache.tree_core.eviction_strategy.config.policy == "lfu"
    cache = build("kvplug-cost", {"policy_config": {"ghost_ratio": 3.0}})
    assert cache.tree_core.eviction_strategy.config.policy_config == {"ghost_ratio": 3.0}


def test_config_from_the_environment(tmp_path: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    path = tmp_path / "kvplug.json"
    path.write_text(json.dumps({"policy": "gdsf"}))
    monkeypatch.setenv("KVPLUG_CONFIG", str(path))
    assert build().tree_core.eviction_strategy.config.policy == "gdsf"
    assert build("kvplug-lru").tree_core.eviction_strategy.config.policy == "lru"


@pytest.mark.parametrize(
    ("policy", "config", "message"),
    [
        ("kvplug-cost", {"polcy": "lru"}, r"unknown key 'polcy'.*did you mean 'policy'"),
        ("kvplug-cost", {"policy_config": {"nope": 1}}, r"'policy_config.nope' for policy 'cost'"),
        (
            "kvplug-cost",
            {"namespace": {"tenant": 5}},
            r"'namespace.tenant' = 5 .* must be a string",
        ),
        ("kvplug-cost", {"policy": "lru"}, r"contradicts --radix-eviction-policy kvplug-cost"),
        ("lfu", None, r"--radix-eviction-policy lfu is SGLang's; use kvplug-<name>"),
        ("kvplug-cost", {"block_size": 16}, r"block_size 16 cannot be served"),
    ],
)
def test_bad_config_stops_the_launch(policy: str, config: dict | None, message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        build(policy, config)


def test_unknown_kvplug_policy_is_refused_by_sglang_arguments(
    capsys: pytest.CaptureFixture[str],
) -> None:
    from sglang.srt.server_args import prepare_server_args

    argv = ["--model-path", "dummy", "--radix-cache-backend", "kvplug"]
    with pytest.raises(SystemExit):
        prepare_server_args([*argv, "--radix-eviction-policy", "kvplug-nope"])
    error = capsys.readouterr().err
    assert "invalid choice: 'kvplug-nope'" in error and "kvplug-cost" in error


def test_unsupported_sglang_version(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr("kvplug.sglang.version.installed_sglang_version", lambda: "0.4.9")
    with pytest.raises(UnsupportedEngineError, match=r"supports SGLang .*0\.5\.23.*0\.4\.9"):
        build()
    monkeypatch.setenv("KVPLUG_ALLOW_UNTESTED_SGLANG", "1")
    assert isinstance(build(), KVPlugRadixCache)  # overridden: a warning, not an error


def test_missing_private_name_is_named() -> None:
    with pytest.raises(UnsupportedEngineError, match=r"sglang.srt.mem_cache.utils._GONE"):
        check_private_names((("sglang.srt.mem_cache.utils", "_GONE"),))
    check_private_names()  # every name kvplug reaches exists in this SGLang


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (
            {"enable_hierarchical_cache": True, "is_hybrid_swa": True, "full_tokens_per_layer": 8},
            "--enable-hierarchical-cache with a sliding-window or Mamba model",
        ),
        (
            {"enable_hierarchical_cache": True, "hicache_storage_backend": "file"},
            "--hicache-storage-backend file",
        ),
        ({"is_hybrid_swa": True, "full_tokens_per_layer": 0}, "sliding-window layers only"),
    ],
)
def test_unserved_options_are_refused(flags: dict, message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        build(**flags)


def _request(rid: str, prompt: list[int], tenant: str | None) -> Any:
    from sglang.srt.managers.schedule_batch import Req
    from sglang.srt.sampling.sampling_params import SamplingParams

    custom = {"kvplug_tenant": tenant} if tenant is not None else None
    return Req(rid, "", array("q", prompt), SamplingParams(custom_params=custom))


def serve(cache: Any, rid: str, prompt: list[int], tenant: str | None = None) -> int:
    """One request through `cache` as SGLang's scheduler runs it: match, lock, allocate,
    finish and release into the tree; its cached tokens."""
    from sglang.srt.managers.schedule_batch import FINISH_LENGTH
    from sglang.srt.mem_cache.allocation import alloc_req_slots, alloc_token_slots
    from sglang.srt.mem_cache.common import release_kv_cache

    with scheduler():
        req = _request(rid, prompt, tenant)
        req.init_next_round_input(cache)
        hits = req.prefix_len
        req.lock = cache.lock(req.last_node)
        alloc_req_slots(cache.req_to_token_pool, [req], cache)
        row = req.kv.req_pool_idx
        cache.req_to_token_pool.write((row, slice(0, hits)), cache.prefix_device_indices(req))
        need = len(prompt) - hits
        cache.req_to_token_pool.write(
            (row, slice(hits, len(prompt))), alloc_token_slots(cache, need)
        )
        req.kv.kv_allocated_len = req.kv.kv_committed_len = len(prompt)
        req.cached_tokens = hits  # as SGLang's batch sets it when the prefill runs
        req.finished_reason = FINISH_LENGTH(length=0)
        release_kv_cache(req, cache, checkpoint=True)
    return hits


def test_tenants_share_no_cached_state() -> None:
    cache = build()
    cache.kvplug_namespace = RequestNamespace(("model",), "", False, False)
    prompt = [1, 2, 3, 4, 5]

    def run(rid: str, tenant: str | None) -> int:
        return serve(cache, rid, prompt, tenant)

    assert run("a1", "acme") == 0
    assert run("a2", "acme") == 4  # the same tenant reuses its prefix
    assert run("b1", "globex") == 0  # another tenant does not
    assert run("d1", None) == 0  # nor does the default tenant
    assert run("d2", None) == 4
    assert cache.kvplug_stats.requests == 5
    assert cache.kvplug_stats.matched_tokens == 8
    cache.tree_core.check_invariants()


def test_the_cached_blocks_gauge_counts_pages() -> None:
    """``kvplug_cached_blocks`` and ``kvplug_bytes_held`` count the pages the tree holds,
    not its nodes, on either tree core."""
    from kvplug.core.model_spec import load_model

    class Exporter:
        def __init__(self) -> None:
            self.published: list[tuple[int, int]] = []

        def publish(self, stats: Any) -> None:
            self.published.append((stats.cached_blocks, stats.bytes_held))

    for core in ("rust", "python"):
        with pytest.MonkeyPatch.context() as patch:
            patch.setenv("KVPLUG_SGLANG_TREE_CORE", core)
            cache = build()
        cache.kvplug_exporter = exporter = Exporter()
        cache.kvplug_model = model = load_model(None)
        serve(cache, "a", [1, 2, 3, 4, 5, 6])
        serve(cache, "b", [1, 2, 3, 7, 8])  # splits the first: three nodes, eight pages
        per_token = model.kv_bytes_per_token()
        assert exporter.published == [(6, 6 * per_token), (8, 8 * per_token)], core


def test_metrics_keep_the_vllm_names() -> None:
    from prometheus_client import REGISTRY, generate_latest

    from kvplug.engine_stats import HELP
    from kvplug.sglang.stats import CacheStats, PrometheusExporter

    exporter = PrometheusExporter("0", "cost")
    exporter.publish(CacheStats(requests=3, evictions=2, cached_blocks=7))
    exporter.publish(CacheStats(requests=5, evictions=2, cached_blocks=4))
    text = generate_latest(REGISTRY).decode()
    assert 'kvplug_requests_total{engine="0",policy="cost"} 5.0' in text
    assert 'kvplug_evictions_total{engine="0",policy="cost"} 2.0' in text
    assert 'kvplug_cached_blocks{engine="0",policy="cost"} 4.0' in text
    for field in HELP:
        assert f"kvplug_{field}" in text


@pytest.mark.parametrize("salt_kv_events", [False, True])
def test_kv_events_keep_sglang_keys_for_a_router_unless_salted(salt_kv_events: bool) -> None:
    """With KV events on, a default-tenant request keeps SGLang's key (what a router that
    recomputes keys from the prompt derives) unless ``namespace.salt_kv_events``; another
    tenant is always salted."""
    from types import SimpleNamespace

    from kvplug.config import KVPlugConfig

    config = KVPlugConfig.model_validate({"namespace": {"salt_kv_events": salt_kv_events}})
    server_args = SimpleNamespace(model_path="m", tokenizer_path="t", dtype="bfloat16")
    params = SimpleNamespace(enable_kv_cache_events=True)
    namespace = RequestNamespace.for_server(config, server_args, params)
    default, other = _request("d", [1, 2], None), _request("o", [1, 2], "acme")
    assert namespace.apply(default) is salt_kv_events
    assert (default.cache_salt is not None) is salt_kv_events
    assert namespace.apply(other) and other.cache_salt.startswith("kvplug:")
