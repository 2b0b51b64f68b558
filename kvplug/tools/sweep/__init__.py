"""The block-size sweep: ``kvplug sweep``.

A block size trades tail waste (the unused slots of each sequence's last block, about
``(B - 1) / 2`` tokens per sequence) against metadata and kernel cost (block-table
entries, allocations, and a kernel that walks more, smaller pages). The sweep measures
both sides on one trace:

1. the trace: `num_sequences` concurrent sequence lengths, each drawn by picking a bucket
   (1-64, 65-512, 513-4096, 4097-16384 tokens by default) with the given weights, then a
   length uniformly inside it;
2. accounting, per block size (no torch needed): every sequence is added to a real
   `kvplug.core.cache.KVCache` with that block size; its `usage()` and `metrics` give logical
   tokens, physical slots, tail waste, block-table entries and block allocations;
3. latency, per block size: one paged decode step over the same sequences with a kernel
   backend (`kvplug.kernels`), keys and values laid out in shuffled blocks. On CPU the
   reference backend runs a small head shape over a subsample, so it finishes in seconds;
   those timings are labelled CPU timings and say little about a GPU;
4. a recommendation: of the block sizes whose memory fits the pool minus the declared
   reserve and whose estimated attention time per output token meets the limit, the one
   with the fastest decode (ties: the least memory).

| module | owns |
|---|---|
| `config` | `SweepConfig`, `ModelShape`, `LatencySetup`, the defaults and the constants |
| `accounting` | sampling the trace's lengths; what they hold at one block size (no torch) |
| `latency` | planning the decode measurement for the device and timing it (torch, lazily) |
| `run` | `run_sweep`: one `SweepRow` per block size, and `recommend` |
| `output` | the table, JSON, CSV and the plots |
"""

from kvplug.tools.sweep.accounting import Accounting, account, sample_lengths
from kvplug.tools.sweep.config import (
    DEFAULT_BLOCK_SIZES,
    DEFAULT_BUCKETS,
    DEFAULT_WEIGHTS,
    GIB,
    LATENCY_BACKENDS,
    TABLE_ENTRY_BYTES,
    LatencySetup,
    ModelShape,
    SweepConfig,
)
from kvplug.tools.sweep.latency import LatencyPlan, measure_decode_ms, plan_latency
from kvplug.tools.sweep.output import format_table, to_csv, to_json, write_plots
from kvplug.tools.sweep.run import SweepResult, SweepRow, recommend, run_sweep

__all__ = [
    "DEFAULT_BLOCK_SIZES",
    "DEFAULT_BUCKETS",
    "DEFAULT_WEIGHTS",
    "GIB",
    "LATENCY_BACKENDS",
    "TABLE_ENTRY_BYTES",
    "Accounting",
    "LatencyPlan",
    "LatencySetup",
    "ModelShape",
    "SweepConfig",
    "SweepResult",
    "SweepRow",
    "account",
    "format_table",
    "measure_decode_ms",
    "plan_latency",
    "recommend",
    "run_sweep",
    "sample_lengths",
    "to_csv",
    "to_json",
    "write_plots",
]
