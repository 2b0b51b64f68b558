"""Test-wide set-up: hypothesis profiles, the helpers in ``support/``, the engine markers.

Each engine's suites live in their own folders and are selected by marker: every test
under ``vllm/`` and ``serving/`` is marked ``engine_vllm``, every test under ``sglang/``
``engine_sglang`` (a module elsewhere that needs an engine sets ``pytestmark`` itself).
``.ci/run`` runs ``-m "not engine_vllm and not engine_sglang"`` in the core environment
and each engine's marker in that engine's environment.
"""

import os
import sys
from pathlib import Path

import pytest
from hypothesis import HealthCheck, settings

TESTS = Path(__file__).resolve().parent
# helpers shared by several suites (not on sys.path by name `tests`: a folder named like an
# engine, tests/vllm, must never shadow the engine itself)
sys.path.insert(0, str(TESTS / "support"))

ENGINE_FOLDERS = {"vllm": "engine_vllm", "serving": "engine_vllm", "sglang": "engine_sglang"}

# CI runs the property tests at more strength than a developer's run (HYPOTHESIS_PROFILE=ci,
# set by .ci/run): 1,000 examples each, and the cache's lifecycle state machine, which every
# policy shares, 10,000 sequences (`cache_machine.MACHINE_EXAMPLES`). A test that names its
# own count keeps it.
settings.register_profile(
    "ci",
    max_examples=1_000,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
    print_blob=True,
)
settings.register_profile("dev", max_examples=300, deadline=None)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "dev"))


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    for item in items:
        folder = Path(item.fspath).resolve().relative_to(TESTS).parts[0]
        marker = ENGINE_FOLDERS.get(folder)
        if marker:
            item.add_marker(marker)
