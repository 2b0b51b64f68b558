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
from dataclasses import dataclass, field
from itertools import accumulate

from kvplug.core.model_spec import ModelSpec
from kvplug.replay.arms import FRESH_UNIT_BASE, CacheArm
from kvplug.replay.trace import Trace


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


def make_jobs(trace: Trace, model: ModelSpec) -> list[Job]:
    bt = trace.block_tokens
    fresh = FRESH_UNIT_BASE
    jobs = []
    for index, req in enumerate(trace.requests):
        full = req.input_length // bt
        prompt = list(req.hash_ids[:full])
        if req.input_length % bt:
            prompt.append(fresh)
            fresh += 1
        decode = []
        for boundary in range(len(prompt) * bt, req.input_length + req.output_length, bt):
            decode.append((boundary + 1 - req.input_length, fresh))
            fresh += 1
        flops = [model.prefill_flops(i * bt, (i + 1) * bt) for i in range(full)]
        jobs.append(
            Job(
                index,
                req.arrival,
                req.input_length,
                req.output_length,
                prompt,
                decode,
                fresh,
                list(accumulate(flops, initial=0.0)),
                model.prefill_flops(0, req.input_length),
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
        if job.index in self.admitted:
            return
        self.admitted.add(job.index)
        self.requests += 1
        self.prompt_tokens += job.input_length
        self.hit_tokens += matched * block_tokens
        self.total_flops += job.total_flops
        self.saved_flops += job.prefix_flops[min(matched, len(job.prefix_flops) - 1)]
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
    on_admit=None,
) -> ReplayCounters:
    """Drive `arm` through `jobs`. `on_admit(job)` is called before each lookup (the
    offline `belady` policy uses it as its clock)."""
    counters = ReplayCounters()
    start = time.perf_counter()
    if sequential:
        _replay_sequential(arm, jobs, block_tokens, counters, on_admit)
    else:
        _Realistic(arm, jobs, block_tokens, timing or Timing(), counters, on_admit).run()
    counters.seconds = time.perf_counter() - start
    return counters


def _replay_sequential(arm, jobs, block_tokens, counters, on_admit) -> None:
    for job in jobs:
        if on_admit:
            on_admit(job)
        matched = arm.admit(job.index, [*job.prompt, job.sentinel], len(job.prompt))
        if matched is None:
            counters.record_rejection(job)
            continue
        counters.record_admission(job, matched, block_tokens, arm)
        arm.finish(job.index, job.output_length)


ARRIVE, GROW, FINISH = 0, 1, 2


class _Realistic:
    def __init__(self, arm, jobs, block_tokens, timing, counters, on_admit) -> None:
        self.arm = arm
        self.jobs = jobs
        self.bt = block_tokens
        self.timing = timing
        self.counters = counters
        self.on_admit = on_admit
        self.events: list[tuple[float, int, int, int, int]] = []  # (time, seq, kind, job, gen)
        self.seq = 0
        self.waiting: deque[int] = deque()
        self.running: dict[int, int] = {}  # job -> generation of its run, in admission order
        self.grown: dict[int, int] = {}  # job -> decode units it holds in its current run
        self.generation = 0

    def push(self, at: float, kind: int, job: int, gen: int = 0) -> None:
        self.seq += 1
        heapq.heappush(self.events, (at, self.seq, kind, job, gen))

    def run(self) -> None:
        for job in self.jobs:
            self.push(job.arrival, ARRIVE, job.index)
        while self.events:
            now, _, kind, j, gen = heapq.heappop(self.events)
            if kind == ARRIVE:
                self.waiting.append(j)
                self.admit_waiting(now)
                if self.waiting and self.waiting[-1] == j:
                    self.counters.waited += 1
            elif self.running.get(j) != gen:
                continue  # an event of a run that was preempted
            elif kind == GROW:
                self.grow(j, now)
            else:
                self.arm.finish(j, self.jobs[j].output_length)
                del self.running[j]
                self.admit_waiting(now)
        assert not self.waiting and not self.running

    def admit_waiting(self, now: float) -> None:
        """Start waiting requests in order until the first that does not fit."""
        while self.waiting:
            j = self.waiting[0]
            if self.start(j, now):
                self.waiting.popleft()
            elif not self.running:  # nothing will free blocks: it can never fit
                self.waiting.popleft()
                self.counters.record_rejection(self.jobs[j])
            else:
                break

    def start(self, j: int, now: float) -> bool:
        job = self.jobs[j]
        if self.on_admit:
            self.on_admit(job)
        matched = self.arm.admit(j, job.prompt, len(job.prompt))
        if matched is None:
            return False
        self.counters.record_admission(job, matched, self.bt, self.arm)
        self.generation += 1
        gen = self.running[j] = self.generation
        self.grown[j] = 0
        prefill_end = now + (job.input_length - matched * self.bt) / self.timing.prefill_tps
        for generated, _ in job.decode:
            self.push(prefill_end + generated / self.timing.decode_tps, GROW, j, gen)
        self.push(prefill_end + job.output_length / self.timing.decode_tps, FINISH, j, gen)
        return True

    def grow(self, j: int, now: float) -> None:
        unit = self.jobs[j].decode[self.grown[j]][1]
        while not self.arm.grow(j, [unit]):
            victim = next(reversed(self.running))  # the most recently admitted
            self.arm.finish(victim)
            del self.running[victim]
            self.counters.preemptions += 1
            if victim == j and not self.running:  # alone and still too big: it never fits
                self.counters.record_rejection(self.jobs[j])
                break
            self.waiting.appendleft(victim)
            if victim == j:
                break
        else:
            self.grown[j] += 1
        self.admit_waiting(now)
