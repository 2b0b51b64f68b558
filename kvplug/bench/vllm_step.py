"""``kvplug bench vllm-step``: vLLM's scheduler step with kvplug's block pool against stock.

What is measured: the time of one engine-core scheduler step on this machine's CPU, for
vLLM's own `Scheduler` (the *stock* arm) and for ``kvplug.vllm.Scheduler`` with each kvplug
policy asked for, at each KV cache size. A step is what the engine core runs around the
model's forward pass:

- ``add_request`` for the requests that arrived since the last step (kvplug salts and
  re-hashes each request's blocks here, so that is counted);
- ``schedule()`` (prefix lookups, allocation and so eviction, caching of full blocks);
- ``update_from_output()`` with the step's sampled tokens (finished requests free their
  blocks here, which is where kvplug ranks them).

No model runs. The schedulers are real vLLM schedulers, built as vLLM's own scheduler unit
tests build them: a `VllmConfig` for a tiny model directory (`kvplug.tools.tiny_model`, tokenizer
not loaded), a `KVCacheConfig` of ``num_blocks`` blocks with one full-attention group and
no tensors, a `StructuredOutputManager`. The model runner's output is fabricated: one
sampled token for each request whose prompt is fully computed, a token that depends only on
the request and its position, so every arm sees the same outputs. Building `Request`
objects (vLLM hashes their blocks in the constructor, in a real server on the engine core's
input thread) and fabricating outputs are not timed.

The workload (`Workload`, `RequestStream`, seeded, the same for every arm): each prompt is
a shared "system" prefix (64 of them, Zipf-popular) or, for 30% of requests, an earlier
request's prompt plus its output (a follow-up turn), then a unique suffix of 4-16 blocks;
each request generates 2-16 tokens and finishes (``ignore_eos``), freeing its blocks to the
cache. The harness keeps ``concurrency`` requests in each scheduler (running plus waiting),
so every arm admits the stream in the same order. Each arm is warmed up until its pool is
full (no free block without a cached hash is left, so allocations evict), then for some
more steps.

Timing: as vLLM's engine core does once its scheduler is built, the start-up heap is
frozen (``gc.freeze``) and the garbage collector stays on. The timed steps are interleaved:
``rounds`` rounds, each running a share of every arm's ``steps`` steps (the order rotates),
so a busy machine slows all arms alike. Reported per arm: the median (p50) step (wall) time
and its ratio to the stock arm's, the range of the per-round ratios, the 99th percentile
(p99), the mean (which includes the rare long steps, such as full garbage collections) and
the median thread CPU time, each with its ratio; the mean time in the garbage collector and
its share of all timed wall time; the medians of the three parts; scheduled and prefix-hit
tokens; evictions (kvplug arms; stock vLLM does not count them).

With the ``lru`` policy kvplug evicts in vLLM's order, so the lru and stock arms do the same
work step for step (they schedule the same tokens); other policies keep other blocks, so
their hits, and so the tokens they compute, differ a little from stock's.

All arms live in one process: a full garbage collection scans every arm's objects, whichever
arm's step triggers it, so ``gc_ms`` is indicative only.
"""

from __future__ import annotations

import contextlib
import copy
import gc
import hashlib
import platform
import random
import statistics
import tempfile
import time
from collections import deque
from collections.abc import Callable, Iterator, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, NamedTuple

import torch
import vllm
from vllm.config import CacheConfig, DeviceConfig, ModelConfig, SchedulerConfig, VllmConfig
from vllm.sampling_params import SamplingParams
from vllm.utils.hashing import get_hash_fn_by_name
from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash
from vllm.v1.core.sched.scheduler import Scheduler as StockScheduler
from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec
from vllm.v1.outputs import ModelRunnerOutput
from vllm.v1.request import Request
from vllm.v1.structured_output import StructuredOutputManager

import kvplug.vllm
from kvplug.bench.told_pool import TOLD, make_told, record_handouts
from kvplug.errors import KVPlugError
from kvplug.vllm.block_pool import KVPlugBlockPool
from kvplug.vllm.compat import model_runner_output

STOCK = "stock"
QUEUE_SUFFIX = "+queue"  # an arm POLICY+queueN protects N waiting requests' hits
TOKEN_BASE = 4  # token ids below this are the tiny model's special tokens
TOKEN_RANGE = 256  # prompt tokens are random bytes; the tiny model's vocabulary is 512


@dataclass
class Workload:
    """The synthetic request stream and the scheduler limits; the same for every arm."""

    block_size: int = 16
    max_num_seqs: int = 128
    max_num_batched_tokens: int = 4096
    max_model_len: int = 4096
    concurrency: int = 160  # requests kept in the scheduler (running + waiting)
    num_prefixes: int = 64  # shared system prompts
    prefix_blocks: tuple[int, int] = (2, 16)
    suffix_blocks: tuple[int, int] = (4, 16)  # unique tokens per request, in blocks
    output_tokens: tuple[int, int] = (2, 16)
    follow_up: float = 0.3  # share of requests continuing an earlier request's dialogue
    follow_up_window: int = 2_000  # how far back a follow-up may look, in requests
    max_prompt_blocks: int = 96
    seed: int = 0


@dataclass
class ArmResult:
    """One arm at one pool size. Times are per step, in milliseconds; ratios are this
    arm's figure over the stock arm's."""

    arm: str
    num_blocks: int
    step_ms: float  # median (p50) wall time over all timed steps
    ratio: float = 1.0
    p99_ms: float = 0.0  # 99th percentile of the wall time
    p99_ratio: float = 1.0
    round_ratios: list[float] = field(default_factory=list)  # of the per-round medians
    mean_ms: float = 0.0  # mean wall time (includes the rare long steps: full GC, ...)
    mean_ratio: float = 1.0
    cpu_ms: float = 0.0  # median thread CPU time (less sensitive to a busy machine)
    cpu_ratio: float = 1.0
    gc_ms: float = 0.0  # mean time in the garbage collector
    gc_share: float = 0.0  # the garbage collector's share of the total wall time
    add_ms: float = 0.0  # medians of the step's parts (wall)
    schedule_ms: float = 0.0
    update_ms: float = 0.0
    timed_steps: int = 0
    warmup_steps: int = 0
    scheduled_tokens: int = 0  # during the timed steps
    prompt_tokens: int = 0  # of requests first scheduled during the timed steps
    hit_tokens: int = 0  # of those, found in the prefix cache
    finished_requests: int = 0
    evictions: int | None = None  # kvplug arms only (stock vLLM does not count them)
    preemptions: int = 0
    pool: str = ""


class GCTimer:
    """A `gc.callbacks` hook that adds up the time the garbage collector runs."""

    def __init__(self) -> None:
        self.seconds = 0.0
        self._start = 0.0

    def __call__(self, phase: str, info: dict[str, int]) -> None:
        if phase == "start":
            self._start = time.perf_counter()
        else:
            self.seconds += time.perf_counter() - self._start

    def __enter__(self) -> GCTimer:
        gc.callbacks.append(self)
        return self

    def __exit__(self, *exc: object) -> None:
        gc.callbacks.remove(self)


class StepTime(NamedTuple):
    """One timed step, in seconds: wall time of its three parts, thread CPU time of all
    three, and the garbage collector's share of the wall time."""

    add: float
    schedule: float
    update: float
    cpu: float
    gc: float

    @property
    def wall(self) -> float:
        return self.add + self.schedule + self.update


@dataclass
class _Planned:
    number: int
    prompt: list[int]
    max_tokens: int


def output_token(number: int, index: int) -> int:
    """The token request `number` samples at output position `index` (arm-independent)."""
    return TOKEN_BASE + (number * 7_919 + index * 104_729) % TOKEN_RANGE


class RequestStream:
    """The seeded request stream: an endless sequence of prompts and output lengths."""

    def __init__(self, workload: Workload) -> None:
        self.workload = workload
        self.rng = random.Random(workload.seed)
        lengths = [
            self.rng.randint(*workload.prefix_blocks) * workload.block_size
            for _ in range(workload.num_prefixes)
        ]
        self.prefixes = [self._tokens(n) for n in lengths]
        self.weights = [1 / (rank + 1) for rank in range(workload.num_prefixes)]
        self.history: deque[_Planned] = deque(maxlen=workload.follow_up_window)
        self.count = 0

    def _tokens(self, n: int) -> list[int]:
        return [TOKEN_BASE + byte for byte in self.rng.randbytes(n)]

    def next(self) -> _Planned:
        w = self.workload
        bs = w.block_size
        suffix = self._tokens(self.rng.randint(*w.suffix_blocks) * bs + self.rng.randrange(bs))
        head: list[int] | None = None
        if self.history and self.rng.random() < w.follow_up:
            # Continue an older request (old enough to have finished): its prompt + output.
            older = len(self.history) - min(len(self.history), w.concurrency * 2)
            if older > 0:
                prev = self.history[self.rng.randrange(older)]
                head = prev.prompt + [output_token(prev.number, i) for i in range(prev.max_tokens)]
                if len(head) + len(suffix) > w.max_prompt_blocks * bs:
                    head = None
        if head is None:
            head = self.rng.choices(self.prefixes, self.weights)[0]
        planned = _Planned(self.count, head + suffix, self.rng.randint(*w.output_tokens))
        self.count += 1
        self.history.append(planned)
        return planned


def build_vllm_config(model_dir: Path, workload: Workload, num_blocks: int) -> VllmConfig:
    """A `VllmConfig` as vLLM's scheduler unit tests make one: no model is loaded."""
    model_config = ModelConfig(
        model=str(model_dir),
        skip_tokenizer_init=True,
        max_model_len=workload.max_model_len,
        dtype="float32",
        seed=0,
    )
    cache_config = CacheConfig(block_size=workload.block_size, enable_prefix_caching=True)
    scheduler_config = SchedulerConfig(
        max_num_seqs=workload.max_num_seqs,
        max_num_batched_tokens=workload.max_num_batched_tokens,
        max_model_len=workload.max_model_len,
        is_encoder_decoder=False,
    )
    config = VllmConfig(
        model_config=model_config,
        cache_config=cache_config,
        scheduler_config=scheduler_config,
        device_config=DeviceConfig(device="cpu"),  # no model runs; no platform is needed
    )
    config.cache_config.num_gpu_blocks = num_blocks
    return config


def kv_cache_config(workload: Workload, num_blocks: int) -> KVCacheConfig:
    spec = FullAttentionSpec(
        block_size=workload.block_size, num_kv_heads=1, head_size=32, dtype=torch.float32
    )
    return KVCacheConfig(
        num_blocks=num_blocks,
        kv_cache_tensors=[],
        kv_cache_groups=[KVCacheGroupSpec(layer_names=["layer"], kv_cache_spec=spec)],
    )


def scheduler_kwargs(config: VllmConfig, workload: Workload, num_blocks: int) -> dict[str, Any]:
    """What vLLM's engine core passes a scheduler class, for this workload and pool."""
    return dict(
        vllm_config=config,
        kv_cache_config=kv_cache_config(workload, num_blocks),
        structured_output_manager=StructuredOutputManager(config),
        block_size=workload.block_size,
        hash_block_size=workload.block_size,
        log_stats=False,
    )


class Arm:
    """One scheduler and its copy of the request stream. `name` is ``"stock"`` (vLLM's
    `Scheduler`) or a kvplug policy (``kvplug.vllm.Scheduler`` with that policy); with
    `handouts`, vLLM's `Scheduler` whose pool hands out those blocks
    (`kvplug.bench.told_pool`)."""

    def __init__(
        self,
        name: str,
        base_config: VllmConfig,
        workload: Workload,
        num_blocks: int,
        handouts: list[list[int]] | None = None,
    ) -> None:
        self.name = name
        self.workload = workload
        config = copy.deepcopy(base_config)
        stock = name == STOCK or handouts is not None
        if not stock:
            config.additional_config = {"kvplug": arm_config(name)}
        kwargs = scheduler_kwargs(config, workload, num_blocks)
        self.scheduler = StockScheduler(**kwargs) if stock else kvplug.vllm.Scheduler(**kwargs)
        self.pool = self.scheduler.kv_cache_manager.block_pool
        if handouts is not None:
            make_told(self.pool, handouts)
        hash_fn = get_hash_fn_by_name(config.cache_config.prefix_caching_hash_algo)
        init_none_hash(hash_fn)
        self.block_hasher = get_request_block_hasher(workload.block_size, hash_fn)
        self.stream = RequestStream(workload)
        self.steps = 0
        self.times: list[StepTime] = []
        self.scheduled_tokens = 0
        self.prompt_tokens = 0
        self.hit_tokens = 0
        self.finished = 0
        self.preemptions = 0

    def _new_requests(self) -> list[Request]:
        requests = []
        for _ in range(self.workload.concurrency - len(self.scheduler.requests)):
            planned = self.stream.next()
            params = SamplingParams(max_tokens=planned.max_tokens, ignore_eos=True)
            request = Request(
                str(planned.number),
                planned.prompt,
                params,
                None,
                block_hasher=self.block_hasher,
            )
            requests.append(request)
        return requests

    def step(self, timed: bool, gc_timer: GCTimer | None = None) -> None:
        """One engine-core step; with `timed`, its times and counts are recorded."""
        scheduler = self.scheduler
        new = self._new_requests()
        g0 = gc_timer.seconds if gc_timer else 0.0
        c0 = time.thread_time()
        t0 = time.perf_counter()
        for request in new:
            scheduler.add_request(request)
        t1 = time.perf_counter()
        output = scheduler.schedule()
        t2 = time.perf_counter()
        c1 = time.thread_time()
        g1 = gc_timer.seconds if gc_timer else 0.0
        runner_output = self._fabricate(output)
        g2 = gc_timer.seconds if gc_timer else 0.0
        c2 = time.thread_time()
        t3 = time.perf_counter()
        engine_outputs = scheduler.update_from_output(output, runner_output)
        t4 = time.perf_counter()
        c3 = time.thread_time()
        g3 = gc_timer.seconds if gc_timer else 0.0
        self.steps += 1
        if not timed:
            return
        gc_seconds = g1 - g0 + g3 - g2
        self.times.append(StepTime(t1 - t0, t2 - t1, t4 - t3, c1 - c0 + c3 - c2, gc_seconds))
        self.scheduled_tokens += output.total_num_scheduled_tokens
        self.preemptions += len(output.preempted_req_ids or ())
        for data in output.scheduled_new_reqs:
            self.prompt_tokens += len(data.prompt_token_ids or ())
            self.hit_tokens += data.num_computed_tokens
        for outputs in engine_outputs.values():
            self.finished += sum(1 for o in outputs.outputs if o.finish_reason is not None)

    def _fabricate(self, output: Any) -> ModelRunnerOutput:
        """The model runner's answer: one token for each request past its prompt."""
        req_ids = list(output.num_scheduled_tokens)
        sampled: list[list[int]] = []
        requests = self.scheduler.requests
        for req_id in req_ids:
            request = requests[req_id]
            if request.is_prefill_chunk:
                sampled.append([])
            else:
                sampled.append([output_token(int(req_id), request.num_output_tokens)])
        return model_runner_output(req_ids, sampled)

    def fresh_free_blocks(self) -> int:
        """Free blocks holding no cached hash: allocations take these before evicting."""
        blocks = self.pool.blocks
        return sum(1 for b in blocks if b.ref_cnt == 0 and b.block_hash is None and not b.is_null)

    def evictions(self) -> int | None:
        if isinstance(self.pool, KVPlugBlockPool):
            return self.pool.stats.evictions
        return None

    def warm_up(self, max_steps: int, settle: int) -> None:
        """Step until the pool is full of cached blocks (allocations evict), then `settle`."""
        limit = max(self.workload.max_num_seqs, self.pool.num_gpu_blocks // 100)
        while self.fresh_free_blocks() > limit:
            for _ in range(10):
                self.step(timed=False)
            if self.steps > max_steps:
                raise RuntimeError(
                    f"{self.name}: the pool of {self.pool.num_gpu_blocks:,} blocks is not full "
                    f"after {self.steps:,} steps; the workload is too small for it"
                )
        for _ in range(settle):
            self.step(timed=False)


def _median_ms(values: list[float]) -> float:
    return statistics.median(values) * 1e3


def arm_config(name: str) -> dict[str, Any]:
    """The kvplug configuration of arm `name`: a policy, or ``POLICY+queueN`` for the
    policy with the first N waiting requests' hits protected (`kvplug.vllm.queue_protection`:
    the harness keeps more requests than a step's batch, so some always wait)."""
    policy, suffix, depth = name.partition(QUEUE_SUFFIX)
    if not suffix:
        return {"policy": policy}
    if not depth.isdigit():
        raise KVPlugError(f"arm {name!r}: write POLICY{QUEUE_SUFFIX}N, N waiting requests")
    return {"policy": policy, "queue_protection": {"requests": int(depth)}}


def _percentile_ms(values: list[float], percent: int) -> float:
    """The `percent`-th percentile of `values` (seconds), in milliseconds."""
    if len(values) < 2:
        return values[0] * 1e3
    return statistics.quantiles(values, n=100, method="inclusive")[percent - 1] * 1e3


def bench_size(
    model_dir: Path,
    num_blocks: int,
    policies: list[str],
    steps: int,
    rounds: int,
    workload: Workload,
    max_warmup_steps: int = 20_000,
    arms_out: list[Arm] | None = None,
    told: Sequence[str] = (),
) -> list[ArmResult]:
    """Time the stock arm and one kvplug arm per policy at `num_blocks` blocks: `steps`
    timed steps per arm, in `rounds` interleaved segments. Each policy in `told` adds an
    arm ``told:POLICY``: vLLM's own scheduler and pool, the pool handing out the blocks a
    first, untimed run of the policy's arm handed out (`kvplug.bench.told_pool`), checked
    to schedule and hit the same tokens."""
    base_config = build_vllm_config(model_dir, workload, num_blocks)
    arms = [Arm(name, base_config, workload, num_blocks) for name in [STOCK, *policies]]
    settle = max(steps // rounds, 50)
    recorded: dict[str, tuple[int, int]] = {}  # a told arm's name: (scheduled, hit) tokens
    for name in told:
        recorder = Arm(name, base_config, workload, num_blocks)
        handouts = record_handouts(recorder.pool)
        recorder.warm_up(max_warmup_steps, settle)
        for _ in range(steps):
            recorder.step(timed=True)
        recorded[f"{TOLD}{name}"] = (recorder.scheduled_tokens, recorder.hit_tokens)
        arms.append(Arm(f"{TOLD}{name}", base_config, workload, num_blocks, handouts))
        del recorder
    # As vLLM's engine core does once its scheduler is built: the start-up heap is frozen,
    # so the garbage collector only scans what is allocated while serving.
    gc.collect()
    gc.freeze()
    try:
        for arm in arms:
            arm.warm_up(max_warmup_steps, settle)
        warmup = {arm.name: arm.steps for arm in arms}
        evictions_before = {arm.name: arm.evictions() for arm in arms}
        round_medians: dict[str, list[float]] = {arm.name: [] for arm in arms}
        per_round = [steps // rounds + (r < steps % rounds) for r in range(rounds)]
        with GCTimer() as gc_timer:
            for r, count in enumerate(per_round):
                order = arms[r % len(arms) :] + arms[: r % len(arms)]
                for arm in order:
                    start = len(arm.times)
                    for _ in range(count):
                        arm.step(timed=True, gc_timer=gc_timer)
                    walls = [t.wall for t in arm.times[start:]]
                    round_medians[arm.name].append(statistics.median(walls))
    finally:
        gc.unfreeze()
    for arm in arms:
        if arm.name in recorded and recorded[arm.name] != (arm.scheduled_tokens, arm.hit_tokens):
            raise KVPlugError(f"{arm.name}: vLLM's pool told the same blocks scheduled otherwise")
    results = [
        _result(arm, warmup[arm.name], evictions_before[arm.name], num_blocks) for arm in arms
    ]
    stock = results[0]
    for result in results:
        result.ratio = result.step_ms / stock.step_ms
        result.p99_ratio = result.p99_ms / stock.p99_ms
        result.mean_ratio = result.mean_ms / stock.mean_ms
        result.cpu_ratio = result.cpu_ms / stock.cpu_ms
        result.round_ratios = [
            mine / theirs
            for mine, theirs in zip(round_medians[result.arm], round_medians[STOCK], strict=True)
        ]
    if arms_out is not None:
        arms_out.extend(arms)
    return results


def _result(
    arm: Arm, warmup_steps: int, evictions_before: int | None, num_blocks: int
) -> ArmResult:
    times = arm.times
    evictions = arm.evictions()
    return ArmResult(
        arm=arm.name,
        num_blocks=num_blocks,
        step_ms=_median_ms([t.wall for t in times]),
        p99_ms=_percentile_ms([t.wall for t in times], 99),
        mean_ms=statistics.fmean(t.wall for t in times) * 1e3,
        cpu_ms=_median_ms([t.cpu for t in times]),
        gc_ms=statistics.fmean(t.gc for t in times) * 1e3,
        gc_share=sum(t.gc for t in times) / max(sum(t.wall for t in times), 1e-12),
        add_ms=_median_ms([t.add for t in times]),
        schedule_ms=_median_ms([t.schedule for t in times]),
        update_ms=_median_ms([t.update for t in times]),
        timed_steps=len(times),
        warmup_steps=warmup_steps,
        scheduled_tokens=arm.scheduled_tokens,
        prompt_tokens=arm.prompt_tokens,
        hit_tokens=arm.hit_tokens,
        finished_requests=arm.finished,
        evictions=None
        if evictions is None or evictions_before is None
        else evictions - evictions_before,
        preemptions=arm.preemptions,
        pool=type(arm.pool).__name__,
    )


@contextlib.contextmanager
def tiny_model_dir(model_dir: Path | None = None) -> Iterator[Path]:
    """`model_dir`, or a tiny model directory built for the benchmark and removed after."""
    if model_dir is not None:
        yield model_dir
        return
    from kvplug.tools.tiny_model import build_tiny_model

    with tempfile.TemporaryDirectory(prefix="kvplug-bench-") as tmp:
        yield build_tiny_model(Path(tmp) / "tiny-llama", "llama")


def bench_vllm_step(
    sizes: list[int],
    policies: list[str],
    steps: int = 200,
    rounds: int = 10,
    workload: Workload | None = None,
    model_dir: Path | None = None,
    progress: Callable[[str], None] | None = None,
    told: Sequence[str] = (),
) -> list[ArmResult]:
    """`bench_size` at each of `sizes` (with a ``told:POLICY`` arm for each policy in
    `told`); builds a tiny model directory if none is given."""
    workload = workload or Workload()
    results: list[ArmResult] = []
    with tiny_model_dir(model_dir) as model_dir:
        for num_blocks in sizes:
            if progress is not None:
                names = [*policies, *(f"{TOLD}{name}" for name in told)]
                progress(
                    f"{num_blocks:,} blocks: stock, {', '.join(names)}: warming up, "
                    f"then {steps} timed steps each in {rounds} rounds"
                )
            results += bench_size(
                model_dir, num_blocks, policies, steps, rounds, workload, told=told
            )  # fmt: skip
            gc.collect()
    return results


def report(results: list[ArmResult], workload: Workload, steps: int, rounds: int) -> dict[str, Any]:
    """The JSON report: versions, settings and one row per arm and size."""
    return {
        "benchmark": "vllm-step",
        "vllm": vllm.__version__,
        "kvplug": kvplug.__version__,
        "python": platform.python_version(),
        "machine": platform.machine(),
        "steps": steps,
        "rounds": rounds,
        "workload": asdict(workload),
        "results": [asdict(r) for r in results],
    }


def format_table(results: list[ArmResult]) -> str:
    width = max([6, *(len(r.arm) for r in results)])
    header = (
        f"{'blocks':>8} {'arm':<{width}} {'p50 ms':>9} {'ratio':>6} {'rounds':>10} "
        f"{'p99 ms':>8} {'ratio':>6} "
        f"{'mean ms':>8} {'ratio':>6} {'cpu ms':>7} {'ratio':>6} {'gc ms':>6} {'gc %':>5} "
        f"{'add':>6} {'sched':>6} {'update':>6} {'tok/step':>8} {'hit %':>6} {'evicted':>8}"
    )
    lines = [header, "-" * len(header)]
    for r in results:
        hit = 100 * r.hit_tokens / r.prompt_tokens if r.prompt_tokens else 0.0
        span = f"{min(r.round_ratios):.2f}-{max(r.round_ratios):.2f}" if r.round_ratios else ""
        evictions = "-" if r.evictions is None else f"{r.evictions:,}"
        lines.append(
            f"{r.num_blocks:>8,} {r.arm:<{width}} {r.step_ms:>9.3f} {r.ratio:>5.2f}x {span:>10} "
            f"{r.p99_ms:>8.3f} {r.p99_ratio:>5.2f}x "
            f"{r.mean_ms:>8.3f} {r.mean_ratio:>5.2f}x {r.cpu_ms:>7.3f} {r.cpu_ratio:>5.2f}x "
            f"{r.gc_ms:>6.3f} {100 * r.gc_share:>5.1f} "
            f"{r.add_ms:>6.3f} {r.schedule_ms:>6.3f} {r.update_ms:>6.3f} "
            f"{r.scheduled_tokens / max(r.timed_steps, 1):>8.0f} {hit:>6.1f} {evictions:>8}"
        )
    return "\n".join(lines)


def decision_digest(
    model_dir: Path, num_blocks: int, policy: str, steps: int, workload: Workload
) -> str:
    """A digest of every decision one kvplug arm makes over its warm-up and `steps` more
    steps (untimed): each step's scheduled tokens and prefix hits per request, and the
    block ids and hashes every allocation is handed (its victims, in order). Two builds of
    the pool that decide alike give the same digest."""
    arm = Arm(policy, build_vllm_config(model_dir, workload, num_blocks), workload, num_blocks)
    digest = hashlib.sha256()
    queue = arm.pool.free_block_queue
    popleft_n = queue.popleft_n

    def recorded(num: int) -> list[Any]:
        # read as the queue hands the blocks out, before vLLM drops their hashes
        taken = popleft_n(num)
        for block in taken:
            digest.update(f"{block.block_id}:{block.block_hash!r};".encode())
        return taken

    queue.popleft_n = recorded  # type: ignore[method-assign]
    scheduler = arm.scheduler
    original = scheduler.schedule

    def schedule() -> Any:
        output = original()
        for data in output.scheduled_new_reqs:
            digest.update(f"n{data.req_id}:{data.num_computed_tokens};".encode())
        digest.update(repr(sorted(output.num_scheduled_tokens.items())).encode())
        return output

    scheduler.schedule = schedule  # type: ignore[method-assign]
    arm.warm_up(20_000, settle=steps)
    return digest.hexdigest()


def decision_digests(
    sizes: list[int], policies: list[str], steps: int, workload: Workload
) -> Iterator[tuple[int, str, str]]:
    """(blocks, policy, `decision_digest`) for each size and policy, on a tiny model."""
    with tiny_model_dir() as model_dir:
        for num_blocks in sizes:
            for policy in policies:
                yield (
                    num_blocks,
                    policy,
                    decision_digest(model_dir, num_blocks, policy, steps, workload),
                )
