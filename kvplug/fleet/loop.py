"""The fleet replay loop: one trace routed across simulated engines, in simulated time.

Requests arrive at their timestamps. At each arrival the loop delivers the KV events due
by then to the router's view, asks the router for an engine, and hands the request to
that engine, whose realistic scheduler admits, runs and finishes it. Between arrivals
the engines' own timed events (decode steps, finishes) run in time order; each event an
engine's cache publishes is stamped with that time and reaches the router `lag_s` later.

Ties at one instant: arrivals run before engine events (as in the single-engine replay,
where arrivals are queued first), and engines run in id order.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from kvplug.fleet.engine import SimulatedEngine
from kvplug.fleet.router import Router
from kvplug.fleet.view import EventFeed, KeyScheme
from kvplug.replay.loop import Job


@dataclass
class RoutingStats:
    """How well the router's view matched the engines, over all routing decisions.

    - `stale`: decisions where the view's prefix for the chosen engine differed from what
      that engine's cache held at that instant (events not yet delivered).
    - `mispredicted`: decisions where the view's prefix differed from the hit the request
      got at its first admission (staleness, plus changes while it waited).
    """

    decisions: int = 0
    stale: int = 0
    mispredicted: int = 0
    predicted_blocks: int = 0  # the view's prefix on the chosen engines, summed
    actual_blocks: int = 0  # the hits at first admission, summed
    events_in_flight: int = 0  # undelivered events at each decision, summed

    @property
    def stale_ratio(self) -> float:
        return self.stale / self.decisions if self.decisions else 0.0

    @property
    def mispredicted_ratio(self) -> float:
        return self.mispredicted / self.decisions if self.decisions else 0.0

    @property
    def mean_events_in_flight(self) -> float:
        return self.events_in_flight / self.decisions if self.decisions else 0.0


def replay_fleet(
    engines: list[SimulatedEngine],
    router: Router,
    feed: EventFeed,
    scheme: KeyScheme,
    jobs: list[Job],
) -> RoutingStats:
    """Route and run every job; afterwards every engine is drained."""
    stats = RoutingStats()
    predicted: dict[int, tuple[int, int]] = {}  # job index -> (engine, view's prefix blocks)
    arrivals = sorted(jobs, key=lambda job: (job.arrival, job.index))
    next_arrival = 0
    while True:
        due_engine, due_at = None, math.inf
        for engine in engines:
            at = engine.next_event_time()
            if at is not None and at < due_at:
                due_engine, due_at = engine, at
        if next_arrival < len(arrivals) and arrivals[next_arrival].arrival <= due_at:
            job = arrivals[next_arrival]
            next_arrival += 1
            predicted[job.index] = _route(job, engines, router, feed, scheme, stats)
        elif due_engine is not None:
            feed.now = due_at
            due_engine.run_next()
        else:
            break
    for engine in engines:
        engine.check_drained()
    for job_index, (engine_id, blocks) in predicted.items():
        actual = engines[engine_id].arm.first_hits.get(job_index, 0)  # 0: rejected
        stats.actual_blocks += actual
        stats.mispredicted += actual != blocks
    return stats


def _route(
    job: Job,
    engines: list[SimulatedEngine],
    router: Router,
    feed: EventFeed,
    scheme: KeyScheme,
    stats: RoutingStats,
) -> tuple[int, int]:
    """Route one arriving job; returns the engine and the prefix the view predicted."""
    feed.now = job.arrival
    feed.deliver(job.arrival)
    keys = scheme.prompt_keys(job.prompt[:-1])  # the last unit is always computed
    chosen = router.choose(keys, [engine.load for engine in engines], feed.view)
    blocks = feed.view.prefix_blocks(chosen, keys)
    held_now = len(engines[chosen].arm.cache.match(job.prompt))  # for the report only
    stats.decisions += 1
    stats.stale += blocks != held_now
    stats.predicted_blocks += blocks
    stats.events_in_flight += feed.in_flight
    engines[chosen].arrive(job.index, job.arrival)
    return chosen, blocks
