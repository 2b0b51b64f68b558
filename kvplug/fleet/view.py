"""The router's view of the fleet: which block keys each engine holds, learnt only from the
KV events the engines publish, delivered after a configurable lag.

This is what llm-d's prefix-cache scorer and Dynamo's KV router keep: an index fed by
``BlockStored`` / ``BlockRemoved`` events, plus a key scheme configured like the engines'
(hash algorithm, namespace, block size) so the router computes a prompt's block keys the
way the engines do, without asking them.

Invariant: once every event published up to time ``t`` has been delivered, the keys held
for engine ``e`` are exactly the keys in engine ``e``'s prefix index at ``t`` (events are
applied in publication order, and each engine's index publishes every change).
"""

from __future__ import annotations

from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass

from kvplug.core.events import BlockRemoved, BlockStored, KVEvent
from kvplug.core.keys import DEFAULT_HASH, BlockHasher, BlockKey, Namespace
from kvplug.errors import ConfigError


@dataclass(frozen=True)
class KeyScheme:
    """How the engines key blocks: the hasher and the root key of their namespace."""

    hasher: BlockHasher
    root_key: BlockKey

    @classmethod
    def for_engines(
        cls, block_size: int, namespace: Namespace | None = None, hash_algo: str = DEFAULT_HASH
    ) -> KeyScheme:
        """The scheme of engines that key blocks of `block_size` tokens under `namespace`."""
        hasher = BlockHasher(hash_algo)
        ns = (namespace or Namespace()).with_block_size(block_size)
        return cls(hasher, hasher.root_key(ns))

    def prompt_keys(self, prompt: Sequence[int], block_size: int = 1) -> list[BlockKey]:
        """The chained keys of the prompt's full blocks, first block first."""
        keys, key = [], self.root_key
        for start in range(0, len(prompt) - block_size + 1, block_size):
            key = self.hasher.block_key(key, prompt[start : start + block_size])
            keys.append(key)
        return keys


class EventFeed:
    """Events in flight from the engines to the router: each is delivered `lag_s` seconds
    (simulated time) after it was published, in publication order."""

    def __init__(self, view: PrefixView, lag_s: float = 0.0) -> None:
        if lag_s < 0:
            raise ConfigError(f"event lag must be >= 0 seconds, got {lag_s}")
        self.view = view
        self.lag_s = lag_s
        self.now = 0.0  # the simulated time events are stamped with; never decreases
        self._in_flight: deque[tuple[float, int, KVEvent]] = deque()

    def publish(self, engine: int, event: KVEvent) -> None:
        self._in_flight.append((self.now + self.lag_s, engine, event))

    def deliver(self, until: float) -> None:
        """Apply every event due at or before `until`."""
        while self._in_flight and self._in_flight[0][0] <= until:
            _, engine, event = self._in_flight.popleft()
            self.view.apply(engine, event)

    @property
    def in_flight(self) -> int:
        """Events published but not yet delivered."""
        return len(self._in_flight)


class PrefixView:
    """Per engine, the set of block keys the router believes it holds."""

    def __init__(self, num_engines: int) -> None:
        self.keys: list[set[BlockKey]] = [set() for _ in range(num_engines)]

    def apply(self, engine: int, event: KVEvent) -> None:
        if isinstance(event, BlockStored):
            self.keys[engine].add(event.key)
        elif isinstance(event, BlockRemoved):
            self.keys[engine].discard(event.key)

    def prefix_blocks(self, engine: int, keys: Sequence[BlockKey]) -> int:
        """How many leading `keys` the engine is believed to hold."""
        held = self.keys[engine]
        for count, key in enumerate(keys):
            if key not in held:
                return count
        return len(keys)
