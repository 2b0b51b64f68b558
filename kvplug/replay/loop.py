"""The replay loop: one trace through one arm, in sequential or realistic mode.

Sequential: one request at a time, no decode phase; a fully cached prompt is a full hit.
The textbook setting, for comparing with published hit ratios.

Realistic (the default): requests arrive at their timestamps. A request holds its blocks
through prefill (its uncached tokens at `prefill_tps`) and decode (`output_length` tokens
at `decode_tps`, growing by one unit whenever it crosses a block boundary). Blocks in use
cannot be evicted. Admission is first come, first served: a request that does not fit
waits; a request that cannot grow preempts the most recently admitted one (vLLM's
recompute preemption: its blocks are released and it starts again later).

Hits and saved compute are counted on each request's first admission only, so every
arm's ratios share one denominator.
"""

from __future__ import annotations

import heapq
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from enum import IntEnum
from itertools import accumulate
from typing import NamedTuple

from kvplug.core.model_spec import ModelSpec
from kvplug.replay.arms.base import FRESH_UNIT_BASE, CacheArm
from kvplug.replay.trace import Trace, count_blocks


@dataclass(slots=True)
class Job:
    """A trace request in units, with the prefill FLOPs each prefix of it costs."""

    index: int
    arrival: float
    input_length: int
    output_length: int
    prompt: list[int]  # full blocks by trace id, then a fresh id for a partial last block
    decode: list[tuple[float, int]]  # (tokens generated when needed, fresh unit)
    sentinel: int  # a fresh id that sequential mode appends to the lookup
    prefix_flops: list[float]  # prefix_flops[k]: prefill FLOPs of the first k units
    total_flops: float
    retain_s: float = 0.0  # its prompt's prefix kept this long after it ends (0: not asked)
    session: bool = False  # it names a session, and the arms are told (`CacheArm.name_session`)


AdmitHook = Callable[[Job], None]  # called before each lookup; `belady` uses it as its clock


def make_jobs(trace: Trace, model: ModelSpec, sessions: bool = False) -> list[Job]:
    """The trace's requests as jobs, fresh unit ids numbered in request order. With
    `sessions`, a request with a session id names it to the arms (else none does)."""
    block_tokens = trace.block_tokens
    fresh = FRESH_UNIT_BASE
    jobs = []
    for index, request in enumerate(trace.requests):
        blocks = count_blocks(request.input_length, block_tokens)
        prompt = list(request.hash_ids[: blocks.full])
        if blocks.has_partial:
            prompt.append(fresh)
            fresh += 1
        decode = []
        end = request.input_length + request.output_length
        for boundary in range(len(prompt) * block_tokens, end, block_tokens):
            decode.append((boundary + 1 - request.input_length, fresh))
            fresh += 1
        block_flops = [
            model.prefill_flops(block * block_tokens, (block + 1) * block_tokens)
            for block in range(blocks.full)
        ]
        jobs.append(
            Job(
                index,
                request.arrival,
                request.input_length,
                request.output_length,
                prompt,
                decode,
                sentinel=fresh,
                prefix_flops=list(accumulate(block_flops, initial=0.0)),
                total_flops=model.prefill_flops(0, request.input_length),
                retain_s=request.retain_s,
                session=sessions and bool(request.session),
            )
        )
        fresh += 1
    return jobs


@dataclass
class ReplayCounters:
    requests: int = 0
    prompt_tokens: int = 0
    hit_tokens: int = 0
    total_flops: float = 0.0
    saved_flops: float = 0.0
    cached_block_samples: int = 0
    cached_blocks_sum: int = 0
    preemptions: int = 0
    waited: int = 0  # requests that could not start when they arrived
    rejected: int = 0  # requests larger than the whole cache
    seconds: float = 0.0  # wall time of the replay
    admitted: set[int] = field(default_factory=set, repr=False)

    def record_admission(self, job: Job, matched: int, block_tokens: int, arm: CacheArm) -> None:
        """A request started with `matched` units from the cache (its first start only)."""
        if job.index in self.admitted:
            return
        self.admitted.add(job.index)
        self.requests += 1
        self.prompt_tokens += job.input_length
        self.hit_tokens += matched * block_tokens
        self.total_flops += job.total_flops
        last = len(job.prefix_flops) - 1
        self.saved_flops += job.prefix_flops[min(matched, last)]
        if arm.loaded:  # continued from another tier: saved, less the reloads
            reached = job.prefix_flops[min(matched + arm.loaded, last)]
            self.saved_flops += reached - job.prefix_flops[min(matched, last)]
            self.saved_flops -= arm.loaded * arm.reload_flops
        self.cached_blocks_sum += arm.stats().cached_blocks
        self.cached_block_samples += 1

    def record_rejection(self, job: Job) -> None:
        """A request larger than the cache: it counts in the totals, saving nothing."""
        self.rejected += 1
        if job.index not in self.admitted:
            self.admitted.add(job.index)
            self.prompt_tokens += job.input_length
            self.total_flops += job.total_flops


@dataclass(frozen=True)
class Timing:
    prefill_tps: float = 20_000.0  # prefill tokens per second
    decode_tps: float = 40.0  # decode tokens per second, per request


def replay(
    arm: CacheArm,
    jobs: list[Job],
    block_tokens: int,
    *,
    sequential: bool = False,
    timing: Timing | None = None,
    on_admit: AdmitHook | None = None,
) -> ReplayCounters:
    """Drive `arm` through `jobs`. `on_admit(job)` is called before each lookup (the
    offline `belady` policy uses it as its clock)."""
    counters = ReplayCounters()
    start = time.perf_counter()
    if sequential:
        _replay_sequential(arm, jobs, block_tokens, counters, on_admit)
    else:
        RealisticReplay(arm, jobs, block_tokens, timing or Timing(), counters, on_admit).run()
    counters.seconds = time.perf_counter() - start
    return counters


def _replay_sequential(
    arm: CacheArm,
    jobs: list[Job],
    block_tokens: int,
    counters: ReplayCounters,
    on_admit: AdmitHook | None,
) -> None:
    for job in jobs:
        arm.advance(job.arrival)
        if on_admit:
            on_admit(job)
        matched = arm.admit(job.index, [*job.prompt, job.sentinel], len(job.prompt))
        if matched is None:
            counters.record_rejection(job)
            continue
        counters.record_admission(job, matched, block_tokens, arm)
        if job.session:
            arm.name_session(job.index)
        if job.retain_s:
            arm.retain(job.index, job.retain_s)
        arm.finish(job.index, job.output_length)


class EventKind(IntEnum):
    ARRIVE = 0  # the request joins the waiting queue
    GROW = 1  # the running request's decode crosses a block boundary: one more unit
    FINISH = 2  # the running request has generated its output


class Event(NamedTuple):
    """A timed event on the heap; `order` breaks ties in push order."""

    at: float
    order: int
    kind: EventKind
    job: int  # the job's index
    run_id: int  # the run it belongs to (0 for an arrival); stale once that run is preempted


class RealisticReplay:
    """The realistic mode: arrivals, prefill and decode on a clock, admission and preemption.

    A request's run is numbered when it starts; a preempted request starts again later as a
    new run, and the events of its old run are dropped when they come up.
    """

    def __init__(
        self,
        arm: CacheArm,
        jobs: list[Job],
        block_tokens: int,
        timing: Timing,
        counters: ReplayCounters,
        on_admit: AdmitHook | None,
    ) -> None:
        self.arm = arm
        self.jobs = jobs
        self.block_tokens = block_tokens
        self.timing = timing
        self.counters = counters
        self.on_admit = on_admit
        self.events: list[Event] = []
        self.pushed = 0
        self.waiting: deque[int] = deque()
        self.running: dict[int, int] = {}  # job -> its current run id, in admission order
        self.decode_units: dict[int, int] = {}  # job -> decode units its current run holds
        self.last_run_id = 0

    def push(self, at: float, kind: EventKind, job: int, run_id: int = 0) -> None:
        self.pushed += 1
        heapq.heappush(self.events, Event(at, self.pushed, kind, job, run_id))

    def run(self) -> None:
        for job in self.jobs:
            self.push(job.arrival, EventKind.ARRIVE, job.index)
        while self.events:
            self.handle(heapq.heappop(self.events))
        assert not self.waiting and not self.running

    def handle(self, event: Event) -> None:
        """Run one event taken off `events`."""
        self.arm.advance(event.at)
        jobs = self.jobs
        self.arm.protect_waiting((index, jobs[index].prompt) for index in self.waiting)
        if event.kind == EventKind.ARRIVE:
            self.arrive(event.job, event.at)
        elif self.running.get(event.job) != event.run_id:
            return  # an event of a run that was preempted
        elif event.kind == EventKind.GROW:
            self.grow(event.job, event.at)
        else:
            job = self.jobs[event.job]
            if job.retain_s:
                self.arm.retain(event.job, job.retain_s)
            self.arm.finish(event.job, job.output_length)
            del self.running[event.job]
            self.admit_waiting(event.at)

    def arrive(self, index: int, now: float) -> None:
        """Job `index` arrives: it waits behind earlier arrivals, then starts if it fits."""
        self.waiting.append(index)
        self.admit_waiting(now)
        if self.waiting and self.waiting[-1] == index:
            self.counters.waited += 1

    def admit_waiting(self, now: float) -> None:
        """Start waiting requests in order until the first that does not fit."""
        while self.waiting:
            first = self.waiting[0]
            if self.start(first, now):
                self.waiting.popleft()
            elif not self.running:  # nothing will free blocks: it can never fit
                self.waiting.popleft()
                self.counters.record_rejection(self.jobs[first])
            else:
                break

    def start(self, index: int, now: float) -> bool:
        """Admit job `index` as a new run and schedule its growth and end; False if it
        does not fit now."""
        job = self.jobs[index]
        if self.on_admit:
            self.on_admit(job)
        matched = self.arm.admit(index, job.prompt, len(job.prompt))
        if matched is None:
            return False
        self.counters.record_admission(job, matched, self.block_tokens, self.arm)
        if job.session:
            self.arm.name_session(index)
        self.last_run_id += 1
        run_id = self.running[index] = self.last_run_id
        self.decode_units[index] = 0
        uncached_tokens = job.input_length - matched * self.block_tokens
        prefill_end = now + uncached_tokens / self.timing.prefill_tps
        for generated, _ in job.decode:
            grow_at = prefill_end + generated / self.timing.decode_tps
            self.push(grow_at, EventKind.GROW, index, run_id)
        finish_at = prefill_end + job.output_length / self.timing.decode_tps
        self.push(finish_at, EventKind.FINISH, index, run_id)
        return True

    def grow(self, index: int, now: float) -> None:
        """Give job `index` its next decode unit, preempting the most recently admitted
        runs (possibly itself) until it fits."""
        unit = self.jobs[index].decode[self.decode_units[index]][1]
        while not self.arm.grow(index, [unit]):
            victim = next(reversed(self.running))  # the most recently admitted
            self.arm.finish(victim)
            del self.running[victim]
            self.counters.preemptions += 1
            if victim == index and not self.running:  # alone and still too big: never fits
                self.counters.record_rejection(self.jobs[index])
                break
            self.waiting.appendleft(victim)
            if victim == index:
                break
        else:
            self.decode_units[index] += 1
        self.admit_waiting(now)
