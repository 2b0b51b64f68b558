"""Arms: the caches a replay compares, behind one small interface.

The replay speaks in *units*: one unit is one trace block (512 tokens for Mooncake), and a
cache block holds exactly one unit. A prompt is a list of unit ids: the trace's hash ids
for its full blocks, then fresh ids for a partial last block and for decode growth (these
never match anything). Every arm gets the same calls in the same order; an arm decides
only what it keeps.

`KVPlugArm` runs kvplug's `KVCache` with any registered policy. The stock arms
(`kvplug.replay.arms.vllm`, `kvplug.replay.arms.sglang`) drive the engines' own classes.
"""

from __future__ import annotations

import importlib
from abc import ABC, abstractmethod
from collections.abc import Iterable
from dataclasses import dataclass

from kvplug.core.cache import KVCache
from kvplug.core.events import EventSink
from kvplug.core.index import Node
from kvplug.core.queue_protection import QueueProtection
from kvplug.policies import EvictionPolicy

# unit ids at or above this are never shared; below 2**31, as vLLM 0.34 keeps token ids in
# int32 buffers (a trace's own ids must stay below it)
FRESH_UNIT_BASE = 1 << 30


@dataclass
class ArmStats:
    evictions: int = 0
    churn: int = 0  # blocks inserted into the cache, then evicted without a single hit
    cached_blocks: int = 0  # blocks held by the cache (reusable) right now


class ArmUnavailable(Exception):
    """The arm's engine is not installed (or not a supported version) here."""


def require_engine(
    module: str, name: str, version: str | tuple[str, ...], arm: str, install: str
) -> None:
    """Raise `ArmUnavailable` unless `module` imports and is exactly `version` (one of
    them, given several)."""
    versions = (version,) if isinstance(version, str) else version
    version = " or ".join(versions)
    try:
        engine = importlib.import_module(module)
    except Exception as exc:  # any import failure means the engine cannot run here
        raise ArmUnavailable(
            f"the {arm} arm needs {name} {version}, which is not importable here ({exc}); "
            f"install it with {install}"
        ) from exc
    found = getattr(engine, "__version__", "unknown")
    if found not in versions:
        raise ArmUnavailable(
            f"the {arm} arm supports {name} {version} only, but {name} {found} is installed; "
            "its cache code may differ"
        )


class CacheArm(ABC):
    """One cache under test, with `capacity_blocks` blocks of one unit each."""

    name: str
    # beside another tier: units of the last admitted request loaded from it (after the
    # units `admit` returned), and what each reload costs, in prefill FLOPs
    loaded: int = 0
    reload_flops: float = 0.0

    @abstractmethod
    def admit(self, req_id: int, prompt: list[int], compute: int) -> int | None:
        """Start a request: look up `prompt`, then allocate blocks for its first `compute`
        units (those not served from the cache).

        Returns the number of leading prompt units served from the cache, or None, having
        changed nothing, if the blocks cannot be had now. The engines never serve the
        whole prompt (the last token is always computed); the sequential replay passes a
        prompt with one extra sentinel unit and ``compute = len(prompt) - 1``, so a fully
        cached prompt counts as a full hit.
        """

    @abstractmethod
    def grow(self, req_id: int, units: list[int]) -> bool:
        """Append decode units; False, having changed nothing, if there is no room."""

    @abstractmethod
    def finish(self, req_id: int, output_tokens: int = 0) -> None:
        """End the request, which generated `output_tokens`; its blocks go back to the
        cache."""

    @abstractmethod
    def stats(self) -> ArmStats: ...

    def advance(self, now: float) -> None:
        """The replay's clock reads `now` (seconds): retention times are on it."""

    def protect_waiting(self, waiting: Iterable[tuple[int, list[int]]]) -> None:
        """The replay's waiting requests as (request id, prompt), the next to start first
        (read lazily, before each replay event): an arm with queue protection protects
        what the first of them would hit (`kvplug.core.queue_protection`). The engines'
        stock caches read no queue."""

    def name_session(self, req_id: int) -> None:
        """The request just admitted names a session (`kvplug.core.sessions`): an arm whose
        policy reads sessions tells its cache, as the engine's scheduler would. The
        engines' own caches read none."""

    def retain(self, req_id: int, seconds: float) -> bool:
        """The running request asks that its prompt's cached prefix be kept for `seconds`
        after it ends (called just before `finish`); whether anything is kept. The
        engines' own caches cannot: they keep nothing."""
        return False


class KVPlugArm(CacheArm):
    """kvplug's own cache with one of its policies."""

    def __init__(
        self,
        name: str,
        policy: EvictionPolicy,
        capacity_blocks: int,
        event_sink: EventSink | None = None,
        queue_depth: int = 0,
    ) -> None:
        """`queue_depth`: how many waiting requests' hits are protected (0: none)."""
        self.name = name
        self.now = 0.0
        self.cache = KVCache(
            capacity_blocks, 1, policy=policy, event_sink=event_sink, clock=lambda: self.now
        )
        self.queue_protection: QueueProtection[Node] | None = (
            QueueProtection(queue_depth, self.cache) if queue_depth else None
        )
        self.sessions: set[int] = set()  # running requests that named a session

    def protect_waiting(self, waiting: Iterable[tuple[int, list[int]]]) -> None:
        if self.queue_protection is not None:
            match = self.cache.match
            self.queue_protection.refresh(match(prompt) for _, prompt in waiting)

    def advance(self, now: float) -> None:
        self.now = now

    def retain(self, req_id: int, seconds: float) -> bool:
        return self.cache.retain(req_id, seconds) is not None

    def admit(self, req_id: int, prompt: list[int], compute: int) -> int | None:
        cache = self.cache
        nodes = cache.match(prompt)
        if not cache.make_room(cache.admission_blocks(nodes, compute)):
            return None
        if cache.admission_blocks(nodes, compute) > cache.num_reclaimable:
            return None
        cached = cache.add_request(req_id, prompt)
        assert cached == len(nodes)
        cache.append(req_id, prompt[cached:compute])
        cache.complete_step()
        return cached

    def grow(self, req_id: int, units: list[int]) -> bool:
        if not self.cache.make_room(self.cache.blocks_needed(req_id, len(units))):
            return False
        self.cache.append(req_id, units)
        self.cache.complete_step()
        return True

    def name_session(self, req_id: int) -> None:
        self.sessions.add(req_id)

    def finish(self, req_id: int, output_tokens: int = 0) -> None:
        session = req_id in self.sessions
        if session:
            self.sessions.discard(req_id)
        self.cache.finish(req_id, output_tokens=output_tokens, session=session)

    def stats(self) -> ArmStats:
        metrics = self.cache.metrics
        return ArmStats(metrics.evictions, metrics.churn, len(self.cache.index))
