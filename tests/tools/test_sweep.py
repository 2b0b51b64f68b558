"""The block-size sweep: trace sampling, accounting, the recommendation and the command."""

from __future__ import annotations

import csv
import io
import json
import math
import statistics
import subprocess
import sys
from pathlib import Path

import pytest
from click.testing import CliRunner

from kvplug.cli import main
from kvplug.errors import ConfigError
from kvplug.tools.sweep import (
    DEFAULT_BUCKETS,
    DEFAULT_WEIGHTS,
    LatencySetup,
    SweepConfig,
    SweepRow,
    account,
    recommend,
    sample_lengths,
)

NO_LATENCY = LatencySetup(backend="none")


def tail_waste(n: int, block_size: int) -> int:
    return -n % block_size


@pytest.mark.parametrize("block_size", [8, 16, 32, 64])
def test_tail_waste_agrees_with_the_analytical_estimate(block_size: int) -> None:
    """Mean waste per sequence is (B - 1) / 2 within four standard errors.

    Every default bucket's width is a multiple of 64, so the remainder of a length drawn
    uniformly in a bucket is uniform on 0..B-1 for these block sizes.
    """
    lengths = sample_lengths(2000, DEFAULT_BUCKETS, DEFAULT_WEIGHTS, seed=block_size)
    acc = account(lengths, block_size)
    per_sequence = [tail_waste(n, block_size) for n in lengths]
    assert acc.tail_waste_tokens == sum(per_sequence)
    standard_error = statistics.stdev(per_sequence) / math.sqrt(len(lengths))
    expected = (block_size - 1) / 2
    assert acc.expected_waste_per_sequence == expected
    assert abs(acc.waste_per_sequence - expected) < 4 * standard_error


@pytest.mark.parametrize("block_size", [1, 7, 16, 24, 100])
def test_accounting_matches_arithmetic(block_size: int) -> None:
    lengths = sample_lengths(300, ((1, 40), (41, 900)), (1.0, 1.0), seed=3)
    acc = account(lengths, block_size)
    blocks = sum(math.ceil(n / block_size) for n in lengths)
    assert acc.sequences == len(lengths)
    assert acc.logical_tokens == sum(lengths)
    assert acc.physical_slots == blocks * block_size
    assert acc.tail_waste_tokens == acc.physical_slots - acc.logical_tokens
    assert acc.table_entries == blocks
    assert acc.allocations == blocks  # nothing shared, copied or freed in a snapshot


def test_sampled_lengths_follow_buckets_and_weights() -> None:
    buckets = ((1, 10), (11, 20), (21, 30))
    weights = (3.0, 1.0, 0.0)
    lengths = sample_lengths(4000, buckets, weights, seed=1)
    assert all(1 <= n <= 20 for n in lengths)  # the zero-weight bucket is never drawn
    share = sum(n <= 10 for n in lengths) / len(lengths)
    sigma = math.sqrt(0.75 * 0.25 / len(lengths))
    assert abs(share - 0.75) < 4 * sigma


def test_same_seed_same_trace_other_seed_other_trace() -> None:
    first = sample_lengths(100, DEFAULT_BUCKETS, DEFAULT_WEIGHTS, seed=5)
    assert first == sample_lengths(100, DEFAULT_BUCKETS, DEFAULT_WEIGHTS, seed=5)
    assert first != sample_lengths(100, DEFAULT_BUCKETS, DEFAULT_WEIGHTS, seed=6)


# -- recommendation --------------------------------------------------------------------


def row(block_size: int, memory_gib: float, decode_ms: float | None, tpot_ms: float | None):
    return SweepRow(
        block_size=block_size,
        logical_tokens=0,
        physical_slots=1,
        tail_waste_tokens=0,
        waste_per_sequence=0.0,
        expected_waste_per_sequence=0.0,
        tail_waste_bytes=0,
        waste_fraction=0.0,
        table_entries=0,
        allocations=0,
        memory_bytes=int(memory_gib * 2**30),
        fits_memory=memory_gib <= 90,
        decode_ms=decode_ms,
        est_attention_tpot_ms=tpot_ms,
        meets_tpot=None if tpot_ms is None else tpot_ms <= 10,
    )


def test_recommendation_is_the_fastest_block_size_within_both_limits() -> None:
    config = SweepConfig(pool_gib=100, reserve=0.1, tpot_ms=10)
    rows = [
        row(8, 80, decode_ms=0.9, tpot_ms=12),  # too slow
        row(16, 85, decode_ms=0.6, tpot_ms=8),
        row(32, 88, decode_ms=0.5, tpot_ms=7),  # the pick
        row(64, 95, decode_ms=0.4, tpot_ms=6),  # over the memory left after the reserve
    ]
    size, reason = recommend(rows, config)
    assert size == 32
    assert "90.0 GiB" in reason and "10 ms" in reason


def test_no_recommendation_names_what_each_block_size_misses() -> None:
    config = SweepConfig(pool_gib=100, reserve=0.1, tpot_ms=10)
    rows = [row(8, 80, 0.9, 12), row(64, 95, 0.4, 6)]
    size, reason = recommend(rows, config)
    assert size is None
    assert "8: TPOT 12.0 ms" in reason and "64: needs 95.0 GiB" in reason


def test_without_latency_the_least_memory_wins() -> None:
    config = SweepConfig(latency=NO_LATENCY)
    size, reason = recommend([row(16, 50, None, None), row(8, 40, None, None)], config)
    assert size == 8 and "latency not measured" in reason


# -- bad input -------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("changes", "message"),
    [
        ({"block_sizes": (0, 16)}, "block sizes must be integers >= 1"),
        ({"weights": (1.0, 2.0)}, "2 weights for 4 buckets"),
        ({"weights": (0.0, 0.0, 0.0, 0.0)}, "not all 0"),
        ({"buckets": ((5, 2),), "weights": (1.0,)}, "1 <= low <= high"),
        ({"reserve": 1.0}, "reserve"),
        ({"latency": LatencySetup(backend="cuda")}, "accepted: auto, reference"),
        ({"tpot_ms": 5.0, "latency": NO_LATENCY}, "TPOT limit needs a latency"),
    ],
)
def test_bad_config_names_the_problem(changes: dict, message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        SweepConfig(**changes)


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--weights", "a,b"], "one per bucket"),
        (["--weights", "1,2"], "4 comma-separated numbers"),
        (["--block-sizes", "0,16"], "integers >= 1"),
        (["--block-sizes", "eight"], "integers >= 1"),
        (["--buckets", "1-64,9"], "LOW-HIGH"),
        (["--backend", "cuda"], "'cuda' is not one of"),
    ],
)
def test_bad_options_name_the_problem(args: list[str], message: str) -> None:
    result = CliRunner().invoke(main, ["sweep", "--sequences", "10", *args])
    assert result.exit_code == 2
    assert message in result.output


# -- the command -----------------------------------------------------------------------


def test_sweep_accounting_needs_no_torch() -> None:
    code = (
        "import sys\n"
        "from kvplug.tools.sweep import LatencySetup, SweepConfig, format_table, run_sweep\n"
        "result = run_sweep(SweepConfig(num_sequences=50, latency=LatencySetup(backend='none')))\n"
        "assert result.recommended is not None, result.reason\n"
        "print('torch' in sys.modules)\n"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "False"


def test_table_without_latency() -> None:
    result = CliRunner().invoke(main, ["sweep", "--sequences", "100", "--backend", "none"])
    assert result.exit_code == 0, result.output
    assert "(B-1)/2" in result.output
    assert "decode latency not measured" in result.output
    assert "recommendation: block size 8" in result.output  # least memory, no latency


def test_json_and_csv_report_the_same_rows() -> None:
    pytest.importorskip("torch")
    args = [
        "sweep",
        "--sequences",
        "120",
        "--block-sizes",
        "8,24",
        "--latency-seqs",
        "3",
        "--repeats",
        "1",
        "--backend",
        "reference",
    ]
    as_json = CliRunner().invoke(main, [*args, "--format", "json"])
    assert as_json.exit_code == 0, as_json.output
    report = json.loads(as_json.output)
    assert [r["block_size"] for r in report["rows"]] == [8, 24]
    assert report["latency"]["backend"] == "reference"
    assert report["latency"]["sequences"] == 3
    assert all(r["decode_ms"] > 0 for r in report["rows"])
    assert report["recommended_block_size"] in (8, 24)
    if report["latency"]["device"] == "cpu":
        assert any("CPU timings" in note for note in report["notes"])

    as_csv = CliRunner().invoke(main, [*args, "--format", "csv"])
    assert as_csv.exit_code == 0, as_csv.output
    rows = list(csv.DictReader(io.StringIO(as_csv.stdout)))
    assert [int(r["block_size"]) for r in rows] == [8, 24]
    for from_csv, from_json in zip(rows, report["rows"], strict=True):
        assert int(from_csv["tail_waste_tokens"]) == from_json["tail_waste_tokens"]
        assert int(from_csv["table_entries"]) == from_json["table_entries"]


def test_tpot_limit_and_plots(tmp_path: Path) -> None:
    pytest.importorskip("torch")
    pytest.importorskip("matplotlib")
    prefix = tmp_path / "sweep"
    result = CliRunner().invoke(
        main,
        [
            "sweep",
            "--sequences",
            "60",
            "--latency-seqs",
            "2",
            "--repeats",
            "1",
            "--backend",
            "reference",
            "--tpot-ms",
            "1e9",
            "--plot",
            str(prefix),
        ],
    )
    assert result.exit_code == 0, result.output
    assert "TPOT <= 1e+09 ms" in result.output
    for name in ("fragmentation", "latency"):
        image = tmp_path / f"sweep-{name}.png"
        assert image.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
