"""Do hot prefixes survive floods? Hot system prompts' hits with and without bursts.

The synthetic `bursts` workload asks a few hot system prompts all along (sessions
``hot-K``) under floods of one-off long prompts; `hot-prompts` is the same hot requests
without the floods. For each arm and cache size (in blocks: the hot prompts themselves
take 48 or so), the hot requests' hit ratio (prompt tokens served from the cache over
their prompt tokens) in both, and its ratio (bursts over none): 1.0 means the floods cost
the hot prompts nothing. Realistic mode, or one request at a time (``--sequential``);
`belady` for the bound. With ``--retain S``, each kvplug arm also runs as ``ARM+retain``:
the hot requests ask to keep their prefix for S seconds (`KVCache.retain`).

    .venv/bin/python studies/hot_prompts_under_bursts.py --capacities 64,128,256,512 --sequential
"""

from __future__ import annotations

import argparse
from dataclasses import replace

from kvplug.core.model_spec import load_model
from kvplug.replay.loop import Timing, make_jobs, replay
from kvplug.replay.runner import build_arm, replay_clock
from kvplug.replay.synthetic import synthetic_trace
from kvplug.replay.trace import Trace


def hot_hit_ratio(
    name: str, capacity: int, trace: Trace, timing: Timing, sequential: bool = False
) -> float:
    """The hot requests' hit ratio under arm `name` (first admissions only)."""
    jobs = make_jobs(trace, load_model(None))
    arm = build_arm(name, capacity, jobs, sequential, trace.block_tokens, None)
    hot = {i for i, request in enumerate(trace.requests) if request.session.startswith("hot-")}
    hits: dict[int, int] = {}
    admit = arm.admit

    def counting(req_id: int, prompt: list[int], compute: int) -> int | None:
        matched = admit(req_id, prompt, compute)
        if matched is not None and req_id in hot:
            hits.setdefault(req_id, matched)
        return matched

    arm.admit = counting  # type: ignore[method-assign]
    replay(
        arm,
        jobs,
        trace.block_tokens,
        sequential=sequential,
        timing=timing,
        on_admit=replay_clock(arm),
    )
    tokens = sum(trace.requests[i].input_length for i in hot)
    return sum(hits.values()) * trace.block_tokens / tokens


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--arms", default="lru,cost,belady")
    parser.add_argument("--capacities", default="64,128,256,512")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--prefill-tps", type=float, default=20_000.0)
    parser.add_argument("--sequential", action="store_true", help="one request at a time")
    parser.add_argument("--retain", type=float, default=0.0, help="hot prefixes kept S s")
    args = parser.parse_args()
    timing = Timing(prefill_tps=args.prefill_tps)
    with_bursts = synthetic_trace("bursts", seed=args.seed)
    without = synthetic_trace("hot-prompts", seed=args.seed)
    runs = [(name, with_bursts, without) for name in args.arms.split(",")]
    if args.retain:

        def asking(trace: Trace) -> Trace:
            hot = [replace(r, retain_s=args.retain) if r.session else r for r in trace.requests]
            return replace(trace, requests=hot)

        runs += [
            (f"{name}+retain", asking(with_bursts), asking(without))
            for name in args.arms.split(",")
            if name != "belady"
        ]
    print(f"{'blocks':>7} {'arm':>12} {'without':>8} {'bursts':>8} {'ratio':>6}")
    for capacity in (int(c) for c in args.capacities.split(",")):
        for label, burst_trace, calm_trace in runs:
            name = label.removesuffix("+retain")
            calm = hot_hit_ratio(name, capacity, calm_trace, timing, args.sequential)
            burst = hot_hit_ratio(name, capacity, burst_trace, timing, args.sequential)
            ratio = burst / calm if calm else float("nan")
            print(f"{capacity:>7} {label:>12} {calm:>8.2%} {burst:>8.2%} {ratio:>6.3f}")
        print()


if __name__ == "__main__":
    main()
