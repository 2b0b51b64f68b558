"""Run a trace through several arms at several capacities and collect one row per pair.

Arm names: any registered kvplug policy (``lru``, ``cost``, ``belady``, ``rate-oracle``, ...),
``vllm-stock``
(vLLM's own KVCacheManager), ``vllm-kvplug:<policy>`` (that same manager with kvplug's
block pool, as ``--scheduler-cls kvplug.vllm.Scheduler`` builds it; any online policy) and
``sglang-stock:<policy>`` (SGLang's own radix cache with its eviction policy ``<policy>``)
and ``sglang-kvplug:<policy>`` (that same cache with kvplug's policy, as
``--radix-cache-backend kvplug`` builds it; any online policy).
An arm whose engine is not installed is reported as unavailable, never replaced by
something else.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Callable, Mapping
from dataclasses import asdict, dataclass
from typing import Any

from kvplug.core.model_spec import ModelSpec
from kvplug.core.queue_protection import MAX_DEPTH
from kvplug.errors import ConfigError, KVPlugError
from kvplug.policies import (
    EvictionPolicy,
    PolicyContext,
    make_policy,
    online_policies,
    policy_parameters,
)
from kvplug.policies.cost import CostPolicy
from kvplug.policies.reload import HostLink
from kvplug.replay.arm_spec import Cache, parse_arm, parse_arms
from kvplug.replay.arms.base import ArmUnavailable, CacheArm, KVPlugArm
from kvplug.replay.loop import Job, Timing, make_jobs, replay
from kvplug.replay.trace import Trace


@dataclass
class ReplayRow:
    policy: str
    capacity_blocks: int
    available: bool = True
    note: str = ""
    requests: int = 0
    hit_ratio: float = 0.0  # prompt tokens served from cache / prompt tokens
    saved_compute_ratio: float = 0.0  # prefill FLOPs saved / prefill FLOPs of all prompts
    saved_flops: float = 0.0
    bytes_held: float = 0.0  # mean bytes of reusable cached KV, sampled at each admission
    evictions: int = 0
    churn: int = 0  # blocks evicted without ever being reused
    preemptions: int = 0
    waited: int = 0
    rejected: int = 0
    seconds: float = 0.0
    explain: dict | None = None  # the policy's learned state, for policies with `explain()`

    def as_dict(self) -> dict:
        return asdict(self)


def check_arm_names(names: list[str]) -> None:
    """Raise, naming what is accepted, if any arm name is unknown."""
    parse_arms(names)


def engine_of(arm: str) -> str | None:
    """The engine an arm runs inside (``vllm``, ``sglang``), or None for kvplug's own cache."""
    return parse_arm(arm).engine


def missing_engines(arms: list[str]) -> dict[str, str]:
    """Each arm whose engine cannot run in this environment -> why (one reason per engine)."""
    from kvplug.replay.arms.sglang import check_sglang
    from kvplug.replay.arms.vllm import check_vllm

    checks = {"vllm": check_vllm, "sglang": lambda: check_sglang("sglang")}
    reasons: dict[str, str | None] = {}
    missing = {}
    for arm in arms:
        engine = engine_of(arm)
        if engine is None:
            continue
        if engine not in reasons:
            try:
                checks[engine]()
                reasons[engine] = None
            except ArmUnavailable as exc:
                reasons[engine] = str(exc)
        if reasons[engine] is not None:
            missing[arm] = reasons[engine]
    return missing


def arm_policy(
    name: str, block_tokens: int, config: Mapping[str, Any] | None = None
) -> EvictionPolicy:
    """A fresh instance of the kvplug policy `name`, its cost model told `block_tokens` tokens
    per unit (a trace block, though each replay cache block holds one unit), with the
    entries of `config` its constructor takes."""
    context = PolicyContext(tokens_per_block=block_tokens)
    return make_policy(name, policy_params(name, config), context)


def policy_params(policy: str, config: Mapping[str, Any] | None = None) -> dict[str, Any]:
    """The entries of `config` that `policy`'s constructor takes."""
    accepts = accepted_parameters(policy)
    return {key: value for key, value in (config or {}).items() if key in accepts}


def accepted_parameters(policy: str) -> set[str]:
    """The parameters policy `policy` takes from a policy config (not `tokens_per_block`,
    which the replay fills in)."""
    return set(policy_parameters(policy) or ()) - {"tokens_per_block"}


def check_policy_config(arms: list[str], config: Mapping[str, Any]) -> None:
    """Raise, naming what the arms accept, if a key of `config` is taken by no arm's policy."""
    accepted: set[str] = set()
    for spec in parse_arms(arms):
        if spec.kvplug_policy is not None:
            accepted |= accepted_parameters(spec.kvplug_policy)
    for key in config:
        if key not in accepted:
            raise ConfigError(
                f"policy config key {key!r} is taken by none of the arms {', '.join(arms)}; "
                f"accepted: {', '.join(sorted(accepted)) or 'none'}"
            )


def build_arm(
    name: str,
    capacity: int,
    jobs: list[Job],
    sequential: bool,
    block_tokens: int,
    config: Mapping[str, Any] | None = None,
    host_blocks: int = 0,
    reload_flops: float = 0.0,
    queue_depth: int = 0,
) -> CacheArm:
    """Raises `ArmUnavailable` for a stock arm whose engine is missing. With `host_blocks`,
    the vLLM arms run beside a lazily filled CPU tier of that many blocks, each reload
    costing `reload_flops` (`kvplug.replay.arms.vllm_offload`); other arms are refused.
    With `queue_depth`, the arms that can (`protects_queue`) protect that many waiting
    requests' hits (`kvplug.core.queue_protection`)."""
    if not protects_queue(name):
        queue_depth = 0
    spec = parse_arm(name)
    if host_blocks and spec.cache not in (Cache.VLLM_STOCK, Cache.VLLM_KVPLUG):
        raise ConfigError(
            f"a CPU tier (--host-blocks) runs beside vLLM arms only (vllm-stock, "
            f"vllm-kvplug:<policy>), not {name!r}"
        )
    if spec.cache is Cache.VLLM_STOCK or spec.cache is Cache.VLLM_KVPLUG:
        from kvplug.replay.arms.vllm import VLLMStockArm
        from kvplug.replay.arms.vllm_offload import VLLMOffloadArm

        policy = None
        if spec.kvplug_policy is not None:
            policy = arm_policy(spec.kvplug_policy, block_tokens, config)
        if host_blocks:
            return VLLMOffloadArm(capacity, host_blocks, reload_flops, policy=policy)
        return VLLMStockArm(capacity, policy=policy, queue_depth=queue_depth)
    if spec.cache is Cache.SGLANG_KVPLUG:
        from kvplug.replay.arms.sglang_kvplug import SGLangKVPlugArm

        params = policy_params(spec.policy, config)
        if "tokens_per_block" in (policy_parameters(spec.policy) or ()):
            params["tokens_per_block"] = block_tokens
        return SGLangKVPlugArm(capacity, spec.policy, policy_config=params)
    if spec.cache is Cache.SGLANG_STOCK:
        from kvplug.replay.arms.sglang import SGLangStockArm

        return SGLangStockArm(capacity, policy=spec.policy)
    arm = KVPlugArm(name, arm_policy(name, block_tokens, config), capacity, queue_depth=queue_depth)
    if arm.cache.policy.offline:
        arm.cache.policy.foresee(requests_reaching(jobs, arm, sequential))
    return arm


def check_queue_depth(depth: int, sequential: bool) -> None:
    """Raise `KVPlugError` unless `depth` waiting requests can be read: 0 to `MAX_DEPTH`,
    and only in the realistic mode (nothing waits in the sequential one)."""
    if not 0 <= depth <= MAX_DEPTH:
        raise KVPlugError(f"queue protection depth must be in 0..{MAX_DEPTH}, got {depth}")
    if depth and sequential:
        raise KVPlugError(
            "queue protection reads the waiting queue of the realistic replay; in the "
            "sequential replay no request waits (drop --sequential or the protection)"
        )


def protects_queue(name: str) -> bool:
    """Whether arm `name` reads the replay's waiting queue when asked to (`queue_depth`): a
    kvplug policy that learns online and that kvplug ranks itself, in kvplug's own cache
    or in vLLM's (vLLM's stock cache, SGLang's, lru inside vLLM and the offline policies
    read none)."""
    spec = parse_arm(name)
    policy = spec.kvplug_policy
    if policy is None or policy not in online_policies():
        return False
    if spec.cache is Cache.VLLM_KVPLUG:
        return not make_policy(policy).release_order
    return spec.cache is Cache.KVPLUG


def reads_sessions(name: str) -> bool:
    """Whether arm `name` ranks by what requests that name a session release
    (`kvplug.core.sessions`): a `cost`-family policy, in kvplug's cache or an engine's."""
    spec = parse_arm(name)
    policy = spec.kvplug_policy
    if policy is None or policy not in online_policies():
        return False
    return isinstance(make_policy(policy), CostPolicy)


def row_name(name: str, queue_depth: int, sessions: bool) -> str:
    """Arm `name`'s row: ``+queue<depth>`` where it protects the queue, ``+sessions``
    where it reads sessions."""
    if queue_depth and protects_queue(name):
        name += f"+queue{queue_depth}"
    if sessions and reads_sessions(name.split("+queue")[0]):
        name += "+sessions"
    return name


def requests_reaching(jobs: list[Job], arm: KVPlugArm, sequential: bool) -> dict[bytes, list[int]]:
    """Each block key of `arm`'s cache -> the indices of the requests whose lookup can
    reach it, in order: the future that the offline policies read."""
    cache = arm.cache
    root = cache.hasher.root_key(cache.resolve_namespace())
    uses: dict[bytes, list[int]] = defaultdict(list)
    for job in jobs:
        reachable = len(job.prompt) if sequential else len(job.prompt) - 1
        key = root
        for unit in job.prompt[:reachable]:
            key = cache.hasher.block_key(key, (unit,))
            uses[key].append(job.index)
    return uses


def run_replay(
    trace: Trace,
    arms: list[str],
    capacities: list[int],
    model: ModelSpec,
    *,
    sequential: bool = False,
    timing: Timing | None = None,
    progress: Callable[[str], None] | None = None,
    policy_config: Mapping[str, Any] | None = None,
    host_blocks: int = 0,
    queue_depth: int = 0,
    sessions: bool = False,
) -> list[ReplayRow]:
    """One row per capacity x arm. `policy_config`: parameters for every arm whose policy
    takes them (`check_policy_config`). `host_blocks`: a CPU tier beside each (vLLM) arm,
    its reloads priced by `HostLink` at `policy_config`'s link parameters. `queue_depth`:
    the arms that can (`protects_queue`) protect that many waiting requests' hits, and
    their rows are named ``<arm>+queue<depth>``. With `sessions`, requests with a session
    id name it (`kvplug.core.sessions`), and the rows of the arms whose policy reads it
    (`reads_sessions`) end in ``+sessions``."""
    check_arm_names(arms)
    check_policy_config(arms, policy_config or {})
    if host_blocks < 0:
        raise KVPlugError(f"host_blocks must be >= 0, got {host_blocks}")
    check_queue_depth(queue_depth, sequential)
    link = HostLink(
        (policy_config or {}).get("host_link_gbps", HostLink.gbps),
        (policy_config or {}).get("prefill_tflops", HostLink.prefill_tflops),
    )
    reload_flops = link.reload_flops(model, trace.block_tokens)
    if not capacities or min(capacities) < 1:
        raise KVPlugError(f"capacities must be positive block counts, got {capacities}")
    jobs = make_jobs(trace, model, sessions)
    bytes_per_block = trace.block_tokens * model.kv_bytes_per_token()
    rows = []
    for capacity in capacities:
        for name in arms:
            try:
                arm = build_arm(
                    name, capacity, jobs, sequential, trace.block_tokens, policy_config,
                    host_blocks=host_blocks, reload_flops=reload_flops, queue_depth=queue_depth,
                )  # fmt: skip
            except ArmUnavailable as exc:
                rows.append(ReplayRow(name, capacity, available=False, note=str(exc)))
                continue
            clock = replay_clock(arm)
            c = replay(
                arm, jobs, trace.block_tokens, sequential=sequential, timing=timing, on_admit=clock
            )
            stats = arm.stats()
            row = ReplayRow(
                policy=row_name(name, queue_depth, sessions),
                capacity_blocks=capacity,
                requests=c.requests,
                hit_ratio=c.hit_tokens / c.prompt_tokens if c.prompt_tokens else 0.0,
                saved_compute_ratio=c.saved_flops / c.total_flops if c.total_flops else 0.0,
                saved_flops=c.saved_flops,
                bytes_held=c.cached_blocks_sum / max(c.cached_block_samples, 1) * bytes_per_block,
                evictions=stats.evictions,
                churn=stats.churn,
                preemptions=c.preemptions,
                waited=c.waited,
                rejected=c.rejected,
                seconds=c.seconds,
                explain=_explain(arm),
            )
            rows.append(row)
            if progress:
                progress(f"{name} @ {capacity} blocks: {row.seconds:.1f} s")
    return rows


def _explain(arm: CacheArm) -> dict | None:
    explain = getattr(getattr(getattr(arm, "cache", None), "policy", None), "explain", None)
    return explain() if callable(explain) else None


def replay_clock(arm: CacheArm) -> Callable[[Job], None] | None:
    """The `on_admit` hook that advances an offline policy's clock, or None."""
    policy = getattr(getattr(arm, "cache", None), "policy", None)
    if policy is not None and policy.offline:

        def tick(job: Job) -> None:
            policy.now = job.index

        return tick
    return None
