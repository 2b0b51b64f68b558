"""Fleets: kvplug servers behind a real router (`kvplug.serving.routers`).

The router commands and checks run anywhere; the smoke test starts two kvplug vLLM servers
behind ``vllm-router`` (from ``.venv-routers``, `scripts/envs.sh`), sends chats through it,
and checks that later turns find their history cached on the server the router sent them
to, as each server's counters and the router's own agree.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from kvplug.errors import ConfigError
from kvplug.serving.ab import ABConfig, check_fleet
from kvplug.serving.routers import ROUTERS, find_router, router_named, router_view

ROUTER_BIN = Path(__file__).resolve().parents[2] / ".venv-routers" / "bin"


def test_each_router_command_names_its_workers_policy_and_metrics_port() -> None:
    vllm = ROUTERS["vllm-router"].command(
        "/bin/vllm-router", 9000, 9001, ["http://a:1", "http://b:2"], "cache_aware"
    )
    assert vllm[:5] == ["/bin/vllm-router", "--host", "127.0.0.1", "--port", "9000"]
    assert vllm[vllm.index("--worker-urls") + 1 : vllm.index("--policy")] == [
        "http://a:1",
        "http://b:2",
    ]
    assert vllm[vllm.index("--prometheus-port") + 1] == "9001"
    sglang = ROUTERS["sglang-router"].command("sr", 9000, 9001, ["http://a:1"], "round_robin")
    assert sglang[:2] == ["sr", "launch"] and sglang[sglang.index("--policy") + 1] == "round_robin"


def test_a_bad_router_policy_or_fleet_is_refused_naming_what_is_accepted(tmp_path) -> None:
    with pytest.raises(ConfigError, match="unknown router 'nginx'; accepted: vllm-router"):
        router_named("nginx")
    with pytest.raises(ConfigError, match="no routing policy 'kv_aware'; accepted: cache_aware"):
        ROUTERS["sglang-router"].command("sr", 1, 2, [], "kv_aware")
    with pytest.raises(ConfigError, match="2 servers need a router in front"):
        check_fleet(ABConfig(tmp_path, servers=2))
    with pytest.raises(ConfigError, match="does not exist"):
        find_router(ROUTERS["vllm-router"], str(tmp_path / "nothing"))
    fake = tmp_path / "vllm-router"
    fake.write_text("")
    config = ABConfig(tmp_path, servers=2, router="vllm-router", router_bin=str(fake))
    check_fleet(config)
    with pytest.raises(ConfigError, match="kvplug's client only"):
        check_fleet(ABConfig(tmp_path, servers=2, router="vllm-router", router_bin=str(fake),
                             client="vllm-bench"))  # fmt: skip


def test_the_router_s_view_keeps_its_per_worker_samples() -> None:
    text = (
        "# TYPE vllm_router_processed_requests_total counter\n"
        'vllm_router_processed_requests_total{worker="http://a:1"} 5\n'
        'vllm_router_processed_requests_total{worker="http://b:2"} 3\n'
        'vllm_router_requests_total{route="/v1/completions"} 8\n'
    )
    assert router_view(ROUTERS["vllm-router"], text) == {
        'vllm_router_processed_requests_total{worker="http://a:1"}': 5.0,
        'vllm_router_processed_requests_total{worker="http://b:2"}': 3.0,
    }


@pytest.mark.vllm_server
@pytest.mark.skipif(
    not (ROUTER_BIN / "vllm-router").is_file(), reason="needs .venv-routers (scripts/envs.sh)"
)
def test_two_kvplug_servers_behind_vllm_router_hit_on_later_turns(tmp_path) -> None:
    pytest.importorskip("vllm", reason="needs vllm (.venv-vllm)")
    from kvplug.serving.ab import kvplug_arm, run_ab
    from kvplug.serving.report import table
    from kvplug.tools.tiny_model import build_tiny_model

    model = build_tiny_model(tmp_path / "tiny-llama", arch="llama")
    config = ABConfig(
        model, workload="multi-turn", requests=12, concurrency=4, num_blocks=64,
        log_dir=tmp_path / "logs", servers=2, router="vllm-router",
        router_bin=str(ROUTER_BIN / "vllm-router"),
    )  # fmt: skip
    result = run_ab(config, [kvplug_arm({"policy": "cost"})], progress=print)
    (arm,) = result.arms
    assert arm.available, arm.note
    assert arm.succeeded == arm.requests == 12 and arm.failed == 0, arm.errors
    # later turns resend their chat's history: the router sent them where it is cached
    assert arm.cached_tokens > 0
    assert len(arm.server_hits) == 2 and sum(arm.server_hits) > 0
    if arm.server_preemptions == 0:  # each server's counters add up to the responses'
        assert sum(arm.server_queries) == arm.prompt_tokens
        assert sum(arm.server_hits) == arm.cached_tokens
    processed = {k: v for k, v in arm.router_view.items() if "processed_requests" in k}
    assert sum(processed.values()) == 12, arm.router_view
    assert arm.kvplug_metrics.get("kvplug_requests_total", 0) >= 12  # kvplug ran in both
    text = table(result)
    assert "server 2 prefix hits" in text and "vllm_router_processed_requests_total" in text
