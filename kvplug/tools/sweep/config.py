"""What a sweep is asked to do: the trace, the model shape, the limits and the latency run."""

from __future__ import annotations

from dataclasses import dataclass, field

from kvplug.errors import ConfigError

DEFAULT_BUCKETS: tuple[tuple[int, int], ...] = ((1, 64), (65, 512), (513, 4096), (4097, 16384))
DEFAULT_WEIGHTS: tuple[float, ...] = (0.4, 0.35, 0.2, 0.05)
DEFAULT_BLOCK_SIZES: tuple[int, ...] = (8, 16, 32, 64)
LATENCY_BACKENDS = ("auto", "reference", "triton", "flashinfer", "none")
TABLE_ENTRY_BYTES = 4  # one int32 block id
GIB = 1024**3


def buckets_text(buckets: tuple[tuple[int, int], ...]) -> str:
    """``1-64, 65-512, ...``: how buckets read in messages and in the table's title."""
    return ", ".join(f"{lo}-{hi}" for lo, hi in buckets)


@dataclass(frozen=True)
class ModelShape:
    """The KV footprint of a model, all layers together. Default: a Llama-3.2-1B-like model."""

    layers: int = 16
    kv_heads: int = 8
    head_dim: int = 64
    dtype_bytes: int = 2

    @property
    def bytes_per_token(self) -> int:
        return self.layers * self.kv_heads * self.head_dim * 2 * self.dtype_bytes  # K and V


@dataclass(frozen=True)
class LatencySetup:
    """How decode latency is measured. None fields are filled in for the device."""

    backend: str = "auto"  # one of LATENCY_BACKENDS; "none" skips the measurement
    sequences: int | None = None  # measured subsample; None: all on a GPU, 32 on CPU
    q_per_kv: int = 4  # query heads per KV head (GQA group size)
    kv_heads: int | None = None  # None: the model's on a GPU, 1 on CPU
    head_dim: int | None = None  # None: the model's on a GPU, 64 on CPU
    repeats: int = 5


@dataclass(frozen=True)
class SweepConfig:
    num_sequences: int = 2000
    buckets: tuple[tuple[int, int], ...] = DEFAULT_BUCKETS
    weights: tuple[float, ...] = DEFAULT_WEIGHTS
    block_sizes: tuple[int, ...] = DEFAULT_BLOCK_SIZES
    model: ModelShape = field(default_factory=ModelShape)
    kv_bytes_per_token: int | None = None  # overrides model.bytes_per_token
    pool_gib: float = 80.0  # KV memory the engine has
    reserve: float = 0.10  # fraction of the pool to keep free
    tpot_ms: float | None = None  # limit on estimated attention time per output token
    latency: LatencySetup = field(default_factory=LatencySetup)
    seed: int = 0

    def __post_init__(self) -> None:
        if self.num_sequences < 1:
            raise ConfigError(f"sequences must be >= 1, got {self.num_sequences}")
        if not self.block_sizes or any(b < 1 for b in self.block_sizes):
            raise ConfigError(f"block sizes must be integers >= 1, got {list(self.block_sizes)}")
        for lo, hi in self.buckets:
            if not 1 <= lo <= hi:
                raise ConfigError(f"bucket {lo}-{hi} must satisfy 1 <= low <= high")
        if len(self.weights) != len(self.buckets):
            raise ConfigError(
                f"{len(self.weights)} weights for {len(self.buckets)} buckets "
                f"({buckets_text(self.buckets)}); give one weight per bucket"
            )
        if any(w < 0 for w in self.weights) or sum(self.weights) <= 0:
            raise ConfigError(f"weights must be >= 0 and not all 0, got {list(self.weights)}")
        if not 0 <= self.reserve < 1:
            raise ConfigError(f"reserve must be a fraction in [0, 1), got {self.reserve}")
        if self.latency.backend not in LATENCY_BACKENDS:
            raise ConfigError(
                f"unknown backend {self.latency.backend!r}; accepted: {', '.join(LATENCY_BACKENDS)}"
            )
        if self.tpot_ms is not None and self.latency.backend == "none":
            raise ConfigError("a TPOT limit needs a latency measurement; pick a backend")

    @property
    def bytes_per_token(self) -> int:
        return self.kv_bytes_per_token or self.model.bytes_per_token
