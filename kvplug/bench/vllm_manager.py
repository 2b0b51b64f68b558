"""``kvplug bench vllm-manager``: vLLM's `KVCacheManager` alone, stock pool against kvplug's.

What is measured: the time vLLM's `KVCacheManager` spends on each request of a trace, on
this machine's CPU, with vLLM's own `BlockPool` (the *stock* arm) and with kvplug's
`KVPlugBlockPool` ranked by each kvplug policy asked for. No scheduler and no model run.
Each arm is its own manager, built as the replay's ``vllm-stock`` / ``vllm-kvplug`` arms
build it (`kvplug.replay.arms.vllm.build_manager`: one unit per trace block, prefix
caching on; KV events off, as in a ``vllm serve`` without ``--kv-events-config``), for a
full-attention model (one `FullAttentionSpec` group) or a hybrid preset (one group per
`kvplug.hybrid.spec.StateGroup`, `kvplug.replay.arms.vllm_hybrid.vllm_group_spec`).

Requests run one at a time, in trace order, the same in every arm. A request's timed
manager calls, as vLLM's scheduler makes them:

- *lookup*: ``new_step_starts()`` and ``get_computed_blocks(request)``;
- *prefill*: ``allocate_slots`` for the prompt's uncached units in one step (several with a
  Mamba group, cut by vLLM's `Scheduler._mamba_block_aligned_split`, each after
  ``new_step_starts()``; the first reserves blocks for the rest, as `VLLMHybridArm` does);
- *decode*: one ``new_step_starts()`` + ``allocate_slots(request, 1)`` per decode unit (one
  per 512-token block boundary the trace's output crosses, as in the realistic replay);
- *free*: ``free(request)``, which returns the blocks to the pool for eviction.

Not timed: building the `Request` (vLLM hashes its blocks then, on the engine core's input
thread in a server), appending decode tokens (hashing again) and the scheduler's Mamba
split. Wall time is `time.perf_counter`, CPU time `time.thread_time`, both summed over the
timed calls only; the garbage collector's time inside them is added up by a
`gc.callbacks` hook. As in ``vllm-step``, the start-up heap is frozen (``gc.freeze``) and
the collector stays on.

Each arm first runs, untimed, the requests it takes the stock pool to fill up (after them
allocations evict); the rest are timed, in ``rounds`` interleaved segments: each round runs
every arm on the same segment, in an order that rotates, so a busy machine slows all arms
alike. Reported per arm: the median and 99th percentile of the time per request and the
total, each with its ratio to stock's in the same run, the range of per-round median
ratios, CPU time, the collector's share, the total of each kind of call, the prefix hit
ratio (kvplug's ``lru`` evicts in vLLM's order, so its hits equal stock's exactly) and
kvplug's evictions. `TARGETS` are the issue's bounds on the ratio, printed beside it, never
asserted.
"""

from __future__ import annotations

import gc
import platform
import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any, NamedTuple

import torch
import vllm
from vllm.sampling_params import SamplingParams
from vllm.utils.hashing import get_hash_fn_by_name
from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash
from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec
from vllm.v1.request import Request, RequestStatus

import kvplug
from kvplug.bench.told_pool import TOLD, make_told, record_handouts
from kvplug.bench.vllm_step import GCTimer, _percentile_ms
from kvplug.core.groups import GroupKind
from kvplug.core.model_spec import load_model
from kvplug.errors import ConfigError, KVPlugError, UnknownPolicyError
from kvplug.hybrid.policy import HYBRID_POLICIES
from kvplug.hybrid.spec import HYBRID_PRESETS, HybridSpec
from kvplug.policies import online_policies
from kvplug.replay.arms.vllm import HASH_ALGORITHM, MAX_MODEL_LEN, build_manager
from kvplug.replay.arms.vllm_hybrid import prefill_chunks, split_scheduler, vllm_group_spec
from kvplug.replay.hybrid import capacity_bytes_for
from kvplug.replay.loop import Job, make_jobs
from kvplug.replay.runner import arm_policy
from kvplug.replay.trace import Trace
from kvplug.vllm.block_pool import KVPlugBlockPool

STOCK = "stock"
FULL = "full"  # one full-attention group, as the replay's `VLLMStockArm`
TARGETS = {"lru": 1.05, "cost": 1.25}  # the bounds on time per request / stock's


class RequestTime(NamedTuple):
    """One request's timed manager calls, in seconds (wall time per kind of call)."""

    lookup: float
    prefill: float
    decode: float
    free: float
    cpu: float
    gc: float

    @property
    def wall(self) -> float:
        return self.lookup + self.prefill + self.decode + self.free


@dataclass
class ManagerResult:
    """One arm, model and pool size. Times per request are in microseconds, totals in
    milliseconds; ratios are this arm's figure over the stock arm's."""

    model: str
    fraction: float
    num_blocks: int
    arm: str
    p50_us: float
    ratio: float = 1.0
    target: float | None = None
    round_ratios: list[float] = field(default_factory=list)  # of the per-round medians
    p99_us: float = 0.0
    p99_ratio: float = 1.0
    total_ms: float = 0.0  # wall time of all timed calls
    total_ratio: float = 1.0
    cpu_ms: float = 0.0  # thread CPU time of all timed calls
    cpu_ratio: float = 1.0
    gc_share: float = 0.0  # the garbage collector's share of `total_ms`
    lookup_ms: float = 0.0  # totals per kind of call (wall)
    prefill_ms: float = 0.0
    decode_ms: float = 0.0
    free_ms: float = 0.0
    part_ratios: dict[str, float] = field(default_factory=dict)
    timed_requests: int = 0
    warmup_requests: int = 0
    prompt_tokens: int = 0  # of the timed requests
    hit_tokens: int = 0
    rejected: int = 0  # timed requests that did not fit the whole pool
    evictions: int | None = None  # during the timed requests; kvplug arms only
    pool: str = ""


def parse_models(text: str) -> list[tuple[str, HybridSpec | None]]:
    """``full`` and hybrid preset names, comma-separated, as (name, spec or None)."""
    accepted = [FULL, *HYBRID_PRESETS]
    names = [name.strip() for name in text.split(",") if name.strip()]
    unknown = [name for name in names if name not in accepted]
    if not names or unknown or len(set(names)) < len(names):
        raise ConfigError(
            f"bad model list {text!r}; name distinct models among: {', '.join(accepted)}"
        )
    return [(name, HYBRID_PRESETS.get(name)) for name in names]


def parse_fractions(text: str) -> list[float]:
    """Comma-separated capacity fractions, each in (0, 1]."""
    try:
        values = [float(part) for part in text.split(",") if part.strip()]
    except ValueError:
        values = []
    if not values or not all(0 < value <= 1 for value in values):
        raise ConfigError(
            f"bad capacity fractions {text!r}; accepted: comma-separated numbers in (0, 1], "
            "fractions of the trace's distinct blocks"
        )
    return values


def check_policies(policies: list[str], hybrid: bool) -> None:
    """Raise, naming what is accepted, unless `policies` are distinct online kvplug policies
    (for a hybrid model, one of `HYBRID_POLICIES`)."""
    accepted = list(HYBRID_POLICIES) if hybrid else online_policies()
    bad = [p for p in policies if p not in accepted]
    if not policies or bad or len(set(policies)) < len(policies):
        raise UnknownPolicyError(
            f"bad policies {','.join(policies)!r}"
            + (" for a hybrid model" if hybrid else "")
            + f"; name distinct kvplug policies among: {', '.join(accepted)} "
            "(the stock arm always runs)"
        )


def kv_cache_config(spec: HybridSpec | None, num_blocks: int, block_tokens: int) -> KVCacheConfig:
    """`num_blocks` usable blocks (plus vLLM's null block 0) for one full-attention group,
    or for `spec`'s groups; one trace block per vLLM block, layer shapes irrelevant."""
    if spec is None:
        full = FullAttentionSpec(block_size=1, num_kv_heads=1, head_size=1, dtype=torch.float16)
        groups = [KVCacheGroupSpec(layer_names=["layer.0"], kv_cache_spec=full)]
    else:
        groups = [
            KVCacheGroupSpec(
                layer_names=[f"layer.{i}.{j}" for j in range(group.layers)],
                kv_cache_spec=vllm_group_spec(group, block_tokens),
            )
            for i, group in enumerate(spec.groups)
        ]
    return KVCacheConfig(num_blocks=num_blocks + 1, kv_cache_tensors=[], kv_cache_groups=groups)


def pool_blocks(spec: HybridSpec | None, trace: Trace, fraction: float) -> int:
    """Usable blocks for `fraction` of the trace's distinct blocks: that many blocks for full
    attention; for a hybrid model, the bytes its full-attention equivalent needs for them,
    in pages of the hybrid's largest group (as the hybrid replay sizes it)."""
    if spec is None:
        return max(1, round(fraction * trace.distinct_blocks))
    page = spec.page_bytes(trace.block_tokens)
    return max(1, capacity_bytes_for(spec, trace, fraction) // page)


class _Clock:
    """Adds up wall, thread CPU and garbage-collector time over start/stop spans."""

    __slots__ = ("gc_timer", "cpu", "gc", "_wall", "_cpu", "_gc")

    def __init__(self, gc_timer: GCTimer) -> None:
        self.gc_timer = gc_timer
        self.cpu = self.gc = 0.0
        self._wall = self._cpu = self._gc = 0.0

    def start(self) -> None:
        self._gc = self.gc_timer.seconds
        self._cpu = time.thread_time()
        self._wall = time.perf_counter()

    def stop(self) -> float:
        wall = time.perf_counter() - self._wall
        self.cpu += time.thread_time() - self._cpu
        self.gc += self.gc_timer.seconds - self._gc
        return wall


class ManagerArm:
    """One `KVCacheManager`, stock (`name` ``"stock"``) or over kvplug's pool ranked by the
    policy `name`, driven one request at a time."""

    def __init__(
        self,
        name: str,
        spec: HybridSpec | None,
        num_blocks: int,
        block_tokens: int,
        handouts: list[list[int]] | None = None,
    ) -> None:
        self.name = name
        self.block_tokens = block_tokens
        stock = name == STOCK or handouts is not None
        policy = None if stock else arm_policy(name, block_tokens)
        config = kv_cache_config(spec, num_blocks, block_tokens)
        self.manager = build_manager(config, policy, kv_events=False)
        self.pool = self.manager.block_pool
        if handouts is not None:  # stock's pool, told the recorded blocks (`told_pool`)
            make_told(self.pool, handouts)
        kinds = [group.kind for group in spec.groups] if spec else [GroupKind.FULL]
        self.attention_groups = sum(kind is not GroupKind.MAMBA for kind in kinds)
        self.mamba_groups = len(kinds) - self.attention_groups
        self.split_scheduler = split_scheduler() if self.mamba_groups else None
        hash_fn = get_hash_fn_by_name(HASH_ALGORITHM)
        init_none_hash(hash_fn)
        self.block_hasher = get_request_block_hasher(1, hash_fn)
        self.params = SamplingParams(max_tokens=MAX_MODEL_LEN)
        self.seen: list[int] = []  # request indices, in the order run
        self.hits: list[int] = []  # units found in the prefix cache, per request run
        self.times: list[RequestTime] = []
        self.prompt_tokens = self.hit_tokens = self.rejected = 0

    def run(self, job: Job, clock: _Clock | None = None) -> None:
        """Run `job` through the manager; with a `clock`, its calls are timed and counted."""
        timed = clock is not None
        clock = clock or _Clock(GCTimer())
        cpu, gc_seconds = clock.cpu, clock.gc
        manager = self.manager
        request = Request(
            str(job.index), job.prompt, self.params, None, block_hasher=self.block_hasher
        )
        decode = free = 0.0
        clock.start()
        manager.new_step_starts()
        hit_blocks, hits, boundary = manager.get_computed_blocks(request)
        lookup = clock.stop()
        request.shared_prefix_boundary = boundary
        chunks = prefill_chunks(self.split_scheduler, request, hits, len(job.prompt) - hits) or [0]
        reserve = sum(n * self.attention_groups + self.mamba_groups for n in chunks[1:])
        clock.start()
        allocated = manager.allocate_slots(
            request,
            chunks[0],
            num_new_computed_tokens=hits,
            new_computed_blocks=hit_blocks,
            full_sequence_must_fit=False,
            reserved_blocks=reserve,
        )
        if allocated is not None:
            request.status = RequestStatus.RUNNING
            request.num_computed_tokens = hits + chunks[0]
            for count in chunks[1:]:
                manager.new_step_starts()
                if manager.allocate_slots(request, count) is None:
                    raise RuntimeError(f"request {job.index}: a reserved prefill chunk did not fit")
                request.num_computed_tokens += count
        prefill = clock.stop()
        if allocated is not None:
            for _, unit in job.decode:
                request.append_output_token_ids([unit])
                clock.start()
                manager.new_step_starts()
                grown = manager.allocate_slots(request, 1)
                decode += clock.stop()
                if grown is None:
                    break  # it outgrew the pool: freed as it is
                request.num_computed_tokens += 1
            clock.start()
            manager.free(request)
            free = clock.stop()
        self.seen.append(job.index)
        self.hits.append(hits if allocated is not None else 0)
        if timed:
            cpu, gc_seconds = clock.cpu - cpu, clock.gc - gc_seconds
            self.times.append(RequestTime(lookup, prefill, decode, free, cpu, gc_seconds))
            self.prompt_tokens += job.input_length
            self.hit_tokens += self.hits[-1] * self.block_tokens
            self.rejected += allocated is None

    def fresh_blocks(self) -> int:
        """Free blocks that never held a hash: allocations take these before evicting."""
        return sum(
            1 for b in self.pool.blocks if b.ref_cnt == 0 and b.block_hash is None and not b.is_null
        )

    def evictions(self) -> int | None:
        if isinstance(self.pool, KVPlugBlockPool):
            return self.pool.stats.evictions
        return None


def warmup_requests(arm: ManagerArm, jobs: list[Job], limit: int, every: int = 10) -> int:
    """Run `jobs` untimed through `arm` until its pool is full (fresh free blocks at most 1%
    of it); returns how many ran. Raises if `limit` requests do not fill it."""
    threshold = arm.pool.num_gpu_blocks // 100
    for count, job in enumerate(jobs[:limit], 1):
        arm.run(job)
        if count % every == 0 and arm.fresh_blocks() <= threshold:
            return count
    raise KVPlugError(
        f"{limit:,} requests do not fill a pool of {arm.pool.num_gpu_blocks - 1:,} blocks, "
        "leaving too few to time; use a smaller capacity fraction or more requests"
    )


def bench_size(
    model: str,
    spec: HybridSpec | None,
    trace: Trace,
    jobs: list[Job],
    fraction: float,
    policies: list[str],
    rounds: int,
    arms_out: list[ManagerArm] | None = None,
    told: Sequence[str] = (),
) -> list[ManagerResult]:
    """Every arm through `jobs` at `fraction` of the trace's distinct blocks: the requests
    that fill the stock pool untimed, the rest timed in `rounds` interleaved segments.
    Each policy in `told` adds an arm ``told:POLICY``: vLLM's own pool handed out the
    blocks a first, untimed run of the policy's pool handed out (`kvplug.bench.told_pool`),
    checked to get the same hits."""
    num_blocks = pool_blocks(spec, trace, fraction)
    block_tokens = trace.block_tokens
    arms = [ManagerArm(name, spec, num_blocks, block_tokens) for name in [STOCK, *policies]]
    recorded: dict[str, list[int]] = {}  # a told arm's name: the recorded run's hits
    gc.collect()
    gc.freeze()  # as vLLM's engine core does once its scheduler is built
    try:
        warmup = warmup_requests(arms[0], jobs, limit=len(jobs) - rounds)
        for name in told:
            recorder = ManagerArm(name, spec, num_blocks, block_tokens)
            handouts = record_handouts(recorder.pool)
            for job in jobs:
                recorder.run(job)
            recorded[f"{TOLD}{name}"] = recorder.hits
            del recorder
            arms.append(ManagerArm(f"{TOLD}{name}", spec, num_blocks, block_tokens, handouts))
        for arm in arms[1:]:
            for job in jobs[:warmup]:
                arm.run(job)
        evictions_before = {arm.name: arm.evictions() for arm in arms}
        timed = jobs[warmup:]
        bounds = [round(r * len(timed) / rounds) for r in range(rounds + 1)]
        round_medians: dict[str, list[float]] = {arm.name: [] for arm in arms}
        with GCTimer() as gc_timer:
            clocks = {arm.name: _Clock(gc_timer) for arm in arms}
            for r in range(rounds):
                for arm in arms[r % len(arms) :] + arms[: r % len(arms)]:
                    start = len(arm.times)
                    for job in timed[bounds[r] : bounds[r + 1]]:
                        arm.run(job, clocks[arm.name])
                    round_medians[arm.name].append(
                        statistics.median(t.wall for t in arm.times[start:])
                    )
    finally:
        gc.unfreeze()
    for arm in arms:
        if arm.name in recorded and recorded[arm.name] != arm.hits:
            raise KVPlugError(f"{arm.name}: vLLM's pool told the same blocks got other hits")
    results = []
    for arm in arms:
        result = _result(arm, model, fraction, num_blocks, warmup)
        before, after = evictions_before[arm.name], arm.evictions()
        result.evictions = None if before is None or after is None else after - before
        results.append(result)
    _ratios(results, round_medians)
    if arms_out is not None:
        arms_out.extend(arms)
    return results


def _result(
    arm: ManagerArm, model: str, fraction: float, num_blocks: int, warmup: int
) -> ManagerResult:
    times = arm.times
    walls = [t.wall for t in times]
    total = sum(walls)
    return ManagerResult(
        model=model,
        fraction=fraction,
        num_blocks=num_blocks,
        arm=arm.name,
        p50_us=statistics.median(walls) * 1e6,
        target=TARGETS.get(arm.name),
        p99_us=_percentile_ms(walls, 99) * 1e3,
        total_ms=total * 1e3,
        cpu_ms=sum(t.cpu for t in times) * 1e3,
        gc_share=sum(t.gc for t in times) / max(total, 1e-12),
        lookup_ms=sum(t.lookup for t in times) * 1e3,
        prefill_ms=sum(t.prefill for t in times) * 1e3,
        decode_ms=sum(t.decode for t in times) * 1e3,
        free_ms=sum(t.free for t in times) * 1e3,
        timed_requests=len(times),
        warmup_requests=warmup,
        prompt_tokens=arm.prompt_tokens,
        hit_tokens=arm.hit_tokens,
        rejected=arm.rejected,
        pool=type(arm.pool).__name__,
    )


PARTS = ("lookup", "prefill", "decode", "free")


def _ratios(results: list[ManagerResult], round_medians: dict[str, list[float]]) -> None:
    stock = results[0]
    for r in results:
        r.ratio = r.p50_us / stock.p50_us
        r.p99_ratio = r.p99_us / stock.p99_us
        r.total_ratio = r.total_ms / stock.total_ms
        r.cpu_ratio = r.cpu_ms / max(stock.cpu_ms, 1e-12)
        r.part_ratios = {
            part: getattr(r, f"{part}_ms") / max(getattr(stock, f"{part}_ms"), 1e-12)
            for part in PARTS
        }
        r.round_ratios = [
            mine / theirs
            for mine, theirs in zip(round_medians[r.arm], round_medians[STOCK], strict=True)
        ]


def bench_vllm_manager(
    trace: Trace,
    models: list[tuple[str, HybridSpec | None]],
    fractions: list[float],
    policies: list[str],
    rounds: int = 10,
    progress: Callable[[str], None] | None = None,
    told: Sequence[str] = (),
) -> list[ManagerResult]:
    """`bench_size` for each model and capacity fraction, on the same requests (with a
    ``told:POLICY`` arm for each policy in `told`)."""
    for _, spec in models:
        check_policies(policies, hybrid=spec is not None)
        if told:
            check_policies(list(told), hybrid=spec is not None)
    if not 1 <= rounds < len(trace.requests):
        raise ConfigError(f"rounds must be in [1, {len(trace.requests) - 1}], got {rounds}")
    jobs = make_jobs(trace, load_model(None))  # units and decode steps; FLOPs are unused
    results: list[ManagerResult] = []
    for model, spec in models:
        for fraction in fractions:
            if progress is not None:
                arms = [*policies, *(f"{TOLD}{name}" for name in told)]
                progress(f"{model} at {fraction:g}: stock, {', '.join(arms)}")
            results += bench_size(
                model, spec, trace, jobs, fraction, policies, rounds, told=told
            )  # fmt: skip
            gc.collect()
    return results


def report(results: list[ManagerResult], trace: Trace, rounds: int) -> dict[str, Any]:
    """The JSON report: versions, settings and one row per model, size and arm."""
    return {
        "benchmark": "vllm-manager",
        "vllm": vllm.__version__,
        "kvplug": kvplug.__version__,
        "python": platform.python_version(),
        "machine": platform.machine(),
        "trace": trace.name,
        "requests": len(trace.requests),
        "block_tokens": trace.block_tokens,
        "rounds": rounds,
        "targets": TARGETS,
        "results": [asdict(r) for r in results],
    }


def format_table(results: list[ManagerResult]) -> str:
    width = max([5, *(len(r.arm) for r in results)])
    header = (
        f"{'model':<15} {'frac':>5} {'blocks':>7} {'arm':<{width}} {'p50 us':>8} {'ratio':>6} "
        f"{'target':>7} {'rounds':>10} {'p99 us':>8} {'ratio':>6} {'total ms':>9} {'ratio':>6} "
        f"{'cpu':>6} {'gc %':>5} {'lookup':>7} {'prefill':>7} {'decode':>7} {'free':>7} "
        f"{'hit %':>6} {'evicted':>8}"
    )
    lines = [header, "-" * len(header)]
    for r in results:
        hit = 100 * r.hit_tokens / r.prompt_tokens if r.prompt_tokens else 0.0
        span = f"{min(r.round_ratios):.2f}-{max(r.round_ratios):.2f}" if r.round_ratios else ""
        target = "-" if r.target is None else f"<={r.target:.2f}x"
        evictions = "-" if r.evictions is None else f"{r.evictions:,}"
        lines.append(
            f"{r.model:<15} {r.fraction:>5g} {r.num_blocks:>7,} {r.arm:<{width}} {r.p50_us:>8.1f} "
            f"{r.ratio:>5.2f}x {target:>7} {span:>10} {r.p99_us:>8.1f} {r.p99_ratio:>5.2f}x "
            f"{r.total_ms:>9.1f} {r.total_ratio:>5.2f}x {r.cpu_ratio:>5.2f}x "
            f"{100 * r.gc_share:>5.1f} {r.lookup_ms:>7.1f} {r.prefill_ms:>7.1f} "
            f"{r.decode_ms:>7.1f} {r.free_ms:>7.1f} {hit:>6.1f} {evictions:>8}"
        )
    return "\n".join(lines)
