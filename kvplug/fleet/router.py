"""Routers: which engine of the fleet serves the next request.

A router sees only what a real router in front of a fleet sees: the engines' published
KV events (through `PrefixView`) and each engine's load (requests running or waiting, as
llm-d's queue scorer reads it from the engines' metrics). It never looks inside a cache.

| name | picks |
|---|---|
| `round-robin` | the engines in turn |
| `least-loaded` | the engine with the fewest requests in flight (ties in turn) |
| `cache-aware` | the best ``prefix share - load_penalty * relative load`` |
| `approx-tree` | where it routed the longest prefix (over a threshold), else its least used |

`cache-aware` is llm-d's prefix-cache scorer plus its queue scorer: the share of the
prompt's reusable blocks the engine is believed to hold, minus a penalty for being busier
than the least busy engine (0 for the least busy, `load_penalty` for the busiest).

`approx-tree` is the ``cache_aware`` policy of ``vllm-router`` and ``sglang-router``, the
routers a fleet A/B runs (`kvplug.serving.routers`), at their defaults. It reads no KV
event: it remembers the prompts it routed, per engine, and never forgets one (their
trees hold 32M characters per worker). A prompt whose longest routed prefix on some
engine covers more than `APPROX_THRESHOLD` of it goes to that engine; any other goes to
the engine it has routed the fewest blocks to. Only when the loads are out of balance
(the busiest has more than `BALANCE_ABS` requests over the least busy and more than
`BALANCE_REL` times its load) does it send to the least busy instead. The real routers
match characters of the prompt text; this one matches the prompt's blocks.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Sequence

from kvplug.core.keys import BlockKey
from kvplug.errors import ConfigError, UnknownRouterError
from kvplug.fleet.view import PrefixView

DEFAULT_LOAD_PENALTY = 1.0


class Router(ABC):
    """Chooses an engine in ``range(num_engines)`` for each request."""

    name: str

    def __init__(self, num_engines: int) -> None:
        check_engine_count(num_engines)
        self.num_engines = num_engines
        self._turn = 0  # the next engine in turn, for round-robin and tie-breaking

    @abstractmethod
    def choose(self, keys: Sequence[BlockKey], loads: Sequence[int], view: PrefixView) -> int:
        """The engine for a prompt whose reusable blocks have `keys`, given each engine's
        load now and the router's (possibly stale) view of what each engine holds."""

    def _in_turn(self, candidates: Sequence[int]) -> int:
        """The first of `candidates` at or after the engine whose turn it is."""
        chosen = min(candidates, key=lambda e: (e - self._turn) % self.num_engines)
        self._turn = (chosen + 1) % self.num_engines
        return chosen


class RoundRobin(Router):
    name = "round-robin"

    def choose(self, keys: Sequence[BlockKey], loads: Sequence[int], view: PrefixView) -> int:
        return self._in_turn(range(self.num_engines))


class LeastLoaded(Router):
    name = "least-loaded"

    def choose(self, keys: Sequence[BlockKey], loads: Sequence[int], view: PrefixView) -> int:
        least = min(loads)
        return self._in_turn([e for e, load in enumerate(loads) if load == least])


class CacheAware(Router):
    """Prefix affinity with a load penalty. Scores lie in ``[-load_penalty, 1]``; a penalty
    of 0 is pure affinity, a large one is least-loaded with affinity breaking ties."""

    name = "cache-aware"

    def __init__(self, num_engines: int, load_penalty: float = DEFAULT_LOAD_PENALTY) -> None:
        super().__init__(num_engines)
        if load_penalty < 0:
            raise ConfigError(f"load penalty must be >= 0, got {load_penalty}")
        self.load_penalty = load_penalty

    def choose(self, keys: Sequence[BlockKey], loads: Sequence[int], view: PrefixView) -> int:
        least, spread = min(loads), max(loads) - min(loads)
        scores = []
        for engine, load in enumerate(loads):
            share = view.prefix_blocks(engine, keys) / len(keys) if keys else 0.0
            busier = (load - least) / spread if spread else 0.0
            scores.append(share - self.load_penalty * busier)
        best = max(scores)
        return self._in_turn([e for e, score in enumerate(scores) if score == best])


# vllm-router's and sglang-router's defaults: --cache-threshold, --balance-abs-threshold,
# --balance-rel-threshold
APPROX_THRESHOLD = 0.3
BALANCE_ABS = 64
BALANCE_REL = 1.5


class ApproxTree(Router):
    """The routers' own ``cache_aware`` (module docstring): affinity to what it routed."""

    name = "approx-tree"

    def __init__(self, num_engines: int) -> None:
        super().__init__(num_engines)
        self.routed = PrefixView(num_engines)  # what it sent each engine, never forgotten

    def choose(self, keys: Sequence[BlockKey], loads: Sequence[int], view: PrefixView) -> int:
        least, most = min(loads), max(loads)
        routed = self.routed
        if most - least > BALANCE_ABS and most > least * BALANCE_REL:
            chosen = self._in_turn([e for e, load in enumerate(loads) if load == least])
        else:
            matched = [routed.prefix_blocks(engine, keys) for engine in range(self.num_engines)]
            best = max(matched)
            if keys and best / len(keys) > APPROX_THRESHOLD:
                chosen = self._in_turn([e for e, m in enumerate(matched) if m == best])
            else:
                smallest = min(len(sent) for sent in routed.keys)
                chosen = self._in_turn(
                    [e for e, sent in enumerate(routed.keys) if len(sent) == smallest]
                )
        routed.keys[chosen].update(keys)
        return chosen


ROUTERS: dict[str, type[Router]] = {
    r.name: r for r in (RoundRobin, LeastLoaded, CacheAware, ApproxTree)
}


def check_engine_count(num_engines: int) -> None:
    if not isinstance(num_engines, int) or isinstance(num_engines, bool) or num_engines < 1:
        raise ConfigError(f"the number of engines must be an integer >= 1, got {num_engines!r}")


def check_router_names(names: Sequence[str]) -> None:
    """Raise, naming what is accepted, if any router name is unknown."""
    for name in names:
        if name not in ROUTERS:
            raise UnknownRouterError(f"unknown router {name!r}; accepted: {', '.join(ROUTERS)}")


def make_router(name: str, num_engines: int, load_penalty: float = DEFAULT_LOAD_PENALTY) -> Router:
    check_router_names([name])
    if name == CacheAware.name:
        return CacheAware(num_engines, load_penalty)
    return ROUTERS[name](num_engines)
