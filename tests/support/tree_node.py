"""A cached block as `kvplug.core.eviction.EvictionCore` and the policies read it, for
tests that drive the core directly."""

from __future__ import annotations


class Node:
    def __init__(self, serial: int, key: bytes | None = None, depth: int = 0) -> None:
        self.serial = serial
        self.key = serial.to_bytes(4, "little") if key is None else key
        self.depth = depth
        self.hits = 0
        self.from_end = 0
        self.request_hit = False
        self.request_output = 0
        self.request_session = False
        self.held_elsewhere = False
        self.parent: Node | None = None
        self.parent_serial = -1
        self.cached_children = 0
        self.evictable = False
