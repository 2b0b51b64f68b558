"""What bringing a block back from another tier costs, in the units of its recompute.

A block another tier holds (a CPU offload, LMCache) is not lost when the GPU evicts it: a
later hit reloads its KV over the host link instead of recomputing it. `HostLink` prices
that reload as the prefill FLOPs the GPU could have run in the transfer time,

    reload = kv_bytes(block) / link_bytes_per_second * prefill_flops_per_second,

so one number compares a reload with a recompute (`kvplug.policies.value.BlockValue`):
the `cost` policy values a block held elsewhere at ``min(recompute, reload)``, and the
replay charges each reloaded block that much against the compute it saved.

The defaults are a PCIe 5.0 x16 link's sustained host-to-device rate (about 25 GB/s of its
64) and a prefill rate of 400 TFLOP/s (an H100's dense BF16 at about 40% utilisation).
"""

from __future__ import annotations

from dataclasses import dataclass

from kvplug.core.model_spec import ModelSpec
from kvplug.errors import ConfigError


@dataclass(frozen=True)
class HostLink:
    """The link a reloaded block crosses, and the prefill rate that prices its time."""

    gbps: float = 25.0  # host-to-device GB/s (10**9 bytes per second), sustained
    prefill_tflops: float = 400.0  # prefill FLOP/s the GPU sustains, in 10**12

    def __post_init__(self) -> None:
        for name in ("gbps", "prefill_tflops"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int | float) or not value > 0:
                raise ConfigError(f"{name} must be a number > 0, got {value!r}")

    def reload_seconds(self, model: ModelSpec, tokens: int) -> float:
        """Seconds to bring back the KV of `tokens` tokens."""
        return model.kv_bytes_per_token() * tokens / (self.gbps * 1e9)

    def reload_flops(self, model: ModelSpec, tokens: int) -> float:
        """The prefill FLOPs the GPU could run while `tokens` tokens' KV come back."""
        return self.reload_seconds(model, tokens) * self.prefill_tflops * 1e12
