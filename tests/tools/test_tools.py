"""The benchmark, the demo, the bundled examples and `KVCache.from_config`."""

from __future__ import annotations

import json
import runpy
import subprocess
import sys
from pathlib import Path

import pytest
from click.testing import CliRunner

from kvplug.cli import main
from kvplug.cli.bench import bench_core
from kvplug.config import KVPlugConfig
from kvplug.core.cache import KVCache
from kvplug.core.keys import Namespace
from kvplug.errors import ConfigError
from kvplug.tools.demo import chat_workload, run_demo

ROOT = Path(__file__).resolve().parents[2]


def test_bench_core_reports_every_operation_at_every_size() -> None:
    rows = bench_core([200, 400], requests=20, block_size=4, blocks_per_prompt=4)
    sizes = {(r.operation, r.cached_blocks) for r in rows}
    assert ("lookup, miss", 400) in sizes and ("evict one block", 200) in sizes
    assert all(r.ops_per_s > 0 and r.us_per_op > 0 for r in rows)


def test_bench_cli_prints_json() -> None:
    args = ["bench", "core", "--sizes", "100,200", "--requests", "10", "--format", "json"]
    result = CliRunner().invoke(main, [*args, "--block-size", "4", "--blocks-per-prompt", "2"])
    assert result.exit_code == 0, result.output
    assert {row["cached_blocks"] for row in json.loads(result.output)} == {0, 100, 200}


def test_bench_rejects_bad_sizes() -> None:
    result = CliRunner().invoke(main, ["bench", "core", "--sizes", "ten"])
    assert result.exit_code != 0 and "comma-separated integers" in result.output


def test_python_dash_m_bench_runs() -> None:
    out = subprocess.run(
        [sys.executable, "-m", "kvplug.cli.bench", "core", "--sizes", "50", "--requests", "5"],
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    assert "lookup, hit" in out


def test_demo_reuses_more_with_more_capacity() -> None:
    workload = chat_workload(conversations=12, turns=3)
    small, large = run_demo(96, 16, workload), run_demo(1024, 16, workload)
    assert 0 < small["token_hit_ratio"] < large["token_hit_ratio"]
    assert large["evictions"] == 0 < small["evictions"]
    assert small["cow_copies"] > 0


def test_demo_cli() -> None:
    result = CliRunner().invoke(main, ["demo", "--capacities", "512"])
    assert result.exit_code == 0, result.output
    assert "hit ratio" in result.output


def test_example_config_loads_and_walkthrough_runs() -> None:
    config = KVPlugConfig.load(ROOT / "examples" / "kvplug.yaml")
    assert config == KVPlugConfig()
    runpy.run_path(str(ROOT / "examples" / "core_walkthrough.py"), run_name="__main__")


def test_from_config_applies_every_setting() -> None:
    config = KVPlugConfig.from_dict(
        {
            "block_size": 8,
            "hash_algo": "sha256",
            "enable_prefix_caching": False,
            "namespace": {"model_revision": "v2", "tenant": "t1"},
        }
    )
    cache = KVCache.from_config(config, 16, block_size=32, namespace=Namespace(model="m"))
    assert cache.block_size == 8  # the config wins over the engine's default
    assert cache.hasher.algorithm == "sha256"
    assert not cache.enable_prefix_caching
    assert cache.resolve_namespace() == Namespace(
        model="m", revision="v2", tenant="t1", block_size=8
    )
    with pytest.raises(ConfigError, match="block_size"):
        KVCache.from_config(KVPlugConfig(), 16)
