"""Decode latency: the measurement to run on this device, and one timed paged decode step.

torch and the kernels are imported inside the functions only, so the accounting and a
sweep with ``--backend none`` never import them.
"""

from __future__ import annotations

import statistics
import time
from dataclasses import dataclass

from kvplug.errors import KVPlugError
from kvplug.tools.sweep.accounting import blocks_per_sequence
from kvplug.tools.sweep.config import SweepConfig


@dataclass(frozen=True)
class LatencyPlan:
    """The measurement actually run, after device defaults are filled in."""

    backend: str
    device: str
    sequences: int
    q_heads: int
    kv_heads: int
    head_dim: int
    dtype: str
    repeats: int

    def describe(self, total_sequences: int) -> str:
        where = f"on {self.device}"
        if self.device == "cpu":
            where = "CPU timings (one thread), not GPU figures"
        return (
            f"decode latency: {self.backend} backend, {where}; {self.sequences} of "
            f"{total_sequences} sequences, {self.q_heads} query / {self.kv_heads} KV heads x "
            f"{self.head_dim} dims, {self.dtype}, median of {self.repeats} calls, one layer"
        )


def plan_latency(config: SweepConfig, lengths: list[int]) -> LatencyPlan | str:
    """The latency measurement to run, or why none runs (a note for the output)."""
    setup = config.latency
    if setup.backend == "none":
        return "decode latency not measured (--backend none)"
    from kvplug.kernels import AVAILABLE, available_backends

    status = available_backends()
    if status["reference"] != AVAILABLE:
        if setup.backend == "auto":
            missing = status["reference"]
            return f"decode latency not measured: {missing} (pip install 'kvplug[kernels]')"
        raise KVPlugError(f"backend {setup.backend!r} is unavailable: {status['reference']}")
    import torch

    device = "cuda" if torch.cuda.is_available() else "cpu"
    on_gpu = device == "cuda"
    backend = setup.backend
    kv_heads = setup.kv_heads or (config.model.kv_heads if on_gpu else 1)
    head_dim = setup.head_dim or (config.model.head_dim if on_gpu else 64)
    dtype = "bfloat16" if on_gpu else "float32"
    if backend == "auto":
        from kvplug.kernels import select_backend

        probe = torch.empty(1, kv_heads * setup.q_per_kv, head_dim, device=device)
        cache = torch.empty(1, 16, kv_heads, head_dim, device=device)
        table = torch.empty(1, 1, device=device)
        backend = select_backend("auto", probe.to(getattr(torch, dtype)), cache, table).NAME
    if status[backend] != AVAILABLE:
        raise KVPlugError(f"backend {backend!r} is unavailable: {status[backend]}")
    return LatencyPlan(
        backend=backend,
        device=device,
        sequences=min(len(lengths), setup.sequences or (len(lengths) if on_gpu else 32)),
        q_heads=kv_heads * setup.q_per_kv,
        kv_heads=kv_heads,
        head_dim=head_dim,
        dtype=dtype if backend != "reference" else "float32",
        repeats=setup.repeats,
    )


def measure_decode_ms(lengths: list[int], block_size: int, plan: LatencyPlan, seed: int) -> float:
    """Median milliseconds of one paged decode step over `lengths` at `block_size`.

    Blocks are shuffled across sequences. The inputs are checked once, outside the timing;
    FlashInfer is planned once and only its run is timed, as an engine plans once per
    step for all layers.
    """
    import torch

    from kvplug.kernels import paged_decode, select_backend

    gen = torch.Generator().manual_seed(seed)
    dtype = getattr(torch, plan.dtype)
    pages = blocks_per_sequence(lengths, block_size)
    num_blocks = sum(pages)
    order = torch.randperm(num_blocks, generator=gen)
    table = torch.zeros(len(lengths), max(pages), dtype=torch.int32)
    start = 0
    for b, count in enumerate(pages):
        table[b, :count] = order[start : start + count]
        start += count
    shape = (num_blocks, block_size, plan.kv_heads, plan.head_dim)
    values = torch.Generator(plan.device).manual_seed(seed)  # on the device: GBs on a GPU
    k_cache = torch.randn(shape, generator=values, device=plan.device).to(dtype)
    v_cache = torch.randn(shape, generator=values, device=plan.device).to(dtype)
    q_shape = (len(lengths), plan.q_heads, plan.head_dim)
    q = torch.randn(q_shape, generator=values, device=plan.device).to(dtype)
    table = table.to(plan.device)
    seq_lens = torch.tensor(lengths, dtype=torch.int32, device=plan.device)

    paged_decode(q, k_cache, v_cache, table, seq_lens, backend=plan.backend)  # checks; warm-up
    module = select_backend(plan.backend, q, k_cache, table)
    scale = plan.head_dim**-0.5
    if module.NAME == "flashinfer":
        decoder = module.PagedDecoder(
            table, seq_lens, q_heads=plan.q_heads, kv_heads=plan.kv_heads,
            head_dim=plan.head_dim, page_size=block_size, dtype=dtype, scale=scale,
        )  # fmt: skip

        def step() -> object:
            return decoder.run(q, k_cache, v_cache)
    else:

        def step() -> object:
            return module.decode(q, k_cache, v_cache, table, seq_lens, scale)

    # One CPU thread: torch's thread pool slows down erratically, by up to 10x, when other
    # processes share the cores, which would swamp the differences between block sizes.
    threads = torch.get_num_threads()
    if plan.device == "cpu":
        torch.set_num_threads(1)
    try:
        step()
        times = []
        for _ in range(plan.repeats):
            if plan.device == "cuda":
                torch.cuda.synchronize()
            begin = time.perf_counter()
            step()
            if plan.device == "cuda":
                torch.cuda.synchronize()
            times.append((time.perf_counter() - begin) * 1e3)
    finally:
        torch.set_num_threads(threads)
    return statistics.median(times)
