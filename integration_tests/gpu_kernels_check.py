"""GPU check of kvplug's paged-attention kernels: correctness, then decode bandwidth.

Runs on one H200 in a few minutes (budget: 8). Two parts:

1. correctness: the Triton and FlashInfer backends against the reference, decode and
   causal prefill, page sizes 1, 8, 16, 24, 32, 64, 128, 256, with GQA, lengths of 1
   token, exactly one page and a partial last page, pages shuffled across sequences and
   every unused slot NaN. Triton runs float16, bfloat16 and float32; FlashInfer float16
   and bfloat16 (all it serves).
2. timing: one decode step (a batch of 64 sequences of about 4,096 tokens, 32 query / 8
   KV heads x 128, bfloat16) at page sizes 1 to 256, for Triton and for FlashInfer. Each
   line prints the achieved bandwidth (K and V bytes read / time, GB/s) and the ratio of
   FlashInfer at page size 16's time to this time (> 1: faster than that baseline).
   FlashInfer is planned once per batch and only its run is timed, as engines plan once
   per step for all layers. Timings use triton.testing.do_bench (median, L2 flushed).

Exit status 0 when every correctness check passes, 1 otherwise.

How to run (the GPU machine is offline; carry wheels to it)
-----------------------------------------------------------
On a machine with internet access, the same CPU architecture and Python 3.11:

    pip download -d wheels torch==2.13.0 triton==3.7.1 numpy \
        flashinfer-python==0.7.2.post1 click pydantic pyyaml xxhash packaging \
        setuptools wheel
    pip wheel --no-deps -w wheels /path/to/kvplug

PyPI's Linux x86-64 ``torch==2.13.0`` wheel is the CUDA build, and ``pip download`` brings
its ``nvidia-*`` CUDA runtime wheels along. Copy ``wheels/`` and this repository to the GPU
machine, then:

    python3.11 -m venv /tmp/kv && . /tmp/kv/bin/activate
    pip install --no-index --find-links wheels torch==2.13.0 triton==3.7.1 \
        flashinfer-python==0.7.2.post1 kvplug
    python integration_tests/gpu_kernels_check.py            # about 3-6 minutes

FlashInfer compiles its kernels on first use (JIT) with ``nvcc``, so the GPU machine needs
a CUDA toolkit matching torch's CUDA version (``nvcc`` on PATH, or ``CUDA_HOME`` set),
or FlashInfer's prebuilt ``flashinfer-jit-cache`` wheel for that CUDA version carried
along. The first run spends most of its time compiling (four kernels: decode and
prefill, float16 and bfloat16); later runs reuse ``~/.cache/flashinfer``. Without a
compiler, run with ``--skip-flashinfer``: the Triton checks and timings still run and
the ratios are then against Triton at page size 16.

On CPU, ``--dry-run`` runs both parts with tiny shapes on the reference and the Triton
interpreter (TRITON_INTERPRET=1, set by this script) to check the script itself; its
timings are meaningless:

    .venv/bin/python integration_tests/gpu_kernels_check.py --dry-run
"""

from __future__ import annotations

import argparse
import math
import os
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass

if "--dry-run" in sys.argv:
    os.environ["TRITON_INTERPRET"] = "1"  # before anything imports triton

import torch

from kvplug.kernels import available_backends, paged_decode, paged_prefill

PAGE_SIZES = [1, 8, 16, 24, 32, 64, 128, 256]
BASELINE_PAGE_SIZE = 16
# max |actual - reference| allowed, per dtype
TOLERANCE = {torch.float32: 2e-4, torch.float16: 1e-2, torch.bfloat16: 4e-2}


@dataclass(frozen=True)
class Shapes:
    q_heads: int
    kv_heads: int
    head_dim: int
    batch: int  # timing batch
    mean_len: int  # timing: lengths uniform in [mean_len / 2, 3 * mean_len / 2]
    long_len: int  # correctness: the longest sequence


GPU_SHAPES = Shapes(q_heads=32, kv_heads=8, head_dim=128, batch=64, mean_len=4096, long_len=1000)
DRY_SHAPES = Shapes(q_heads=4, kv_heads=2, head_dim=16, batch=3, mean_len=40, long_len=70)


@dataclass
class Paged:
    k_cache: torch.Tensor
    v_cache: torch.Tensor
    block_table: torch.Tensor
    seq_lens: torch.Tensor


def make_paged(
    lengths: list[int], page_size: int, shapes: Shapes, dtype: torch.dtype, device: str, seed: int
) -> Paged:
    """Random K/V in blocks shuffled across sequences; every slot past a sequence is NaN."""
    gen = torch.Generator().manual_seed(seed)
    pages = [math.ceil(n / page_size) for n in lengths]
    num_blocks = sum(pages) + 1
    order = torch.randperm(num_blocks, generator=gen)
    nan_block = int(order[-1])  # unused table entries point here
    table = torch.full((len(lengths), max(pages) + 1), nan_block, dtype=torch.int32)
    start = 0
    for b, count in enumerate(pages):
        table[b, :count] = order[start : start + count]
        start += count
    shape = (num_blocks, page_size, shapes.kv_heads, shapes.head_dim)
    values = torch.Generator(device).manual_seed(seed)  # drawn on the device: GBs on a GPU
    k_cache = torch.randn(shape, generator=values, device=device).to(dtype)
    v_cache = torch.randn(shape, generator=values, device=device).to(dtype)
    slot = torch.arange(page_size, device=device)
    for b, n in enumerate(lengths):  # NaN past the end of each last page
        last = int(table[b, pages[b] - 1])
        filled = n - (pages[b] - 1) * page_size
        k_cache[last, slot >= filled] = float("nan")
        v_cache[last, slot >= filled] = float("nan")
    k_cache[nan_block] = float("nan")
    v_cache[nan_block] = float("nan")
    lens = torch.tensor(lengths, dtype=torch.int32)
    return Paged(k_cache, v_cache, table.to(device), lens.to(device))


def check_correctness(
    backends: list[str], shapes: Shapes, device: str, page_sizes: list[int]
) -> list[str]:
    """Compare each backend with the reference; print one line per case; return failures."""
    failures = []
    print(f"{'backend':<11} {'op':<8} {'dtype':<9} {'page':>5} {'max err':>10}  result")
    for page_size in page_sizes:
        lengths = [1, page_size, 2 * page_size + (page_size + 2) // 3, shapes.long_len]
        new = [1, page_size, min(lengths[2], page_size + 2), 3]  # new tokens per sequence
        qo_indptr = torch.tensor([0, *torch.tensor(new).cumsum(0).tolist()], dtype=torch.int32)
        for dtype in (torch.float16, torch.bfloat16, torch.float32):
            paged = make_paged(lengths, page_size, shapes, dtype, device, seed=page_size)
            args = (paged.k_cache, paged.v_cache, paged.block_table, paged.seq_lens)
            gen = torch.Generator().manual_seed(1)
            q_decode = torch.randn(len(lengths), shapes.q_heads, shapes.head_dim, generator=gen)
            q_prefill = torch.randn(int(qo_indptr[-1]), shapes.q_heads, shapes.head_dim,
                                    generator=gen)  # fmt: skip
            q_decode, q_prefill = q_decode.to(device, dtype), q_prefill.to(device, dtype)
            expected = {
                "decode": paged_decode(q_decode, *args, backend="reference"),
                "prefill": paged_prefill(q_prefill, *args, qo_indptr.to(device),
                                         backend="reference"),
            }  # fmt: skip
            for backend in backends:
                if backend == "flashinfer" and dtype == torch.float32:
                    continue  # FlashInfer serves 16-bit floats only
                for op in ("decode", "prefill"):
                    try:
                        if op == "decode":
                            actual = paged_decode(q_decode, *args, backend=backend)
                        else:
                            actual = paged_prefill(q_prefill, *args, qo_indptr.to(device),
                                                   backend=backend)  # fmt: skip
                        error = (actual.float() - expected[op].float()).abs().max().item()
                        ok = math.isfinite(error) and error <= TOLERANCE[dtype]
                        result = "ok" if ok else f"FAIL (tolerance {TOLERANCE[dtype]:g})"
                    except Exception as exc:  # report and go on to the other cases
                        error, ok = float("nan"), False
                        result = f"FAIL {type(exc).__name__}: {exc}"
                    name = str(dtype).removeprefix("torch.")
                    print(
                        f"{backend:<11} {op:<8} {name:<9} {page_size:>5} {error:>10.2e}  {result}"
                    )
                    if not ok:
                        failures.append(f"{backend} {op} {name} page {page_size}: {result}")
    return failures


def bench_ms(fn: Callable[[], object], device: str) -> float:
    if device == "cuda":
        import triton.testing

        return float(triton.testing.do_bench(fn, warmup=25, rep=100))
    fn()
    begin = time.perf_counter()
    fn()
    return (time.perf_counter() - begin) * 1e3


def decode_step(
    backend: str, q: torch.Tensor, paged: Paged, shapes: Shapes, page_size: int, scale: float
) -> Callable[[], object]:
    """One decode step of `backend`, with FlashInfer's plan done up front."""
    from kvplug.kernels import flashinfer_backend, triton_backend

    cache = (paged.k_cache, paged.v_cache)
    if backend == "triton":
        return lambda: triton_backend.decode(q, *cache, paged.block_table, paged.seq_lens, scale)
    decoder = flashinfer_backend.PagedDecoder(
        paged.block_table, paged.seq_lens, q_heads=shapes.q_heads, kv_heads=shapes.kv_heads,
        head_dim=shapes.head_dim, page_size=page_size, dtype=q.dtype, scale=scale,
    )  # fmt: skip
    return lambda: decoder.run(q, *cache)


def time_decode(backends: list[str], shapes: Shapes, device: str, page_sizes: list[int]) -> None:
    """Time one decode step per backend and page size; print GB/s and the ratio."""
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    gen = torch.Generator().manual_seed(0)
    lengths = torch.randint(shapes.mean_len // 2, 3 * shapes.mean_len // 2 + 1,
                            (shapes.batch,), generator=gen).tolist()  # fmt: skip
    kv_bytes = sum(lengths) * shapes.kv_heads * shapes.head_dim * 2 * dtype.itemsize
    q = torch.randn(shapes.batch, shapes.q_heads, shapes.head_dim, generator=gen)
    q = q.to(device, dtype)
    scale = shapes.head_dim**-0.5
    timings: dict[tuple[str, int], float] = {}
    for page_size in page_sizes:
        paged = make_paged(lengths, page_size, shapes, dtype, device, seed=page_size)
        for backend in backends:
            timings[backend, page_size] = bench_ms(
                decode_step(backend, q, paged, shapes, page_size, scale), device
            )
        del paged

    base_backend = "flashinfer" if "flashinfer" in backends else "triton"
    base = timings.get((base_backend, BASELINE_PAGE_SIZE))
    print(
        f"\ndecode step: {shapes.batch} sequences, {sum(lengths):,} tokens, "
        f"{shapes.q_heads} query / {shapes.kv_heads} KV heads x {shapes.head_dim}, "
        f"{str(dtype).removeprefix('torch.')}, {kv_bytes / 1e9:.3f} GB of K and V per step"
    )
    print(f"{'backend':<11} {'page':>5} {'ms':>9} {'GB/s':>9} {'vs ' + base_backend + '@16':>15}")
    for (backend, page_size), ms in sorted(timings.items()):
        ratio = f"{base / ms:.2f}x" if base else "-"
        print(f"{backend:<11} {page_size:>5} {ms:>9.4f} {kv_bytes / ms / 1e6:>9.1f} {ratio:>15}")
    if device != "cuda":
        print("(dry run on CPU: these timings are meaningless)")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument(
        "--dry-run",
        action="store_true",
        help="tiny shapes on CPU: reference and Triton interpreter only",
    )
    parser.add_argument("--skip-flashinfer", action="store_true")
    parser.add_argument("--skip-timing", action="store_true")
    args = parser.parse_args()  # fmt: skip

    status = available_backends()
    print(f"torch {torch.__version__}; backends: {status}")
    if args.dry_run:
        device, shapes = "cpu", DRY_SHAPES
        backends, page_sizes = ["triton"], [1, 16, 24, 256]
    else:
        if not torch.cuda.is_available():
            print("no CUDA GPU visible; use --dry-run on CPU", file=sys.stderr)
            return 1
        device, shapes = "cuda", GPU_SHAPES
        backends, page_sizes = ["triton", "flashinfer"], PAGE_SIZES
        print(f"GPU: {torch.cuda.get_device_name()}")
        if args.skip_flashinfer:
            backends.remove("flashinfer")
    failures = [f"{name}: {status[name]}" for name in backends if status[name] != "available"]
    backends = [name for name in backends if status[name] == "available"]

    begin = time.perf_counter()
    failures += check_correctness(backends, shapes, device, page_sizes)
    print(f"correctness: {time.perf_counter() - begin:.0f} s")
    if not args.skip_timing and backends:
        begin = time.perf_counter()
        time_decode(backends, shapes, device, page_sizes)
        print(f"timing: {time.perf_counter() - begin:.0f} s")
    for failure in failures:
        print(f"FAILED: {failure}")
    print("all correctness checks passed" if not failures else f"{len(failures)} failures")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
