"""Cache groups: the kinds of per-layer state that can share one block pool.

A hybrid model keeps more than one kind of state per token: full attention keeps every
token's K and V, sliding window only the last `window` tokens, a Mamba/SSM layer one
fixed-size state per sequence. Each kind is a *group* with its own spec. Groups share one
`BlockPool` of equal-sized pages, as vLLM's hybrid allocator does, so a group's page size
in bytes must equal the pool's. `KVCache` serves one group; hybrid models (several kinds
at once, in bytes and FLOPs) are `kvplug.hybrid`'s.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import StrEnum

from kvplug.errors import ConfigError


class GroupKind(StrEnum):
    FULL = "full_attention"
    SLIDING_WINDOW = "sliding_window"
    MAMBA = "mamba"


@dataclass(frozen=True)
class CacheGroupSpec:
    """One cache group. `bytes_per_token` counts all the group's layers together."""

    kind: GroupKind = GroupKind.FULL
    block_size: int = 16
    bytes_per_token: int = 0  # 0 when unknown (replays that only count blocks)
    sliding_window: int | None = None

    def __post_init__(self) -> None:
        if not isinstance(self.block_size, int) or self.block_size < 1:
            raise ConfigError(f"block_size must be an integer >= 1, got {self.block_size!r}")
        if self.bytes_per_token < 0:
            raise ConfigError(f"bytes_per_token must be >= 0, got {self.bytes_per_token!r}")
        if (self.kind is GroupKind.SLIDING_WINDOW) != (self.sliding_window is not None):
            raise ConfigError(
                "sliding_window is required for, and only for, a sliding-window group"
            )

    @property
    def page_bytes(self) -> int:
        """Bytes one block of this group occupies."""
        return self.block_size * self.bytes_per_token
