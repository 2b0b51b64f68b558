"""vLLM's KV cache manager under two builds of kvplug, interleaved in one process.

`kvplug bench manager` compares kvplug's arms with stock in one run, but two runs of it
differ by a few percent (its p50 ratio for one build moved between 1.26x and 1.37x), more
than most changes to the pool save. As `studies/step_builds.py` does for the scheduler
step, this puts the working tree's kvplug and a git revision's (extracted under another
package name and compiled as an install compiles it) in one process: stock and each
(build, policy) arm run the same requests through vLLM's manager, warmed up as the
benchmark warms them, then timed in interleaved rounds whose order rotates. It prints each
arm's p50 time per request and its ratio to stock, the range of the per-round ratios of
this tree's arm to the revision's, and each arm's evictions and hits, which must agree for
one policy (the builds decide alike) unless a rule changed on purpose.

    .venv-vllm/bin/python studies/manager_builds.py --against HEAD --models gemma3-like,full
"""

from __future__ import annotations

import argparse
import gc
import importlib
import statistics
import sys
import tempfile
from pathlib import Path

from step_builds import compile_build, extract_build

import kvplug.bench.vllm_manager as current
from kvplug.core.model_spec import load_model
from kvplug.replay.loop import make_jobs
from kvplug.replay.sources import load_trace


def compare(builds: dict[str, object], model: str, fraction: float, policies: list[str],
            rounds: int, trace: object, jobs: list) -> None:  # fmt: skip
    """Stock and every (build, policy) arm on `model` at `fraction`; print the medians."""
    ((_, spec),) = current.parse_models(model)
    blocks = current.pool_blocks(spec, trace, fraction)  # type: ignore[arg-type]
    block_tokens = trace.block_tokens  # type: ignore[attr-defined]
    arms = [("stock", current.ManagerArm("stock", spec, blocks, block_tokens))]
    for policy in policies:
        for label, module in builds.items():
            ((_, own_spec),) = module.parse_models(model)  # type: ignore[attr-defined]
            arm = module.ManagerArm(policy, own_spec, blocks, block_tokens)  # type: ignore[attr-defined]
            arms.append((f"{label}: {policy}", arm))
    gc.collect()
    gc.freeze()
    try:
        warmup = current.warmup_requests(arms[0][1], jobs, limit=len(jobs) - rounds)
        for _, arm in arms[1:]:
            for job in jobs[:warmup]:
                arm.run(job)
        timed = jobs[warmup:]
        bounds = [round(r * len(timed) / rounds) for r in range(rounds + 1)]
        medians: dict[str, list[float]] = {label: [] for label, _ in arms}
        clock = current._Clock(current.GCTimer())
        for r in range(rounds):
            for label, arm in arms[r % len(arms) :] + arms[: r % len(arms)]:
                start = len(arm.times)
                for job in timed[bounds[r] : bounds[r + 1]]:
                    arm.run(job, clock)
                medians[label].append(statistics.median(t.wall for t in arm.times[start:]))
    finally:
        gc.unfreeze()
    stock = statistics.median(t.wall for t in arms[0][1].times)
    for label, arm in arms:
        p50 = statistics.median(t.wall for t in arm.times)
        print(f"{model:<16} {fraction:4.2f}  {label:<22} p50 {p50 * 1e6:7.1f} us  "
              f"{p50 / stock:5.3f}x  evicted {arm.evictions()}  hits {sum(arm.hits)}")  # fmt: skip
    this, other = builds
    for policy in policies:
        mine, theirs = medians[f"{this}: {policy}"], medians[f"{other}: {policy}"]
        ratios = [a / b for a, b in zip(mine, theirs, strict=True)]
        low, high, middle = min(ratios), max(ratios), statistics.median(ratios)
        print(f"{model:<16} {fraction:4.2f}  {policy}: {this} / {other} per round: median "
              f"{middle:5.3f}, range {low:5.3f}-{high:5.3f}")  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--against", required=True, help="git revision of the other build")
    parser.add_argument("--trace", default="packaged:mooncake")
    parser.add_argument("--models", default="gemma3-like,full")
    parser.add_argument("--policies", default="cost")
    parser.add_argument("--fraction", type=float, default=0.25)
    parser.add_argument("--rounds", type=int, default=20)
    args = parser.parse_args()
    trace = load_trace(args.trace)
    jobs = make_jobs(trace, load_model(None))
    with tempfile.TemporaryDirectory() as tmp:
        other = extract_build(args.against, Path(tmp))
        print("compiled in the other build:", ", ".join(compile_build(Path(tmp), other)) or "none")
        sys.path.insert(0, tmp)
        builds = {"this tree": current,
                  args.against: importlib.import_module(f"{other}.bench.vllm_manager")}  # fmt: skip
        for model in args.models.split(","):
            compare(builds, model, args.fraction, args.policies.split(","), args.rounds,
                    trace, jobs)  # fmt: skip


if __name__ == "__main__":
    main()
