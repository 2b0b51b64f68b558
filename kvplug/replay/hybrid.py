"""The hybrid replay: one trace through hybrid models' caches, stock and kvplug, by bytes.

A hybrid model keeps several kinds of state (`kvplug.hybrid.spec`), so capacity is in
bytes: a fraction of the trace's distinct blocks as the model's full-attention
equivalent would hold them (every layer keeping KV for every token). The same bytes are
given to every arm and to that full-attention model, whose hit ratio is what the hybrid
should get close to.

Arms (names as in ``kvplug replay``):

- ``lru``, ``cost``: kvplug's `HybridCache`, one decision across the groups;
- ``vllm-stock``: vLLM's own `KVCacheManager` with a hybrid config (its
  `HybridKVCacheCoordinator` over its `BlockPool`); ``vllm-kvplug:<policy>`` the same
  manager with kvplug's pool;
- ``sglang-stock[:<policy>]``: SGLang's unified radix cache with its own SWA and Mamba
  components; ``sglang-kvplug:<policy>`` the same cache with kvplug's components.

The reported hit is always the junction (what the model can be served). Each arm also
counts each kind's own longest hit, on the same first admissions, and samples the bytes
each kind holds for reuse at every first admission.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field

from kvplug.core.groups import GroupKind
from kvplug.errors import KVPlugError, UnknownPolicyError
from kvplug.hybrid.cache import HybridCache
from kvplug.hybrid.policy import (
    HYBRID_POLICIES,
    OFFLINE_HYBRID_POLICIES,
    hybrid_requests_reaching,
)
from kvplug.hybrid.spec import HybridSpec
from kvplug.replay.arm_spec import Cache, parse_arm, parse_arms
from kvplug.replay.arms.base import FRESH_UNIT_BASE, ArmStats, ArmUnavailable, CacheArm
from kvplug.replay.loop import Job, Timing, make_jobs, replay
from kvplug.replay.runner import replay_clock
from kvplug.replay.trace import Trace

GIB = 1024**3


class HybridKVPlugArm(CacheArm):
    """kvplug's `HybridCache` behind the replay's arm interface."""

    def __init__(self, spec: HybridSpec, capacity_bytes: int, block_tokens: int, policy: str):
        self.name = policy
        self.cache = HybridCache(spec, capacity_bytes, block_tokens, policy)
        self._block_tokens = block_tokens

    def admit(self, req_id: int, prompt: list[int], compute: int) -> int | None:
        # The replay marks a partial last block (and the sequential sentinel) with a fresh
        # id; the prompt's full units end before it, as an engine's full blocks do.
        return self.cache.admit(req_id, prompt, compute, cacheable_units(prompt))

    @property
    def group_hits(self) -> dict[str, int]:
        """Each kind's own hit, summed over successful admissions (the cache counts them)."""
        return {kind.value: units for kind, units in self.cache.metrics.kind_units.items()}

    def grow(self, req_id: int, units: list[int]) -> bool:
        return self.cache.grow(req_id, units)

    def finish(self, req_id: int, output_tokens: int = 0) -> None:
        request = self.cache.requests.get(req_id)
        if request is not None:
            request.output_units = output_tokens
        self.cache.finish(req_id)

    def stats(self) -> ArmStats:
        return ArmStats(self.cache.metrics.retired, 0, self.cache.node_count)

    def bytes_by_kind(self) -> dict[str, int]:
        return {kind.value: held for kind, held in self.cache.cached_by_kind.items()}


@dataclass
class HybridRow:
    model: str
    policy: str
    capacity_fraction: float
    capacity_gib: float
    available: bool = True
    note: str = ""
    requests: int = 0
    junction_hit_ratio: float = 0.0  # prompt tokens served (the junction) / prompt tokens
    kind_hit_ratio: dict[str, float] = field(default_factory=dict)  # each kind on its own
    saved_compute_ratio: float = 0.0
    held_gib: dict[str, float] = field(default_factory=dict)  # mean bytes held, by kind
    saved_tflops_per_gib: float = 0.0  # saved prefill TFLOPs per GiB held (mean)
    # the same saved TFLOPs per GiB each kind holds: what a byte of that state buys
    saved_tflops_per_kind_gib: dict[str, float] = field(default_factory=dict)
    evictions: int = 0
    preemptions: int = 0
    rejected: int = 0
    seconds: float = 0.0

    def as_dict(self) -> dict:
        return asdict(self)


def check_hybrid_arms(names: list[str]) -> None:
    """Raise, naming what is accepted, if any hybrid arm name is unknown, or names an
    offline policy inside an engine (it needs the replay's future: kvplug's own cache)."""
    for spec in parse_arms(names, HYBRID_POLICIES, "hybrid arm"):
        if spec.engine is not None and spec.policy in OFFLINE_HYBRID_POLICIES:
            raise UnknownPolicyError(
                f"hybrid arm {spec.name!r}: {spec.policy} needs the future and runs in "
                f"kvplug's own hybrid cache only (arm {spec.policy!r})"
            )


def build_hybrid_arm(
    name: str,
    spec: HybridSpec,
    capacity_bytes: int,
    block_tokens: int,
    jobs: list[Job] | None = None,
) -> CacheArm:
    """Raises `ArmUnavailable` when the arm's engine is missing. An offline policy
    (`belady`) reads the future from `jobs`."""
    check_hybrid_arms([name])
    arm_spec = parse_arm(name, HYBRID_POLICIES, "hybrid arm")
    policy = arm_spec.kvplug_policy
    if arm_spec.engine == "vllm":
        try:
            from kvplug.replay.arms.vllm_hybrid import VLLMHybridArm
        except ImportError as exc:
            raise ArmUnavailable(f"the {name} arm is not available here: {exc}") from exc
        from kvplug.replay.runner import arm_policy

        kvplug_policy = arm_policy(policy, block_tokens) if policy else None
        arm = VLLMHybridArm(spec, capacity_bytes, block_tokens, policy=kvplug_policy)
        arm.name = name
        return arm
    if arm_spec.engine == "sglang":
        try:
            from kvplug.replay.arms.sglang_hybrid import SGLangHybridArm
        except ImportError as exc:
            raise ArmUnavailable(f"the {name} arm is not available here: {exc}") from exc
        arm = SGLangHybridArm(
            spec,
            capacity_bytes,
            block_tokens,
            policy=arm_spec.policy or "lru",
            kvplug=arm_spec.cache is Cache.SGLANG_KVPLUG,
        )
        arm.name = name
        return arm
    arm = HybridKVPlugArm(spec, capacity_bytes, block_tokens, name)
    policy_object = arm.cache.policy
    if policy_object.offline:
        if jobs is None:
            raise KVPlugError(f"the {name} arm needs the future: give it the replay's jobs")
        prompts = [job.prompt[: cacheable_units(job.prompt)] for job in jobs]
        policy_object.foresee(hybrid_requests_reaching(prompts))
    return arm


def cacheable_units(prompt: list[int]) -> int:
    """The prompt's full units: those before its first fresh unit (a partial last block,
    or the sequential replay's sentinel)."""
    return next((i for i, unit in enumerate(prompt) if unit >= FRESH_UNIT_BASE), len(prompt))


def capacity_bytes_for(spec: HybridSpec, trace: Trace, fraction: float) -> int:
    """`fraction` of the trace's distinct blocks, as the full-attention equivalent of
    `spec` holds them."""
    full = spec.full_attention_equivalent().kind_unit_bytes(GroupKind.FULL, trace.block_tokens)
    return int(fraction * trace.distinct_blocks * full)


def run_hybrid_replay(
    trace: Trace,
    spec: HybridSpec,
    arms: list[str],
    fractions: list[float],
    *,
    sequential: bool = False,
    timing: Timing | None = None,
    full_attention_arms: list[str] | None = None,
    progress: Callable[[str], None] | None = None,
) -> list[HybridRow]:
    """Rows for each fraction: `arms` on `spec`, then `full_attention_arms` on its
    full-attention equivalent (the reference)."""
    check_hybrid_arms(arms + list(full_attention_arms or []))
    if not fractions or min(fractions) <= 0:
        raise KVPlugError(f"capacity fractions must be positive, got {fractions}")
    reference = spec.full_attention_equivalent()
    runs = [(spec, name) for name in arms]
    runs += [(reference, name) for name in full_attention_arms or []]
    jobs = {model.name: make_jobs(trace, model) for model in (spec, reference)}
    rows = []
    for fraction in fractions:
        capacity = capacity_bytes_for(spec, trace, fraction)
        for model, name in runs:
            row = HybridRow(model.name, name, fraction, capacity / GIB)
            try:
                arm = build_hybrid_arm(name, model, capacity, trace.block_tokens, jobs[model.name])
            except (ArmUnavailable, ValueError) as exc:
                row.available, row.note = False, str(exc)
                rows.append(row)
                continue
            _replay_row(row, arm, jobs[model.name], trace.block_tokens, sequential, timing)
            rows.append(row)
            if progress:
                progress(f"{model.name} {name} @ {fraction:g}: {row.seconds:.1f} s")
    return rows


class _Sampler:
    """Counts each kind's hits and samples held bytes on first admissions only."""

    def __init__(self, arm: CacheArm) -> None:
        self.arm = arm
        self.seen: set[int] = set()
        self.kind_units: dict[str, int] = {}
        self.held_sum: dict[str, float] = {}
        self.samples = 0
        self._before: dict[str, int] = {}

    def before(self, job: Job) -> None:
        self._before = dict(getattr(self.arm, "group_hits", {}))

    def after(self, job: Job, admitted: bool) -> None:
        if not admitted or job.index in self.seen:
            return
        self.seen.add(job.index)
        for kind, units in getattr(self.arm, "group_hits", {}).items():
            delta = units - self._before.get(kind, 0)
            self.kind_units[kind] = self.kind_units.get(kind, 0) + delta
        held = _held_by_kind(self.arm)
        for kind, value in held.items():
            self.held_sum[kind] = self.held_sum.get(kind, 0.0) + value
        self.samples += 1


def _held_by_kind(arm: CacheArm) -> dict[str, float]:
    by_kind = getattr(arm, "bytes_by_kind", None)
    if callable(by_kind):
        return dict(by_kind())
    held = getattr(arm, "bytes_held", None)
    return {"all": float(held())} if callable(held) else {}


class _SampledArm(CacheArm):
    """`arm`, with each admission reported to a `_Sampler`."""

    def __init__(self, arm: CacheArm, sampler: _Sampler, jobs: list[Job]) -> None:
        self.arm, self.sampler, self.jobs = arm, sampler, jobs
        self.name = arm.name

    def admit(self, req_id: int, prompt: list[int], compute: int) -> int | None:
        job = self.jobs[req_id]
        self.sampler.before(job)
        junction = self.arm.admit(req_id, prompt, compute)
        self.sampler.after(job, junction is not None)
        return junction

    def grow(self, req_id: int, units: list[int]) -> bool:
        return self.arm.grow(req_id, units)

    def finish(self, req_id: int, output_tokens: int = 0) -> None:
        self.arm.finish(req_id, output_tokens)

    def advance(self, now: float) -> None:
        self.arm.advance(now)

    def retain(self, req_id: int, seconds: float) -> bool:
        return self.arm.retain(req_id, seconds)

    def name_session(self, req_id: int) -> None:
        self.arm.name_session(req_id)

    def stats(self) -> ArmStats:
        return self.arm.stats()


def _replay_row(
    row: HybridRow,
    arm: CacheArm,
    jobs: list[Job],
    block_tokens: int,
    sequential: bool,
    timing: Timing | None,
) -> None:
    sampler = _Sampler(arm)
    start = time.perf_counter()
    counters = replay(
        _SampledArm(arm, sampler, jobs),
        jobs,
        block_tokens,
        sequential=sequential,
        timing=timing,
        on_admit=replay_clock(arm),
    )
    row.seconds = time.perf_counter() - start
    prompt_tokens = max(counters.prompt_tokens, 1)
    row.requests = counters.requests
    row.junction_hit_ratio = counters.hit_tokens / prompt_tokens
    row.kind_hit_ratio = {
        kind: units * block_tokens / prompt_tokens for kind, units in sampler.kind_units.items()
    }
    row.saved_compute_ratio = counters.saved_flops / max(counters.total_flops, 1.0)
    samples = max(sampler.samples, 1)
    row.held_gib = {kind: total / samples / GIB for kind, total in sampler.held_sum.items()}
    held = sum(row.held_gib.values())
    row.saved_tflops_per_gib = counters.saved_flops / 1e12 / held if held else 0.0
    row.saved_tflops_per_kind_gib = {
        kind: counters.saved_flops / 1e12 / gib for kind, gib in row.held_gib.items() if gib
    }
    row.evictions = arm.stats().evictions
    row.preemptions = counters.preemptions
    row.rejected = counters.rejected


def render_hybrid(rows: list[HybridRow]) -> str:
    """A plain table: one line per (capacity, model, arm)."""
    header = (
        f"{'capacity':>8} {'GiB':>7}  {'model':<32} {'arm':<20} {'junction':>8} "
        f"{'saved':>7} {'TFLOP/GiB':>9}  per-kind hit / held GiB"
    )
    lines = [header, "-" * len(header)]
    for row in rows:
        lead = f"{row.capacity_fraction:>8.1%} {row.capacity_gib:>7.1f}  {row.model:<32} "
        if not row.available:
            lines.append(f"{lead}{row.policy:<20} unavailable: {row.note}")
            continue
        kinds = ", ".join(
            f"{kind} {row.kind_hit_ratio.get(kind, 0):.1%} / {row.held_gib.get(kind, 0):.1f}"
            for kind in sorted(set(row.kind_hit_ratio) | set(row.held_gib))
        )
        lines.append(
            f"{lead}{row.policy:<20} {row.junction_hit_ratio:>8.2%} "
            f"{row.saved_compute_ratio:>7.2%} {row.saved_tflops_per_gib:>9.1f}  {kinds}"
        )
    return "\n".join(lines)


__all__ = [
    "HybridKVPlugArm",
    "HybridRow",
    "build_hybrid_arm",
    "capacity_bytes_for",
    "check_hybrid_arms",
    "render_hybrid",
    "run_hybrid_replay",
]
