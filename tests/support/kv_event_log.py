"""A subscriber to vLLM's KV events over ZMQ, and the block set the events describe."""

from __future__ import annotations

import time
from collections import Counter
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import msgspec
import zmq
from vllm.distributed.kv_events import AllBlocksCleared, BlockRemoved, BlockStored, KVEventBatch

TOPIC = "kv"
HashKey = tuple[str | None, int | None, Any]  # (medium, group, external block hash)


@dataclass
class EventLog:
    """Decoded event batches in arrival order, with their sequence numbers."""

    socket: zmq.Socket
    decoder: msgspec.msgpack.Decoder = field(
        default_factory=lambda: msgspec.msgpack.Decoder(KVEventBatch)
    )
    batches: list[tuple[int, KVEventBatch]] = field(default_factory=list)

    def drain(self, quiet_s: float) -> int:
        """Receive until nothing arrives for `quiet_s`; returns how many batches came."""
        received = 0
        while self.socket.poll(int(quiet_s * 1000)):
            topic, seq, payload = self.socket.recv_multipart()
            assert topic == TOPIC.encode()
            self.batches.append((int.from_bytes(seq, "big"), self.decoder.decode(payload)))
            received += 1
        return received

    def settle(self, quiet_s: float = 1.0, timeout_s: float = 30.0) -> None:
        """Drain until the publisher thread has sent everything (the count stops changing)."""
        deadline = time.monotonic() + timeout_s
        while self.drain(quiet_s) and time.monotonic() < deadline:
            pass

    def events(self) -> list[Any]:
        return [event for _, batch in self.batches for event in batch.events]


@contextmanager
def subscriber(port: int) -> Iterator[EventLog]:
    """A SUB socket on the publisher's port, subscribed to `TOPIC`."""
    context = zmq.Context()
    socket = context.socket(zmq.SUB)
    socket.setsockopt(zmq.SUBSCRIBE, TOPIC.encode())
    socket.setsockopt(zmq.LINGER, 0)
    socket.connect(f"tcp://127.0.0.1:{port}")
    try:
        yield EventLog(socket)
    finally:
        socket.close()
        context.term()


def replay(events: list[Any]) -> Counter[HashKey]:
    """Stored minus removed hashes since the last AllBlocksCleared (no negative counts)."""
    held: Counter[HashKey] = Counter()
    for event in events:
        if isinstance(event, AllBlocksCleared):
            held.clear()
        elif isinstance(event, BlockStored | BlockRemoved):
            sign = 1 if isinstance(event, BlockStored) else -1
            for block_hash in event.block_hashes:
                key = (event.medium, event.group_idx, block_hash)
                held[key] += sign
                assert held[key] >= 0, f"{key} removed more often than stored"
    return +held


def since_last_clear(events: list[Any]) -> list[Any]:
    clears = [i for i, event in enumerate(events) if isinstance(event, AllBlocksCleared)]
    assert clears, "the prefix-cache reset was not published"
    return events[clears[-1] + 1 :]
