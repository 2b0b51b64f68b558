"""How much knowing the waiting queue is worth: `cost` with queue protection, realistic mode.

A serving engine knows the requests in its waiting queue and the blocks each would hit; a
trace replay's realistic mode has the same queue (`RealisticReplay.waiting`). Before every
replay event the arm refreshes its protection from the first `K` waiting requests
(`kvplug.core.queue_protection`, the rule vLLM's scheduler runs each step): the blocks
they would hit are evicted after every other candidate, the next request's last. K = 0
is `cost` alone; K = all (the whole queue) is the bound of the rule. `lru` and `belady`
give the gap (``gap closed = (arm - lru) / (belady - lru)``). ``--inside vllm`` runs
`cost` inside vLLM's own KV cache manager (``vllm-kvplug:cost``) instead of kvplug's cache.

    .venv/bin/python studies/waiting_queue_protection.py --prefill-tps 2000,1000 \
        --capacity-fractions 0.05,0.1 --queue 0,8,64,all

Queue protection only acts while requests wait, so the loads are those where they do
(``waited`` in the table: requests that could not start on arrival).
"""

from __future__ import annotations

import argparse

from kvplug.core.model_spec import load_model
from kvplug.core.queue_protection import WHOLE_QUEUE
from kvplug.replay.loop import RealisticReplay, ReplayCounters, Timing, make_jobs
from kvplug.replay.runner import build_arm, replay_clock
from kvplug.replay.sources import capacities_for, load_trace


def run_arm(
    name: str, capacity: int, trace, jobs, timing: Timing, queue: int
) -> tuple[float, ReplayCounters]:
    counters = ReplayCounters()
    arm = build_arm(name, capacity, jobs, False, trace.block_tokens, None, queue_depth=queue)
    RealisticReplay(arm, jobs, trace.block_tokens, timing, counters, replay_clock(arm)).run()
    return counters.saved_flops / counters.total_flops, counters


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--trace", default="packaged:mooncake")
    parser.add_argument("--prefill-tps", default="2000,1000")
    parser.add_argument("--decode-tps", type=float, default=40.0)
    parser.add_argument("--capacity-fractions", default="0.05,0.1")
    parser.add_argument("--queue", default="0,8,64,all", help="K values; all: the whole queue")
    parser.add_argument("--inside", choices=["kvplug", "vllm"], default="kvplug")
    args = parser.parse_args()
    trace = load_trace(args.trace)
    jobs = make_jobs(trace, load_model(None))
    fractions = [float(f) for f in args.capacity_fractions.split(",")]
    queues = [WHOLE_QUEUE if k == "all" else int(k) for k in args.queue.split(",")]
    cost = "cost" if args.inside == "kvplug" else "vllm-kvplug:cost"
    print(f"{'prefill':>8} {'size':>6} {'arm':>14} {'saved':>8} {'gap closed':>10} {'waited':>7}")
    for tps in (float(t) for t in args.prefill_tps.split(",")):
        timing = Timing(prefill_tps=tps, decode_tps=args.decode_tps)
        for fraction, capacity in zip(fractions, capacities_for(trace, fractions), strict=True):
            lru, _ = run_arm("lru", capacity, trace, jobs, timing, 0)
            belady, _ = run_arm("belady", capacity, trace, jobs, timing, 0)
            rows = [("lru", lru, 0), ("belady", belady, 0)]
            for queue in queues:
                saved, c = run_arm(cost, capacity, trace, jobs, timing, queue)
                label = (
                    "cost" if queue == 0 else f"cost+q{'all' if queue == WHOLE_QUEUE else queue}"
                )
                rows.append((label, saved, c.waited))
            for label, saved, waited in rows:
                gap = (saved - lru) / (belady - lru) if belady > lru else float("nan")
                print(
                    f"{tps:>8.0f} {fraction:>6.0%} {label:>14} {saved:>8.2%} {gap:>10.0%} "
                    f"{waited:>7}"
                )
            print()


if __name__ == "__main__":
    main()
