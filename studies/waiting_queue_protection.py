"""How much knowing the waiting queue is worth: `cost` with queue protection, realistic mode.

A serving engine knows the requests in its waiting queue and the blocks each would hit; a
trace replay's realistic mode has the same queue (`RealisticReplay.waiting`). This study
measures the rule before any engine gets it: before every replay event, the cached blocks
that the first `K` waiting requests would hit (`KVCache.match`, which changes nothing) are
*protected*: the policy's victim is its lowest-ranked candidate that no waiting request
needs, and a protected one only when nothing else is left. K = 0 is `cost` alone; K = all
is the bound (the whole queue known). `lru` and `belady` give the gap
(``gap closed = (arm - lru) / (belady - lru)``).

    .venv/bin/python studies/waiting_queue_protection.py --prefill-tps 2000,1000 \
        --capacity-fractions 0.05,0.1 --queue 0,8,64,all

Queue protection only acts while requests wait, so the loads are those where they do
(``waited`` in the table: requests that could not start on arrival).
"""

from __future__ import annotations

import argparse
from collections.abc import Callable

from kvplug.core.model_spec import load_model
from kvplug.policies.cost import CostPolicy
from kvplug.policies.node import CachedNode
from kvplug.replay.arms.base import KVPlugArm
from kvplug.replay.loop import Event, RealisticReplay, ReplayCounters, Timing, make_jobs
from kvplug.replay.runner import build_arm, replay_clock
from kvplug.replay.sources import capacities_for, load_trace


class QueueProtectedCost(CostPolicy):
    """`cost`, whose victim is never a block a waiting request needs while another
    candidate is left (`protected`: serials, set before each event)."""

    name = "cost"

    def __init__(self, **params: object) -> None:
        super().__init__(**params)  # type: ignore[arg-type]
        self.protected: set[int] = set()

    def first_candidate(self) -> CachedNode | None:
        if not self.protected:
            return super().first_candidate()
        first = None
        for _, node in self.iter_ranked():
            if first is None:
                first = node
            if node.serial not in self.protected:
                self.chosen = node.serial
                return node
        if first is not None:
            self.chosen = first.serial
        return first

    def pop_first(self) -> CachedNode | None:
        node = self.first_candidate()
        if node is not None:
            self.discard_candidate(node)
        return node


class ProtectingReplay(RealisticReplay):
    """The realistic replay, refreshing the policy's protected set before each event from
    the first `queue` waiting requests (None: all of them)."""

    def __init__(self, *args: object, queue: int | None, policy: QueueProtectedCost) -> None:
        super().__init__(*args)  # type: ignore[arg-type]
        self.queue = queue
        self.policy = policy
        self.scanned = 0  # waiting requests matched, over the run

    def handle(self, event: Event) -> None:
        cache = self.arm.cache  # type: ignore[attr-defined]
        protected: set[int] = set()
        for n, index in enumerate(self.waiting):
            if self.queue is not None and n >= self.queue:
                break
            protected.update(node.serial for node in cache.match(self.jobs[index].prompt))
            self.scanned += 1
        self.policy.protected = protected
        super().handle(event)


def run_arm(
    name: str, capacity: int, trace, model, timing: Timing, queue: int | None
) -> tuple[float, ReplayCounters]:
    jobs = make_jobs(trace, model)
    counters = ReplayCounters()
    if name == "protected":
        policy = QueueProtectedCost(tokens_per_block=trace.block_tokens)
        arm = KVPlugArm(f"cost+queue{queue}", policy, capacity)
        ProtectingReplay(
            arm, jobs, trace.block_tokens, timing, counters, None, queue=queue, policy=policy
        ).run()
    else:
        arm = build_arm(name, capacity, jobs, False, trace.block_tokens, None)
        clock: Callable | None = replay_clock(arm)
        RealisticReplay(arm, jobs, trace.block_tokens, timing, counters, clock).run()
    return counters.saved_flops / counters.total_flops, counters


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--trace", default="packaged:mooncake")
    parser.add_argument("--prefill-tps", default="2000,1000")
    parser.add_argument("--decode-tps", type=float, default=40.0)
    parser.add_argument("--capacity-fractions", default="0.05,0.1")
    parser.add_argument("--queue", default="0,8,64,all", help="K values; all: the whole queue")
    args = parser.parse_args()
    trace = load_trace(args.trace)
    model = load_model(None)
    fractions = [float(f) for f in args.capacity_fractions.split(",")]
    queues = [None if k == "all" else int(k) for k in args.queue.split(",")]
    print(f"{'prefill':>8} {'size':>6} {'arm':>14} {'saved':>8} {'gap closed':>10} {'waited':>7}")
    for tps in (float(t) for t in args.prefill_tps.split(",")):
        timing = Timing(prefill_tps=tps, decode_tps=args.decode_tps)
        for fraction, capacity in zip(fractions, capacities_for(trace, fractions), strict=True):
            lru, _ = run_arm("lru", capacity, trace, model, timing, None)
            belady, _ = run_arm("belady", capacity, trace, model, timing, None)
            rows = [("lru", lru, 0), ("belady", belady, 0)]
            for queue in queues:
                saved, c = run_arm("protected", capacity, trace, model, timing, queue)
                label = "cost" if queue == 0 else f"cost+q{'all' if queue is None else queue}"
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
