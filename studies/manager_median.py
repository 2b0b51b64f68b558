"""Where a typical request's time goes in vLLM's manager: `cost` against `told:cost`.

`kvplug bench manager` reports the median time per request; `told:cost` (vLLM's own pool
handed out the blocks `cost` chose, `kvplug.bench.told_pool`) does the same work minus
kvplug's bookkeeping. This runs both arms on the same trace, each request through one
arm and then the other, and splits each request's time by the pool call it was spent in
(`touch`, `get_new_blocks`, `cache_full_blocks`, `free_blocks`: each pool instance's
calls wrapped with a timer, alike in both arms) and by manager call (prefill, decode,
free). It prints the mean of each part over the requests whose `told:cost` time lies in
each band of ranks (by default 40-60%: the requests around the median), per request.

    .venv-vllm/bin/python studies/manager_median.py --model gemma3-like --fraction 0.25
"""

from __future__ import annotations

import argparse
import gc
import statistics
import time
from collections import defaultdict
from collections.abc import Callable
from typing import Any

from kvplug.bench import vllm_manager
from kvplug.bench.told_pool import record_handouts
from kvplug.core.model_spec import load_model
from kvplug.replay.loop import make_jobs
from kvplug.replay.sources import load_trace

POOL_CALLS = ("touch", "get_new_blocks", "cache_full_blocks", "free_blocks")
MANAGER_CALLS = ("lookup", "prefill", "decode", "free")


def timed_pool(pool: Any, spent: dict[str, float]) -> None:
    """Wrap `pool`'s calls of `POOL_CALLS` on the instance, adding their time to `spent`."""
    for name in POOL_CALLS:
        call: Callable[..., Any] = getattr(pool, name)

        def wrapper(
            *args: Any, _call: Callable[..., Any] = call, _name: str = name, **kwargs: Any
        ) -> Any:
            start = time.perf_counter()
            try:
                return _call(*args, **kwargs)
            finally:
                spent[_name] += time.perf_counter() - start

        setattr(pool, name, wrapper)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--trace", default="packaged:mooncake")
    parser.add_argument("--model", default="gemma3-like")
    parser.add_argument("--fraction", type=float, default=0.25)
    parser.add_argument("--bands", default="0-25,40-60,75-95,95-100", help="rank bands, %%")
    args = parser.parse_args()
    trace = load_trace(args.trace)
    jobs = make_jobs(trace, load_model(None))
    ((_, spec),) = vllm_manager.parse_models(args.model)
    blocks = vllm_manager.pool_blocks(spec, trace, args.fraction)
    size = trace.block_tokens
    stock = vllm_manager.ManagerArm(vllm_manager.STOCK, spec, blocks, size)
    warm = vllm_manager.warmup_requests(stock, jobs, limit=len(jobs) - 10)
    recorder = vllm_manager.ManagerArm("cost", spec, blocks, size)
    handouts = record_handouts(recorder.pool)
    for job in jobs:
        recorder.run(job)
    del recorder, stock
    arms = {
        "cost": vllm_manager.ManagerArm("cost", spec, blocks, size),
        "told:cost": vllm_manager.ManagerArm("told:cost", spec, blocks, size, handouts),
    }
    spent: dict[str, dict[str, float]] = {name: defaultdict(float) for name in arms}
    for name, arm in arms.items():
        timed_pool(arm.pool, spent[name])
    rows: dict[str, list[dict[str, float]]] = {name: [] for name in arms}
    gc.collect()
    gc.freeze()  # as the benchmark does
    for arm in arms.values():
        for job in jobs[:warm]:
            arm.run(job)
    for job in jobs[warm:]:
        for name, arm in arms.items():
            spent[name].clear()
            arm.run(job, vllm_manager._Clock(vllm_manager.GCTimer()))
            took = arm.times[-1]
            row = {call: getattr(took, call) for call in MANAGER_CALLS}
            row["total"] = sum(row.values())
            rows[name].append({**row, **spent[name]})
    order = sorted(range(len(rows["told:cost"])), key=lambda i: rows["told:cost"][i]["total"])
    parts = ["total", *MANAGER_CALLS, *POOL_CALLS]
    print(f"{args.model} at {args.fraction:.0%} ({blocks:,} blocks): µs per request, mean over")
    print("each band of requests ranked by told:cost's time; cost's excess over told:cost")
    print(f"{'band':<8} {'arm':<10} " + " ".join(f"{part:>17}" for part in parts))
    for band in args.bands.split(","):
        low, high = (int(x) for x in band.split("-"))
        chosen = order[len(order) * low // 100 : len(order) * high // 100]
        means = {
            name: {part: statistics.fmean(rows[name][i].get(part, 0.0) for i in chosen) * 1e6
                   for part in parts}
            for name in arms
        }  # fmt: skip
        for name in arms:
            print(f"{band:<8} {name:<10} " + " ".join(f"{means[name][p]:>17.1f}" for p in parts))
        excess = " ".join(f"{means['cost'][p] - means['told:cost'][p]:>+17.1f}" for p in parts)
        print(f"{band:<8} {'excess':<10} {excess}")


if __name__ == "__main__":
    main()
