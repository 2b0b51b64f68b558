"""Run a trace through fleets: every timing x router x policy x engine count x fleet
capacity, one `FleetRow` each.

A fleet capacity is the fleet's total in blocks; each of the N engines gets
``capacity // N`` of them (the row reports the total actually used). Every engine runs the
same kvplug policy, each with its own cache. Only the realistic replay is modelled: with
one request at a time there is no load to balance.

Several timings (prefill and decode speeds) give one run each: a load-driven router's
choices follow the engines' timing, so one run is one draw of which engine gets what.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

from kvplug.core.events import KVEvent
from kvplug.core.model_spec import ModelSpec
from kvplug.errors import KVPlugError, UnknownPolicyError
from kvplug.fleet.engine import PublishingArm, SimulatedEngine
from kvplug.fleet.loop import replay_fleet
from kvplug.fleet.router import (
    DEFAULT_LOAD_PENALTY,
    check_engine_count,
    check_router_names,
    make_router,
)
from kvplug.fleet.view import EventFeed, KeyScheme, PrefixView
from kvplug.policies import online_policies
from kvplug.replay.loop import Job, Timing, make_jobs
from kvplug.replay.runner import arm_policy, check_policy_config
from kvplug.replay.trace import Trace

UNIT_BLOCK_SIZE = 1  # the engines key one trace block per cache block, as KVPlugArm does


@dataclass
class EngineRow:
    """One engine of a fleet run."""

    routed: int  # requests routed to it
    hit_ratio: float
    saved_compute_ratio: float  # of the prompts routed to it
    saved_flops: float
    evictions: int
    preemptions: int
    rejected: int


@dataclass
class FleetRow:
    router: str
    policy: str
    engines: int
    capacity_blocks: int  # the fleet's total: engines x blocks per engine
    event_lag_s: float
    prefill_tps: float = Timing.prefill_tps
    decode_tps: float = Timing.decode_tps
    requests: int = 0
    hit_ratio: float = 0.0  # prompt tokens served from cache / prompt tokens, fleet-wide
    saved_compute_ratio: float = 0.0  # prefill FLOPs saved / all prompt FLOPs, fleet-wide
    saved_flops: float = 0.0
    load_imbalance: float = 0.0  # max / mean requests routed per engine
    stale_ratio: float = 0.0  # decisions whose view differed from the chosen cache then
    mispredicted_ratio: float = 0.0  # decisions whose predicted hit differed from the hit
    events_in_flight: float = 0.0  # mean events not yet delivered at a decision
    preemptions: int = 0
    rejected: int = 0
    seconds: float = 0.0
    per_engine: list[EngineRow] = field(default_factory=list)

    def as_dict(self) -> dict:
        return asdict(self)


def check_fleet_policies(names: Sequence[str]) -> None:
    """Raise, naming what is accepted, unless every name is an online kvplug policy."""
    accepted = online_policies()
    for name in names:
        if name not in accepted:
            raise UnknownPolicyError(
                f"policy {name!r} cannot run in a fleet replay; accepted: {', '.join(accepted)}"
            )


def run_fleet(
    trace: Trace,
    routers: Sequence[str],
    policies: Sequence[str],
    engine_counts: Sequence[int],
    capacities: Sequence[int],
    model: ModelSpec,
    *,
    timings: Sequence[Timing] = (Timing(),),
    event_lag_s: float = 0.0,
    load_penalty: float = DEFAULT_LOAD_PENALTY,
    policy_config: Mapping[str, Any] | None = None,
    progress: Callable[[str], None] | None = None,
) -> list[FleetRow]:
    """One row per timing x capacity x engine count x router x policy, in that nesting
    order. `policy_config`: parameters for every policy that takes them
    (`check_policy_config`)."""
    check_router_names(routers)
    check_fleet_policies(policies)
    check_policy_config(list(policies), policy_config or {})
    for count in engine_counts:
        check_engine_count(count)
    if not capacities or min(capacities) < 1:
        raise KVPlugError(f"capacities must be positive block counts, got {list(capacities)}")
    if not timings:
        raise KVPlugError("a fleet replay needs at least one timing")
    for capacity in capacities:
        for count in engine_counts:
            if capacity < count:
                raise KVPlugError(
                    f"a fleet capacity of {capacity} blocks cannot be split across {count} "
                    "engines; give at least one block per engine"
                )
    jobs = make_jobs(trace, model)
    rows = []
    cells = [
        (timing, capacity, count, router)
        for timing in timings
        for capacity in capacities
        for count in engine_counts
        for router in routers
    ]
    for timing, capacity, count, router in cells:
        for policy in policies:
            row = run_one(
                trace.block_tokens, jobs, router, policy, count, capacity // count,
                timing=timing, event_lag_s=event_lag_s, load_penalty=load_penalty,
                policy_config=policy_config,
            )  # fmt: skip
            rows.append(row)
            if progress:
                at = (
                    f" at {timing.prefill_tps:g}/{timing.decode_tps:g} tps"
                    if len(timings) > 1
                    else ""
                )
                progress(
                    f"{router} / {policy}, {count} engines x {capacity // count} blocks{at}: "
                    f"{row.seconds:.1f} s"
                )
    return rows


def build_fleet(
    jobs: list[Job],
    policy: str,
    num_engines: int,
    blocks_per_engine: int,
    block_tokens: int,
    timing: Timing,
    event_lag_s: float = 0.0,
    policy_config: Mapping[str, Any] | None = None,
) -> tuple[list[SimulatedEngine], EventFeed]:
    """`num_engines` engines running `policy` (with the entries of `policy_config` it
    takes), each publishing its KV events to the feed."""
    check_engine_count(num_engines)
    feed = EventFeed(PrefixView(num_engines), event_lag_s)
    engines = []
    for engine_id in range(num_engines):

        def publish(event: KVEvent, engine_id: int = engine_id) -> None:
            feed.publish(engine_id, event)

        policy_instance = arm_policy(policy, block_tokens, policy_config)
        arm = PublishingArm(f"{policy}#{engine_id}", policy_instance, blocks_per_engine, publish)
        engines.append(SimulatedEngine(engine_id, arm, jobs, block_tokens, timing))
    return engines, feed


def run_one(
    block_tokens: int,
    jobs: list[Job],
    router_name: str,
    policy: str,
    num_engines: int,
    blocks_per_engine: int,
    *,
    timing: Timing,
    event_lag_s: float,
    load_penalty: float,
    policy_config: Mapping[str, Any] | None = None,
) -> FleetRow:
    """One fleet: `num_engines` engines of `blocks_per_engine` blocks running `policy`."""
    started = time.perf_counter()
    engines, feed = build_fleet(
        jobs, policy, num_engines, blocks_per_engine, block_tokens, timing, event_lag_s,
        policy_config,
    )  # fmt: skip
    router = make_router(router_name, num_engines, load_penalty)
    scheme = KeyScheme.for_engines(UNIT_BLOCK_SIZE)
    routing = replay_fleet(engines, router, feed, scheme, jobs)
    per_engine = [_engine_row(engine) for engine in engines]
    counters = [engine.counters for engine in engines]

    def total(name: str) -> float:
        return sum(getattr(c, name) for c in counters)

    routed = [engine.routed for engine in engines]
    mean_routed = sum(routed) / len(routed)
    return FleetRow(
        router=router_name,
        policy=policy,
        engines=num_engines,
        capacity_blocks=blocks_per_engine * num_engines,
        event_lag_s=event_lag_s,
        prefill_tps=timing.prefill_tps,
        decode_tps=timing.decode_tps,
        requests=int(total("requests")),
        hit_ratio=_ratio(total("hit_tokens"), total("prompt_tokens")),
        saved_compute_ratio=_ratio(total("saved_flops"), total("total_flops")),
        saved_flops=total("saved_flops"),
        load_imbalance=max(routed) / mean_routed if mean_routed else 1.0,
        stale_ratio=routing.stale_ratio,
        mispredicted_ratio=routing.mispredicted_ratio,
        events_in_flight=routing.mean_events_in_flight,
        preemptions=int(total("preemptions")),
        rejected=int(total("rejected")),
        seconds=time.perf_counter() - started,
        per_engine=per_engine,
    )


def _engine_row(engine: SimulatedEngine) -> EngineRow:
    c = engine.counters
    return EngineRow(
        routed=engine.routed,
        hit_ratio=_ratio(c.hit_tokens, c.prompt_tokens),
        saved_compute_ratio=_ratio(c.saved_flops, c.total_flops),
        saved_flops=c.saved_flops,
        evictions=engine.arm.stats().evictions,
        preemptions=c.preemptions,
        rejected=c.rejected,
    )


def _ratio(part: float, whole: float) -> float:
    return part / whole if whole else 0.0
