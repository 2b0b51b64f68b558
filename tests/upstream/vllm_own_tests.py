"""Run vLLM's own KV-cache tests twice, on vLLM's pool and on kvplug's, and compare.

    python tests/upstream/vllm_own_tests.py 0.34.0 [--policies lru,cost] [-- pytest args]

For the installed vLLM release (the interpreter running this script, with whatever
``PYTHONPATH`` selects it), this downloads that release's source distribution from PyPI
(checked against the pinned sha256), extracts its ``tests/v1/core`` and the helpers
they import under ``build/vllm-tests/<release>/`` (rebuilt from PyPI by any clone), runs
the block-pool, KV-cache-manager and prefix-caching tests there once as vLLM ships them
(*stock*) and once per kvplug policy through `kvplug_pool_plugin` (kvplug's pool and
manager), and fails unless every test that passes on stock passes on kvplug; with a
policy other than ``lru`` the tests that assert vLLM's own eviction order
(`STOCK_ORDER_TESTS`) are reported, not required. It prints the counts and the tests
stock itself cannot run here.

vLLM's scheduler tests build a scheduler from the configuration of a hub model
(`HUB_MODEL`), and the hub is offline here: the runs get a private Hugging Face cache
holding a tiny stand-in under that name (`kvplug.tools.tiny_model`, with the original's
2048-token context), used for nothing else. Where vLLM finds no platform to build a
configuration for (0.33 and 0.34's CUDA wheels on a machine without a GPU), the scheduler
test files (`SCHEDULER_TESTS`) are left out and said so; tests naming other hub models
(multimodal ones) fail on stock and are listed.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import subprocess
import sys
import tarfile
import tempfile
import urllib.request
import xml.etree.ElementTree as ET
from pathlib import Path

import vllm

ROOT = Path(__file__).resolve().parents[2]
HERE = Path(__file__).resolve().parent
SDISTS = {
    "0.32.0": (
        "d5/df/5471312c76e335eaa2b8333e87ea39f0d37bfe24f10a582620e34ff12e33",
        "d2c957d5eee3d0985012151315ddc62cbe0cd368fc96a5fc3510438d9dddf2ad",
    ),
    "0.33.0": (
        "f7/25/aa5684e9c59d6fc75f78926b7f15e8d9adc7de2d9e6e7575b80776ad8169",
        "f4c33c2503d52bb411146afa9618a4f48bed68912f617e6803ac8d76e4c74112",
    ),
    "0.34.0": (
        "92/21/6e0b077dc4a0b28f5a8ce8bb352a38d7196650d681fd4faa87f8dc622eff",
        "fcad848b246a9d8652b47e6425af92334dc02492f9802720f54e27b823cf0113",
    ),
}
# what vLLM's tests import besides tests/v1/core
HELPERS = ("tests/v1/kv_connector/unit/utils.py", "tests/v1/spec_decode/utils.py")
# the block pool, the KV cache manager, its single-type managers, prefix caching
TESTS = (
    "tests/v1/core/test_prefix_caching.py",
    "tests/v1/core/test_single_type_kv_cache_manager.py",
    "tests/v1/core/test_kv_sharing.py",
    "tests/v1/core/prefix_cache/test_partial_prefix_cache_hits.py",
    "tests/v1/core/prefix_cache/test_partial_prefix_cache_primitives.py",
    "tests/v1/core/prefix_cache/test_mamba_eagle_resume_checkpoint.py",
    "tests/v1/core/test_deferred_block_free.py",
    "tests/v1/core/test_swa_inflight_window_free.py",
    "tests/v1/core/test_kv_cache_metrics.py",
)
# the scheduler over the manager and pool (its model config from the stand-in below)
SCHEDULER_TESTS = (
    "tests/v1/core/test_scheduler.py",
    "tests/v1/core/test_async_scheduler.py",
    "tests/v1/core/test_priority_preemption_bug.py",
    "tests/v1/core/test_priority_scheduler_random.py",
)
# the model vLLM's scheduler tests name; they read only its configuration
HUB_MODEL = "facebook/opt-125m"

# tests asserting which block vLLM's own LRU order evicts: another policy may evict another
STOCK_ORDER_TESTS = {
    "tests.v1.core.test_prefix_caching::test_evict": "the free queue's order after frees",
}


def fetch(release: str) -> Path:
    """The folder holding `release`'s tests, downloaded and extracted once."""
    if release not in SDISTS:
        pinned = ", ".join(sorted(SDISTS))
        raise SystemExit(f"no pinned source distribution for vLLM {release}; pinned: {pinned}")
    folder = ROOT / "build" / "vllm-tests" / release
    if (folder / "tests" / "v1" / "core").is_dir():
        return folder
    path, sha256 = SDISTS[release]
    url = f"https://files.pythonhosted.org/packages/{path}/vllm-{release}.tar.gz"
    with urllib.request.urlopen(url, timeout=120) as response:
        data = response.read()
    if hashlib.sha256(data).hexdigest() != sha256:
        raise SystemExit(f"{url}: sha256 {hashlib.sha256(data).hexdigest()}, pinned {sha256}")
    prefix = f"vllm-{release}/"
    with tempfile.TemporaryDirectory() as tmp:
        archive = Path(tmp) / "sdist.tar.gz"
        archive.write_bytes(data)
        with tarfile.open(archive) as tar:
            members = [
                m
                for m in tar.getmembers()
                if m.isfile()
                and (
                    m.name.startswith(prefix + "tests/v1/core/")
                    or m.name.removeprefix(prefix) in HELPERS
                )
            ]
            for member in members:
                member.name = member.name.removeprefix(prefix)
            staging = Path(tmp) / "tree"
            tar.extractall(staging, members=members, filter="data")
        folder.parent.mkdir(parents=True, exist_ok=True)
        staging.rename(folder)
    return folder


def scheduler_tests() -> tuple[str, ...]:
    """`SCHEDULER_TESTS` where vLLM has a platform to configure a scheduler for."""
    from vllm.platforms import current_platform

    return SCHEDULER_TESTS if current_platform.device_type else ()


def stand_in_hub(folder: Path) -> Path:
    """A Hugging Face home whose cache holds a tiny stand-in for `HUB_MODEL`."""
    home = folder / "hf-home"
    repo = home / "hub" / f"models--{HUB_MODEL.replace('/', '--')}"
    snapshot = repo / "snapshots" / ("0" * 40)
    if not (snapshot / "config.json").exists():
        from kvplug.tools.tiny_model import build_tiny_model

        build_tiny_model(snapshot)
        config = json.loads((snapshot / "config.json").read_text())
        config["max_position_embeddings"] = 2048
        (snapshot / "config.json").write_text(json.dumps(config))
        (repo / "refs").mkdir(parents=True, exist_ok=True)
        (repo / "refs" / "main").write_text("0" * 40)
    return home


def outcomes(report: Path) -> dict[str, str]:
    """Each test's outcome in a JUnit report: passed, failed, error or skipped."""
    found = {}
    for case in ET.parse(report).getroot().iter("testcase"):
        name = f"{case.get('classname')}::{case.get('name')}"
        kinds = {child.tag for child in case}
        found[name] = next((k for k in ("failure", "error", "skipped") if k in kinds), "passed")
    return found


def run(folder: Path, label: str, extra: list[str], plugin: bool, policy: str) -> dict[str, str]:
    report = folder / f"report-{label}.xml"
    env = dict(os.environ, HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1")
    env["HF_HOME"] = str(stand_in_hub(folder))
    # the tests run in `folder`: a relative PYTHONPATH (one selecting vLLM) must still hold
    env["PYTHONPATH"] = os.pathsep.join(
        str(Path(p).resolve()) for p in env.get("PYTHONPATH", "").split(os.pathsep) if p
    )
    args = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-W", "ignore"]
    args += ["--rootdir", str(folder), "-o", "addopts=", f"--junitxml={report}"]
    if plugin:
        paths = [str(HERE), str(ROOT), env.get("PYTHONPATH", "")]
        env["PYTHONPATH"] = os.pathsep.join(p for p in paths if p)
        env["KVPLUG_UPSTREAM_POLICY"] = policy
        args += ["-p", "kvplug_pool_plugin"]
    present = [t for t in TESTS + scheduler_tests() if (folder / t).exists()]
    print(f"== vLLM {vllm.__version__}'s own tests, {label}", flush=True)
    report.unlink(missing_ok=True)
    subprocess.run(args + present + extra, cwd=folder, env=env, check=False)
    if not report.exists():
        raise SystemExit(f"pytest wrote no report for the {label} run (see above)")
    return outcomes(report)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("release", help="the installed vLLM release, e.g. 0.34.0")
    parser.add_argument("--policies", default="lru,cost", help="kvplug policies (lru,cost)")
    parser.add_argument("pytest_args", nargs="*", help="more pytest arguments (after --)")
    options = parser.parse_args()
    if vllm.__version__ != options.release:
        raise SystemExit(f"vLLM {vllm.__version__} is installed, not {options.release}")
    folder = fetch(options.release)
    stock = run(folder, "stock", options.pytest_args, plugin=False, policy="")
    passed = {name for name, outcome in stock.items() if outcome == "passed"}
    cannot = sorted(name for name, outcome in stock.items() if outcome in ("failure", "error"))
    summary = [f"vLLM {options.release}: stock passes {len(passed)} of {len(stock)}"]
    if not scheduler_tests():
        summary.append(
            f"no platform to configure a scheduler for: {len(SCHEDULER_TESTS)} scheduler "
            "test files left out"
        )
    lost: list[str] = []
    for policy in options.policies.split(","):
        ours = run(folder, f"kvplug-{policy}", options.pytest_args, True, policy)
        differ = sorted(name for name in passed if ours.get(name) != "passed")
        allowed = [n for n in differ if policy != "lru" and n in STOCK_ORDER_TESTS]
        lost += [f"{n} [{policy}]: {ours.get(n, 'not run')}" for n in differ if n not in allowed]
        line = f"kvplug {policy} passes {sum(1 for o in ours.values() if o == 'passed')}"
        if allowed:
            reasons = ", ".join(f"{n.split('::')[1]} ({STOCK_ORDER_TESTS[n]})" for n in allowed)
            line += f"; evicts in its own order where stock's is asserted: {reasons}"
        summary.append(line)
    print("\n" + "\n".join(summary))
    print(f"stock fails {len(cannot)} here (hub models without a stand-in, no platform):")
    for name in cannot:
        print(f"  {name}")
    if lost:
        print(f"\n{len(lost)} tests pass on vLLM's pool and not on kvplug's:")
        for line in lost:
            print(f"  {line}")
        raise SystemExit(1)


if __name__ == "__main__":
    main()
