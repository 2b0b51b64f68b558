"""A simulated engine of the fleet: one kvplug cache with its own policy, scheduled by the
replay's realistic model, publishing KV events and exposing its load.

The cache is kvplug's `KVCache` behind the replay's `KVPlugArm` (the same eviction core
every other replay and adapter uses), built with an event sink. The scheduling (FCFS
admission, prefill and decode timing, recompute preemption) is the realistic replay's
own, one instance per engine; the fleet loop only decides which engine a request
arrives at and in which order the engines' events run.
"""

from __future__ import annotations

import heapq
from collections.abc import Callable

from kvplug.core.events import KVEvent
from kvplug.policies import EvictionPolicy
from kvplug.replay.arms.base import KVPlugArm
from kvplug.replay.loop import Job, RealisticReplay, ReplayCounters, Timing


class PublishingArm(KVPlugArm):
    """`KVPlugArm` whose cache publishes its KV events to `event_sink`, and which records
    each request's cached units on its first admission (`first_hits`), the hit a router
    predicted or not."""

    def __init__(
        self,
        name: str,
        policy: EvictionPolicy,
        capacity_blocks: int,
        event_sink: Callable[[KVEvent], None],
    ) -> None:
        super().__init__(name, policy, capacity_blocks, event_sink=event_sink)
        self.first_hits: dict[int, int] = {}

    def admit(self, req_id: int, prompt: list[int], compute: int) -> int | None:
        matched = super().admit(req_id, prompt, compute)
        if matched is not None:
            self.first_hits.setdefault(req_id, matched)
        return matched


class SimulatedEngine:
    """One engine: its arm, its counters, its scheduler state and its event queue.

    Invariant: `load` is the number of requests routed here that have not finished
    (running or waiting), which is what a router reads as the engine's queue.
    """

    def __init__(
        self,
        engine_id: int,
        arm: PublishingArm,
        jobs: list[Job],
        block_tokens: int,
        timing: Timing,
    ) -> None:
        self.engine_id = engine_id
        self.arm = arm
        self.counters = ReplayCounters()
        self.routed = 0  # requests routed here
        # The realistic replay's scheduler, driven one event at a time: it owns this
        # engine's timed events, while arrivals come from the router through `arrive`.
        self._scheduler = RealisticReplay(arm, jobs, block_tokens, timing, self.counters, None)

    @property
    def load(self) -> int:
        return len(self._scheduler.running) + len(self._scheduler.waiting)

    def next_event_time(self) -> float | None:
        """When this engine's next timed event (a decode step or a finish) is due."""
        events = self._scheduler.events
        return events[0].at if events else None

    def arrive(self, job_index: int, now: float) -> None:
        """A request routed here arrives now (the realistic replay's ARRIVE)."""
        self.routed += 1
        self._scheduler.arrive(job_index, now)

    def run_next(self) -> None:
        """Run this engine's next timed event (the realistic replay's GROW or FINISH)."""
        scheduler = self._scheduler
        scheduler.handle(heapq.heappop(scheduler.events))

    def check_drained(self) -> None:
        """At the end of the trace every request routed here has finished or been rejected."""
        scheduler = self._scheduler
        assert not scheduler.events and not scheduler.waiting and not scheduler.running
