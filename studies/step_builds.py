"""vLLM's scheduler step under two builds of kvplug, interleaved in one process.

``kvplug bench step`` compares kvplug's arms with stock in one run, but on a noisy machine
two runs of it differ by more than a change to the pool saves. This study puts the working
tree's kvplug and the kvplug of a git revision side by side in one process: the revision's
package is extracted (``git archive``) under another name (``kv_<rev>``, every import
renamed), and each arm (stock, and each build with each policy) runs the same request
stream, interleaved in rounds of a few steps. It prints each arm's median thread CPU per
step and its ratio to stock, and each build's evictions, which must agree for one policy
(the builds decide alike) unless a rule changed on purpose.

    .venv-vllm/bin/python studies/step_builds.py --against 5d986f5 --policies lru,cost \
        --blocks 10000,100000 --rounds 60 --steps-per-round 10
"""

from __future__ import annotations

import argparse
import ast
import importlib
import re
import statistics
import subprocess
import sys
import tarfile
import tempfile
from io import BytesIO
from pathlib import Path

import kvplug.bench.vllm_step as current


def _setup_compiled_modules() -> list[str]:
    """The modules an install compiles: ``setup.py``'s `COMPILED_MODULES`."""
    tree = ast.parse((Path(__file__).resolve().parents[1] / "setup.py").read_text())
    for node in tree.body:
        named = isinstance(node, ast.Assign) and getattr(node.targets[0], "id", "")
        if named == "COMPILED_MODULES":
            return list(ast.literal_eval(node.value))
    raise RuntimeError("setup.py names no COMPILED_MODULES")


COMPILED_MODULES = _setup_compiled_modules()
SUBPACKAGES = r"vllm|policies|core|bench|config|errors|replay|hybrid|sglang|serving|tools|cli"
SUBPACKAGES += r"|kernels|fleet"


def extract_build(revision: str, into: Path) -> str:
    """Extract `revision`'s kvplug package into `into` as ``kv_<revision>``; its name."""
    name = "kv_" + re.sub(r"\W", "_", revision)
    archive = subprocess.run(
        ["git", "archive", revision, "kvplug"], check=True, capture_output=True
    ).stdout
    with tarfile.open(fileobj=BytesIO(archive)) as tar:
        tar.extractall(into, filter="data")
    package = into / name
    (into / "kvplug").rename(package)
    for path in package.rglob("*.py"):
        text = path.read_text()
        text = re.sub(r"\bfrom kvplug([. ])", rf"from {name}\1", text)
        text = re.sub(r"\bimport kvplug\b", f"import {name}", text)
        text = re.sub(rf"\bkvplug\.({SUBPACKAGES})\b", rf"{name}.\1", text)
        path.write_text(text)
    return name


def compile_build(into: Path, name: str) -> list[str]:
    """Compile the extracted build's modules that an install compiles (``setup.py``'s
    `COMPILED_MODULES`, with its flags), so that both builds run compiled where this
    tree does; the modules compiled (none without Cython, or with a revision from
    before there were any)."""
    try:
        from Cython.Build import cythonize
    except ImportError:
        return []
    from setuptools import Distribution, Extension
    from setuptools.command.build_ext import build_ext

    extensions = [
        Extension(
            f"{name}.{module[len('kvplug/') : -3].replace('/', '.')}",
            [str(into / name / module[len("kvplug/") :])],
            extra_compile_args=["-O2", "-ffp-contract=off"],
        )
        for module in COMPILED_MODULES
        if (into / name / module[len("kvplug/") :]).exists()
    ]
    if not extensions:
        return []
    command = build_ext(Distribution({"ext_modules": cythonize(extensions, quiet=True)}))
    command.build_lib, command.build_temp = str(into), str(into / "build")
    command.finalize_options()
    command.run()
    return [ext.name for ext in extensions]


def compare(builds: dict[str, object], policies: list[str], blocks: int, rounds: int,
            steps_per_round: int, model_dir: Path) -> None:  # fmt: skip
    """Run stock and every (build, policy) arm interleaved at `blocks`; print the medians."""
    workload = current.Workload()
    config = current.build_vllm_config(model_dir, workload, blocks)
    arms = [("stock", current.Arm("stock", config, workload, blocks))]
    for policy in policies:
        for label, module in builds.items():
            arm = module.Arm(policy, config, workload, blocks)  # type: ignore[attr-defined]
            arms.append((f"{label}: {policy}", arm))
    for _, arm in arms:
        arm.warm_up(1_000_000, settle=50)
    for _ in range(rounds):
        for _, arm in arms:
            for _ in range(steps_per_round):
                arm.step(timed=True)
    stock = statistics.median(t.cpu for t in arms[0][1].times)
    for label, arm in arms:
        cpu = statistics.median(t.cpu for t in arm.times)
        print(f"{blocks:>9,} blocks  {label:<24} {cpu * 1e3:7.3f} ms  "
              f"{cpu / stock:5.3f}x  evicted {arm.evictions()}")  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--against", required=True, help="git revision of the other build")
    parser.add_argument("--policies", default="lru,cost")
    parser.add_argument("--blocks", default="10000,100000")
    parser.add_argument("--rounds", type=int, default=60)
    parser.add_argument("--steps-per-round", type=int, default=10)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        other = extract_build(args.against, Path(tmp))
        print("compiled in the other build:", ", ".join(compile_build(Path(tmp), other)) or "none")
        sys.path.insert(0, tmp)
        other_step = importlib.import_module(f"{other}.bench.vllm_step")
        builds = {"this tree": current, args.against: other_step}
        with current.tiny_model_dir() as model_dir:
            for blocks in args.blocks.split(","):
                compare(builds, args.policies.split(","), int(blocks), args.rounds,
                        args.steps_per_round, model_dir)  # fmt: skip


if __name__ == "__main__":
    main()
