"""The sweep itself: one row per block size, and the recommendation."""

from __future__ import annotations

from dataclasses import dataclass

from kvplug.tools.sweep.accounting import account, sample_lengths
from kvplug.tools.sweep.config import GIB, TABLE_ENTRY_BYTES, SweepConfig
from kvplug.tools.sweep.latency import LatencyPlan, measure_decode_ms, plan_latency


@dataclass
class SweepRow:
    """One block size's figures. Bytes count every layer's K and V."""

    block_size: int
    logical_tokens: int
    physical_slots: int
    tail_waste_tokens: int
    waste_per_sequence: float
    expected_waste_per_sequence: float  # (B - 1) / 2
    tail_waste_bytes: int
    waste_fraction: float  # of physical slots
    table_entries: int
    allocations: int
    memory_bytes: int  # physical slots plus block tables
    fits_memory: bool
    decode_ms: float | None = None  # measured, one layer, the measured subsample
    est_attention_tpot_ms: float | None = None  # decode_ms x layers x (all / measured tokens)
    meets_tpot: bool | None = None


@dataclass
class SweepResult:
    config: SweepConfig
    lengths: list[int]
    rows: list[SweepRow]
    latency: LatencyPlan | None
    notes: list[str]
    recommended: int | None
    reason: str


def run_sweep(config: SweepConfig) -> SweepResult:
    lengths = sample_lengths(config.num_sequences, config.buckets, config.weights, config.seed)
    plan = plan_latency(config, lengths)
    notes: list[str] = []
    if isinstance(plan, str):
        notes.append(plan)
        plan = None
    else:
        notes.append(plan.describe(len(lengths)))
    measured = lengths[: plan.sequences] if plan else []
    scale_up = sum(lengths) / sum(measured) if measured else 0.0
    budget = (1 - config.reserve) * config.pool_gib * GIB
    rows = []
    for block_size in config.block_sizes:
        acc = account(lengths, block_size)
        memory = acc.physical_slots * config.bytes_per_token + acc.table_entries * TABLE_ENTRY_BYTES
        row = SweepRow(
            block_size=block_size,
            logical_tokens=acc.logical_tokens,
            physical_slots=acc.physical_slots,
            tail_waste_tokens=acc.tail_waste_tokens,
            waste_per_sequence=acc.waste_per_sequence,
            expected_waste_per_sequence=acc.expected_waste_per_sequence,
            tail_waste_bytes=acc.tail_waste_tokens * config.bytes_per_token,
            waste_fraction=acc.tail_waste_tokens / acc.physical_slots,
            table_entries=acc.table_entries,
            allocations=acc.allocations,
            memory_bytes=memory,
            fits_memory=memory <= budget,
        )
        if plan:
            row.decode_ms = measure_decode_ms(measured, block_size, plan, config.seed)
            row.est_attention_tpot_ms = row.decode_ms * config.model.layers * scale_up
            if config.tpot_ms is not None:
                row.meets_tpot = row.est_attention_tpot_ms <= config.tpot_ms
        rows.append(row)
    if plan:
        scaled = f" x {scale_up:.1f} (all tokens / measured tokens)" if scale_up > 1 else ""
        notes.append(
            f"est. TPOT counts attention only: the measured step x {config.model.layers} "
            f"layers{scaled}"
        )
    recommended, reason = recommend(rows, config)
    return SweepResult(config, lengths, rows, plan, notes, recommended, reason)


def recommend(rows: list[SweepRow], config: SweepConfig) -> tuple[int | None, str]:
    """The block size that fits the memory reserve and meets the TPOT limit, and why."""
    budget_gib = (1 - config.reserve) * config.pool_gib
    limits = (
        f"memory <= {budget_gib:.1f} GiB ({config.pool_gib:g} GiB pool less {config.reserve:.0%})"
    )
    if config.tpot_ms is not None:
        limits += f" and est. attention TPOT <= {config.tpot_ms:g} ms"
    feasible = [r for r in rows if r.fits_memory and r.meets_tpot is not False]
    if not feasible:
        misses = []
        for r in rows:
            why = []
            if not r.fits_memory:
                why.append(f"needs {r.memory_bytes / GIB:.1f} GiB")
            if r.meets_tpot is False:
                why.append(f"TPOT {r.est_attention_tpot_ms:.1f} ms")
            misses.append(f"{r.block_size}: {', '.join(why)}")
        return None, f"no block size meets {limits} ({'; '.join(misses)})"
    if all(r.decode_ms is not None for r in feasible):
        best = min(feasible, key=lambda r: (r.decode_ms, r.memory_bytes))
        why = f"the fastest decode ({best.decode_ms:.3f} ms) of those that meet {limits}"
    else:
        best = min(feasible, key=lambda r: r.memory_bytes)
        why = f"the least memory of those that meet {limits} (latency not measured)"
    return best.block_size, why
