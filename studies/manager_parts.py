"""Where kvplug's time goes in vLLM's manager on a hybrid model: caching, by kind of group.

`kvplug bench manager` times whole manager calls. This splits the caching call the
single-type managers make once per group (`cache_full_blocks`) into what vLLM's own
`BlockPool.cache_full_blocks` takes (stock pays it too) and what kvplug's pool adds
around it (recording the new blocks for the policy, anchoring windows), per request and
per block, for sliding-window and full-attention groups apart. It runs the requests of
`--trace` through one `cost` manager (the first `--warm` untimed), and times the
requests whose prompt spans `--blocks` trace blocks.

    .venv-vllm/bin/python studies/manager_parts.py --model gemma3-like --fraction 0.25
"""

from __future__ import annotations

import argparse
import time
from collections import Counter
from collections.abc import Callable
from typing import Any

from vllm.v1.core.block_pool import BlockPool

from kvplug.bench import vllm_manager
from kvplug.core.model_spec import load_model
from kvplug.replay.loop import make_jobs
from kvplug.replay.sources import load_trace
from kvplug.vllm.dense_pool import DenseCostPool


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--trace", default="packaged:mooncake")
    parser.add_argument("--model", default="gemma3-like")
    parser.add_argument("--fraction", type=float, default=0.25)
    parser.add_argument("--warm", type=int, default=440, help="untimed requests first")
    parser.add_argument("--blocks", default="20-35", help="timed prompts' sizes, in blocks")
    args = parser.parse_args()
    low, high = (int(x) for x in args.blocks.split("-"))
    trace = load_trace(args.trace)
    jobs = make_jobs(trace, load_model(None))
    ((_, spec),) = vllm_manager.parse_models(args.model)
    blocks = vllm_manager.pool_blocks(spec, trace, args.fraction)
    arm = vllm_manager.ManagerArm("cost", spec, blocks, trace.block_tokens)
    pool = arm.pool
    tree = pool.tree_groups
    seconds: Counter[str] = Counter()
    cached: Counter[str] = Counter()
    calls: Counter[str] = Counter()
    timing = [False]

    def kind_of(group: int) -> str:
        return "full attention" if tree is None or group in tree else "sliding window"

    names = ("request", "blocks", "num_cached_blocks", "num_full_blocks", "block_size",
             "kv_cache_group_id")  # fmt: skip

    def timed(method: Callable[..., Any], part: str) -> Callable[..., Any]:
        def wrapper(self: Any, *args: Any, **kwargs: Any) -> Any:
            call = {**dict(zip(names, args, strict=False)), **kwargs}
            new = call["num_full_blocks"] - call["num_cached_blocks"]
            if not timing[0] or new <= 0:
                return method(self, *args, **kwargs)
            kind = kind_of(call["kv_cache_group_id"])
            start = time.perf_counter()
            try:
                return method(self, *args, **kwargs)
            finally:
                seconds[(kind, part)] += time.perf_counter() - start  # type: ignore[index]
                if part == "all":
                    cached[kind] += new
                    calls[kind] += 1

        return wrapper

    BlockPool.cache_full_blocks = timed(BlockPool.cache_full_blocks, "vllm")  # type: ignore[method-assign]
    DenseCostPool.cache_full_blocks = timed(DenseCostPool.cache_full_blocks, "all")  # type: ignore[method-assign]
    for job in jobs[: args.warm]:
        arm.run(job)
    timed_requests = 0
    for job in jobs[args.warm :]:
        timing[0] = low <= len(job.prompt) <= high
        timed_requests += timing[0]
        arm.run(job)

    # the inner timer's own work, which the outer timer counts as kvplug's: a timed no-op
    # call less a bare one, per timed call
    def noop(self: Any, *args: Any, **kwargs: Any) -> None:
        return None

    wrapped, group, sample = timed(noop, "calibration"), next(iter(tree or {0})), 20_000
    timing[0] = True
    costs = []
    for call in (wrapped, noop):
        start = time.perf_counter()
        for _ in range(sample):
            call(None, None, None, 0, 1, 16, group)
        costs.append((time.perf_counter() - start) / sample)
    timer = costs[0] - costs[1]
    print(f"{args.model} at {args.fraction:.0%} ({blocks:,} blocks), `cost`, "
          f"{timed_requests} requests of {low}-{high} blocks")  # fmt: skip
    print(f"{'groups':<16} {'blocks/req':>10} {'vLLM us/req':>12} {'kvplug us/req':>14} "
          f"{'vLLM us/block':>14} {'kvplug us/block':>16}")  # fmt: skip
    print(f"(the timers' own {timer * 1e6:.2f} us a call taken out)")
    for kind in sorted(cached):
        n = cached[kind] / timed_requests
        own = seconds[(kind, "vllm")] / timed_requests * 1e6  # type: ignore[index]
        added = (seconds[(kind, "all")] - calls[kind] * timer) / timed_requests * 1e6 - own  # type: ignore[index]
        print(f"{kind:<16} {n:>10.1f} {own:>12.1f} {added:>14.1f} {own / n:>14.2f} "
              f"{added / n:>16.2f}")  # fmt: skip


if __name__ == "__main__":
    main()
