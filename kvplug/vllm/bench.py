"""``kvplug bench vllm-step``: vLLM's scheduler step with kvplug's block pool against stock.

What is measured: the wall time of one engine-core scheduler step, on this machine's CPU,
for vLLM's own `Scheduler` (the *stock* arm) and for ``kvplug.vllm.Scheduler`` (one arm
per kvplug policy), at each KV cache size. A step is what the engine core runs around the
model forward pass:

- ``add_request`` for the requests that arrived since the last step (kvplug re-keys each
  request's blocks here, so that cost is counted);
- ``schedule()``;
- ``update_from_output()`` with the step's sampled tokens (finished requests free their
  blocks here, which is where kvplug ranks them).

The model is not run: the schedulers are real vLLM schedulers built as vLLM's unit tests
build them (a `VllmConfig` for a tiny model directory, a `KVCacheConfig` of ``num_blocks``
blocks with one full-attention group, a `StructuredOutputManager`), and the model runner's
output is fabricated: one sampled token per request whose prompt is fully computed, a token
that depends only on the request and its position, so every arm sees the same outputs.
Building the `Request` objects (vLLM hashes their blocks in the constructor, off the
engine-core thread in a real server) and fabricating outputs are not timed.

How: every arm gets the same seeded request stream (`RequestStream`): prompts are a shared
"system" prefix (few prefixes, Zipf-popular) or a previous request's prompt plus its output
(a follow-up turn), then a unique suffix; each request asks for a few output tokens. The
harness keeps ``concurrency`` requests in each scheduler (running plus waiting), so each arm
admits the stream in the same order. Each arm is warmed up until its pool is full (no
free block left without a cached hash, so each allocation evicts) and then some. The timed
steps are interleaved: ``rounds`` rounds, each running ``steps`` steps of every arm (the
order rotates from round to round), so machine noise hits all arms alike. Reported per arm:
the median step time over all timed steps, its median add/schedule/update parts, scheduled
and prefix-hit tokens, evictions (kvplug arms), and the ratio of its median to the stock
median, with the range of the per-round ratios.

With the ``lru`` policy kvplug evicts in vLLM's order, so the lru and stock arms do the same
work step for step (the same tokens are scheduled); other policies keep other blocks, so
their hits, and hence the tokens they compute, differ from stock's.
"""

from __future__ import annotations

import copy
import gc
import random
import statistics
import tempfile
import time
from collections import deque
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch
from vllm.config import CacheConfig, ModelConfig, SchedulerConfig, VllmConfig
from vllm.sampling_params import SamplingParams
from vllm.utils.hashing import get_hash_fn_by_name
from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash
from vllm.v1.core.sched.scheduler import Scheduler as StockScheduler
from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec
from vllm.v1.outputs import ModelRunnerOutput
from vllm.v1.request import Request
from vllm.v1.structured_output import StructuredOutputManager

import kvplug.vllm
from kvplug.vllm.pool import KVPlugBlockPool

STOCK = "stock"
TOKEN_BASE = 4  # token ids below this are the tiny model's special tokens
TOKEN_RANGE = 500  # the tiny model's vocabulary is 512


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
    arm: str
    num_blocks: int
    step_ms: float  # median over all timed steps
    add_ms: float  # medians of the step's parts
    schedule_ms: float
    update_ms: float
    ratio: float = 1.0  # step_ms / the stock arm's step_ms
    round_ratios: list[float] = field(default_factory=list)
    timed_steps: int = 0
    warmup_steps: int = 0
    scheduled_tokens: int = 0  # during the timed steps
    prompt_tokens: int = 0  # of requests first scheduled during the timed steps
    hit_tokens: int = 0  # of those, found in the prefix cache
    finished_requests: int = 0
    evictions: int | None = None  # kvplug arms only (stock vLLM does not count them)
    preemptions: int = 0
    pool: str = ""


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
        bs = workload.block_size
        self.prefixes = [self._tokens(self.rng.randint(*workload.prefix_blocks) * bs) for _ in
                         range(workload.num_prefixes)]  # fmt: skip
        self.weights = [1 / (rank + 1) for rank in range(workload.num_prefixes)]
        self.history: deque[_Planned] = deque(maxlen=workload.follow_up_window)
        self.count = 0

    def _tokens(self, n: int) -> list[int]:
        return [TOKEN_BASE + self.rng.randrange(TOKEN_RANGE) for _ in range(n)]

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
        model_config=model_config, cache_config=cache_config, scheduler_config=scheduler_config
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


class Arm:
    """One scheduler (stock, or kvplug with `policy`) and the requests it has been given."""

    def __init__(
        self, name: str, base_config: VllmConfig, workload: Workload, num_blocks: int
    ) -> None:
        self.name = name
        self.workload = workload
        config = copy.deepcopy(base_config)
        if name != STOCK:
            config.additional_config = {"kvplug": {"policy": name}}
        kwargs: dict[str, Any] = dict(
            vllm_config=config,
            kv_cache_config=kv_cache_config(workload, num_blocks),
            structured_output_manager=StructuredOutputManager(config),
            block_size=workload.block_size,
            hash_block_size=workload.block_size,
            log_stats=False,
        )
        self.scheduler = StockScheduler(**kwargs) if name == STOCK else kvplug.vllm.Scheduler(
            **kwargs
        )
        self.pool = self.scheduler.kv_cache_manager.block_pool
        hash_fn = get_hash_fn_by_name(config.cache_config.prefix_caching_hash_algo)
        init_none_hash(hash_fn)
        self.block_hasher = get_request_block_hasher(workload.block_size, hash_fn)
        self.stream = RequestStream(workload)
        self.numbers: dict[str, int] = {}  # request id -> its number in the stream
        self.steps = 0
        self.times: list[tuple[float, float, float]] = []  # (add, schedule, update) seconds
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
            self.numbers[request.request_id] = planned.number
            requests.append(request)
        return requests

    def step(self, timed: bool) -> None:
        scheduler = self.scheduler
        new = self._new_requests()
        t0 = time.perf_counter()
        for request in new:
            scheduler.add_request(request)
        t1 = time.perf_counter()
        output = scheduler.schedule()
        t2 = time.perf_counter()
        runner_output = self._fabricate(output)
        t3 = time.perf_counter()
        engine_outputs = scheduler.update_from_output(output, runner_output)
        t4 = time.perf_counter()
        self.steps += 1
        if not timed:
            return
        self.times.append((t1 - t0, t2 - t1, t4 - t3))
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
                number = self.numbers[req_id]
                sampled.append([output_token(number, request.num_output_tokens)])
        return ModelRunnerOutput(
            req_ids=req_ids,
            req_id_to_index={req_id: i for i, req_id in enumerate(req_ids)},
            sampled_token_ids=sampled,
        )

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


def bench_size(
    model_dir: Path,
    num_blocks: int,
    policies: list[str],
    steps: int,
    rounds: int,
    workload: Workload,
    max_warmup_steps: int = 20_000,
    arms_out: list[Arm] | None = None,
) -> list[ArmResult]:
    """Time the stock arm and one kvplug arm per policy at `num_blocks` blocks."""
    base_config = build_vllm_config(model_dir, workload, num_blocks)
    arms = [Arm(name, base_config, workload, num_blocks) for name in [STOCK, *policies]]
    for arm in arms:
        arm.warm_up(max_warmup_steps, settle=max(steps, 50))
    warmup = {arm.name: arm.steps for arm in arms}
    evictions_before = {arm.name: arm.evictions() for arm in arms}
    round_medians: dict[str, list[float]] = {arm.name: [] for arm in arms}
    for r in range(rounds):
        order = arms[r % len(arms) :] + arms[: r % len(arms)]
        for arm in order:
            gc.collect()
            start = len(arm.times)
            for _ in range(steps):
                arm.step(timed=True)
            round_medians[arm.name].append(_median_ms([sum(t) for t in arm.times[start:]]))
    results = []
    for arm in arms:
        evictions = arm.evictions()
        before = evictions_before[arm.name]
        results.append(
            ArmResult(
                arm=arm.name,
                num_blocks=num_blocks,
                step_ms=_median_ms([sum(t) for t in arm.times]),
                add_ms=_median_ms([t[0] for t in arm.times]),
                schedule_ms=_median_ms([t[1] for t in arm.times]),
                update_ms=_median_ms([t[2] for t in arm.times]),
                timed_steps=len(arm.times),
                warmup_steps=warmup[arm.name],
                scheduled_tokens=arm.scheduled_tokens,
                prompt_tokens=arm.prompt_tokens,
                hit_tokens=arm.hit_tokens,
                finished_requests=arm.finished,
                evictions=None if evictions is None or before is None else evictions - before,
                preemptions=arm.preemptions,
                pool=type(arm.pool).__name__,
            )
        )
    stock = results[0]
    for result in results:
        result.ratio = result.step_ms / stock.step_ms
        result.round_ratios = [
            mine / theirs
            for mine, theirs in zip(round_medians[result.arm], round_medians[STOCK], strict=True)
        ]
    if arms_out is not None:
        arms_out.extend(arms)
    return results


def bench_vllm_step(
    sizes: list[int],
    policies: list[str],
    steps: int = 100,
    rounds: int = 5,
    workload: Workload | None = None,
    model_dir: Path | None = None,
) -> list[ArmResult]:
    """`bench_size` at each of `sizes`; builds a tiny model directory if none is given."""
    workload = workload or Workload()
    results: list[ArmResult] = []
    with tempfile.TemporaryDirectory(prefix="kvplug-bench-") as tmp:
        if model_dir is None:
            from kvplug.tiny_model import build_tiny_model

            model_dir = build_tiny_model(Path(tmp) / "tiny-llama", "llama")
        for num_blocks in sizes:
            results += bench_size(model_dir, num_blocks, policies, steps, rounds, workload)
            gc.collect()
    return results


def format_table(results: list[ArmResult]) -> str:
    header = (
        f"{'blocks':>8} {'arm':<6} {'ms/step':>8} {'add':>6} {'sched':>6} {'update':>6} "
        f"{'vs stock':>8} {'rounds':>11} {'tok/step':>8} {'hit %':>6} {'evictions':>9}"
    )
    lines = [header, "-" * len(header)]
    for r in results:
        hit = 100 * r.hit_tokens / r.prompt_tokens if r.prompt_tokens else 0.0
        span = f"{min(r.round_ratios):.2f}-{max(r.round_ratios):.2f}" if r.round_ratios else ""
        evictions = "-" if r.evictions is None else f"{r.evictions:,}"
        lines.append(
            f"{r.num_blocks:>8,} {r.arm:<6} {r.step_ms:>8.3f} {r.add_ms:>6.3f} "
            f"{r.schedule_ms:>6.3f} {r.update_ms:>6.3f} {r.ratio:>7.2f}x {span:>11} "
            f"{r.scheduled_tokens / max(r.timed_steps, 1):>8.0f} {hit:>6.1f} {evictions:>9}"
        )
    return "\n".join(lines)


def results_as_dicts(results: list[ArmResult]) -> list[dict[str, Any]]:
    return [asdict(r) for r in results]
