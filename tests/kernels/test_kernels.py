"""Paged attention: the reference and the Triton kernels against SDPA on contiguous K/V.

Triton runs under its CPU interpreter (TRITON_INTERPRET=1, set here before Triton is
imported). Every test builds a paged cache the same way (`make_paged`):

- each sequence's keys and values are drawn contiguously, then scattered into blocks
  whose ids are shuffled across all sequences;
- every slot no sequence owns is NaN, and unused block-table entries point at a NaN
  block, so a read past a sequence's end turns the output NaN;
- the oracle is torch's scaled_dot_product_attention on the contiguous copies.
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass

import pytest

from kvplug.kernels import (
    BackendError,
    KernelInputError,
    append_paged_kv,
    paged_decode,
    paged_prefill,
    select_backend,
)

os.environ.setdefault("TRITON_INTERPRET", "1")
torch = pytest.importorskip("torch")

PAGE_SIZES = [1, 8, 16, 24, 32, 64, 128, 256]
DTYPES = [torch.float32, torch.float16, torch.bfloat16]
# Kernel outputs against float32 SDPA on the same (rounded) inputs: (atol, rtol).
TOLERANCE = {
    torch.float32: (2e-5, 1e-4),
    torch.float16: (4e-3, 4e-3),
    torch.bfloat16: (3e-2, 2e-2),
}
HEAD_DIM = 16  # the smallest tl.dot accepts; keeps the interpreter quick


def triton_runs_here() -> bool:
    """Whether kvplug's Triton kernels run here: Triton installed and interpreted on CPU."""
    try:
        from kvplug.kernels import triton_backend
    except ImportError:
        return False
    return triton_backend.INTERPRETED


def triton_or_skip() -> None:
    if not triton_runs_here():
        pytest.skip("needs triton, and kvplug's Triton kernels loaded with TRITON_INTERPRET=1")


@dataclass
class Paged:
    """A paged cache and the same keys and values stored contiguously per sequence."""

    k_cache: torch.Tensor  # [num_blocks, page_size, kv_heads, head_dim]
    v_cache: torch.Tensor
    block_table: torch.Tensor  # int32 [batch, max_blocks]
    seq_lens: torch.Tensor  # int32 [batch]
    keys: list[torch.Tensor]  # per sequence [seq_len, kv_heads, head_dim]
    values: list[torch.Tensor]


def make_paged(
    seq_lens: list[int],
    page_size: int,
    *,
    kv_heads: int = 2,
    dtype: torch.dtype = torch.float32,
    seed: int = 0,
    spare_blocks: int = 2,
) -> Paged:
    gen = torch.Generator().manual_seed(seed)
    pages = [math.ceil(n / page_size) for n in seq_lens]
    num_blocks = sum(pages) + spare_blocks
    shape = (num_blocks, page_size, kv_heads, HEAD_DIM)
    k_cache = torch.full(shape, float("nan"), dtype=dtype)
    v_cache = torch.full(shape, float("nan"), dtype=dtype)
    order = torch.randperm(num_blocks, generator=gen).tolist()  # pages shuffled across seqs
    nan_block = order.pop()  # never written: unused table entries point here
    table = torch.full((len(seq_lens), max(pages) + 1), nan_block, dtype=torch.int32)
    keys, values = [], []
    for b, n in enumerate(seq_lens):
        k = torch.randn(n, kv_heads, HEAD_DIM, generator=gen).to(dtype)
        v = torch.randn(n, kv_heads, HEAD_DIM, generator=gen).to(dtype)
        for page in range(pages[b]):
            table[b, page] = block = order.pop()
            span = slice(page * page_size, min(n, (page + 1) * page_size))
            k_cache[block, : span.stop - span.start] = k[span]
            v_cache[block, : span.stop - span.start] = v[span]
        keys.append(k)
        values.append(v)
    lens = torch.tensor(seq_lens, dtype=torch.int32)
    return Paged(k_cache, v_cache, table, lens, keys, values)


def sdpa(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool) -> torch.Tensor:
    """``q [L, q_heads, D]`` over contiguous ``k, v [n, kv_heads, D]``, in float32.

    With `causal` the queries are the last L positions (bottom-right aligned mask).
    """
    group = q.shape[1] // k.shape[1]
    q32, k32, v32 = (t.float().transpose(0, 1) for t in (q, k, v))  # [heads, len, D]
    k32, v32 = k32.repeat_interleave(group, 0), v32.repeat_interleave(group, 0)
    mask = None
    if causal:
        num_q, num_kv = q.shape[0], k.shape[0]
        mask = torch.ones(num_q, num_kv, dtype=torch.bool).tril(diagonal=num_kv - num_q)
    out = torch.nn.functional.scaled_dot_product_attention(q32, k32, v32, attn_mask=mask)
    return out.transpose(0, 1)


def sdpa_decode(q: torch.Tensor, paged: Paged) -> torch.Tensor:
    return torch.stack(
        [
            sdpa(q[b : b + 1], k, v, False)[0]
            for b, (k, v) in enumerate(zip(paged.keys, paged.values, strict=True))
        ]
    )


def sdpa_prefill(q: torch.Tensor, qo_indptr: list[int], paged: Paged) -> torch.Tensor:
    out = torch.empty(q.shape, dtype=torch.float32)
    for b, (k, v) in enumerate(zip(paged.keys, paged.values, strict=True)):
        rows = slice(qo_indptr[b], qo_indptr[b + 1])
        if rows.start < rows.stop:
            out[rows] = sdpa(q[rows], k, v, True)
    return out


def assert_matches(actual: torch.Tensor, expected: torch.Tensor, dtype: torch.dtype) -> None:
    assert actual.dtype == dtype
    assert torch.isfinite(actual).all(), "NaN/inf output: a stray read of an unused slot?"
    atol, rtol = TOLERANCE[dtype]
    torch.testing.assert_close(actual.float(), expected.float(), atol=atol, rtol=rtol)


def lengths_for(page_size: int) -> list[int]:
    """1 token, exactly one page, a partial last page (when pages hold > 1), and 70."""
    return [1, page_size, 2 * page_size + (page_size + 2) // 3, 70]


def new_tokens_for(seq_lens: list[int], page_size: int) -> list[int]:
    """One token; a whole sequence; a run crossing page boundaries after a context; none."""
    return [1, seq_lens[1], min(seq_lens[2], page_size + 2), 0]


def indptr(counts: list[int]) -> list[int]:
    out = [0]
    for count in counts:
        out.append(out[-1] + count)
    return out


def random_q(rows: int, q_heads: int, dtype: torch.dtype, seed: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(rows, q_heads, HEAD_DIM, generator=gen).to(dtype)


# -- decode ----------------------------------------------------------------------------


@pytest.mark.parametrize("page_size", PAGE_SIZES)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_reference_decode_matches_sdpa(page_size: int, dtype: torch.dtype) -> None:
    paged = make_paged(lengths_for(page_size), page_size, dtype=dtype, seed=page_size)
    q = random_q(4, 4, dtype, seed=1)
    out = paged_decode(
        q, paged.k_cache, paged.v_cache, paged.block_table, paged.seq_lens, backend="reference"
    )
    assert_matches(out, sdpa_decode(q, paged), dtype)


@pytest.mark.parametrize("page_size", PAGE_SIZES)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_triton_decode_matches_reference_and_sdpa(page_size: int, dtype: torch.dtype) -> None:
    triton_or_skip()
    paged = make_paged(lengths_for(page_size), page_size, dtype=dtype, seed=page_size)
    q = random_q(4, 4, dtype, seed=2)
    args = (q, paged.k_cache, paged.v_cache, paged.block_table, paged.seq_lens)
    out = paged_decode(*args, backend="triton")
    assert_matches(out, sdpa_decode(q, paged), dtype)
    assert_matches(out, paged_decode(*args, backend="reference"), dtype)


@pytest.mark.parametrize(("q_heads", "kv_heads"), [(2, 2), (6, 2), (8, 1)])
def test_triton_decode_grouped_query_attention(q_heads: int, kv_heads: int) -> None:
    triton_or_skip()
    paged = make_paged([5, 40, 33], 16, kv_heads=kv_heads, seed=q_heads)
    q = random_q(3, q_heads, torch.float32, seed=3)
    out = paged_decode(
        q, paged.k_cache, paged.v_cache, paged.block_table, paged.seq_lens, backend="triton"
    )
    assert_matches(out, sdpa_decode(q, paged), torch.float32)


@pytest.mark.parametrize("num_splits", [2, 5])
@pytest.mark.parametrize("page_size", [8, 24])
def test_triton_decode_split_kv_merges_exactly(num_splits: int, page_size: int) -> None:
    """Several splits per sequence, some past its end, merge to the same answer."""
    triton_or_skip()
    from kvplug.kernels import triton_backend

    paged = make_paged([3, 150, 300], page_size, seed=num_splits)
    q = random_q(3, 4, torch.float32, seed=4)
    args = (q, paged.k_cache, paged.v_cache, paged.block_table, paged.seq_lens)
    out = triton_backend.decode(*args, HEAD_DIM**-0.5, num_splits=num_splits)
    assert_matches(out, sdpa_decode(q, paged), torch.float32)


def test_decode_scale_is_applied() -> None:
    triton_or_skip()
    paged = make_paged([20, 9], 8)
    q = random_q(2, 4, torch.float32, seed=5)
    args = (q, paged.k_cache, paged.v_cache, paged.block_table, paged.seq_lens)
    expected = paged_decode(q * 3.0, *args[1:], backend="reference")
    for backend in ("reference", "triton"):
        out = paged_decode(*args, scale=3.0 / math.sqrt(HEAD_DIM), backend=backend)
        assert_matches(out, expected, torch.float32)


def test_nan_sentinel_exposes_a_read_past_the_end() -> None:
    """The NaN fill works: attending one slot past a partial last page gives NaN."""
    paged = make_paged([19], 8)
    q = random_q(1, 4, torch.float32, seed=6)
    args = (q, paged.k_cache, paged.v_cache, paged.block_table)
    assert torch.isfinite(paged_decode(*args, paged.seq_lens, backend="reference")).all()
    assert torch.isnan(paged_decode(*args, paged.seq_lens + 1, backend="reference")).all()


# -- prefill ---------------------------------------------------------------------------


def prefill_case(page_size: int, dtype: torch.dtype, seed: int):
    seq_lens = lengths_for(page_size)
    paged = make_paged(seq_lens, page_size, dtype=dtype, seed=seed)
    qo = indptr(new_tokens_for(seq_lens, page_size))
    q = random_q(qo[-1], 4, dtype, seed=seed + 1)
    return paged, q, qo


@pytest.mark.parametrize("page_size", PAGE_SIZES)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_reference_prefill_matches_sdpa(page_size: int, dtype: torch.dtype) -> None:
    paged, q, qo = prefill_case(page_size, dtype, seed=page_size)
    qo_indptr = torch.tensor(qo, dtype=torch.int32)
    out = paged_prefill(
        q,
        paged.k_cache,
        paged.v_cache,
        paged.block_table,
        paged.seq_lens,
        qo_indptr,
        backend="reference",
    )
    assert_matches(out, sdpa_prefill(q, qo, paged), dtype)


@pytest.mark.parametrize("page_size", PAGE_SIZES)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_triton_prefill_matches_reference_and_sdpa(page_size: int, dtype: torch.dtype) -> None:
    triton_or_skip()
    paged, q, qo = prefill_case(page_size, dtype, seed=page_size)
    args = (
        q,
        paged.k_cache,
        paged.v_cache,
        paged.block_table,
        paged.seq_lens,
        torch.tensor(qo, dtype=torch.int32),
    )
    out = paged_prefill(*args, backend="triton")
    assert_matches(out, sdpa_prefill(q, qo, paged), dtype)
    assert_matches(out, paged_prefill(*args, backend="reference"), dtype)


def test_triton_prefill_grouped_query_attention() -> None:
    triton_or_skip()
    paged = make_paged([40, 17], 8, kv_heads=1, seed=7)
    qo = indptr([33, 17])
    q = random_q(qo[-1], 4, torch.float32, seed=8)
    out = paged_prefill(
        q,
        paged.k_cache,
        paged.v_cache,
        paged.block_table,
        paged.seq_lens,
        torch.tensor(qo, dtype=torch.int32),
        backend="triton",
    )
    assert_matches(out, sdpa_prefill(q, qo, paged), torch.float32)


@pytest.mark.parametrize("page_size", [8, 24])
def test_pages_swapped_within_a_sequence(page_size: int) -> None:
    """Decode is blind to the order of a sequence's pages; causal prefill is not.

    So the prefill tests above would catch a kernel that read pages out of order.
    """
    paged = make_paged([3 * page_size], page_size, seed=9)
    swapped = paged.block_table.clone()
    swapped[0, [0, 1]] = swapped[0, [1, 0]]
    q = random_q(1, 4, torch.float32, seed=10)
    decode_args = (paged.k_cache, paged.v_cache)
    correct = paged_decode(q, *decode_args, paged.block_table, paged.seq_lens, backend="reference")
    blind = paged_decode(q, *decode_args, swapped, paged.seq_lens, backend="reference")
    torch.testing.assert_close(blind, correct)

    qo = indptr([2 * page_size])  # new tokens span both swapped pages
    qo_indptr = torch.tensor(qo, dtype=torch.int32)
    q = random_q(qo[-1], 4, torch.float32, seed=11)
    expected = sdpa_prefill(q, qo, paged)
    backends = ["reference", "triton"] if triton_runs_here() else ["reference"]
    for backend in backends:
        right = paged_prefill(
            q, *decode_args, paged.block_table, paged.seq_lens, qo_indptr, backend=backend
        )
        wrong = paged_prefill(q, *decode_args, swapped, paged.seq_lens, qo_indptr, backend=backend)
        assert_matches(right, expected, torch.float32)
        assert not torch.allclose(wrong, expected, atol=1e-3), backend


# -- append ----------------------------------------------------------------------------


@pytest.mark.parametrize("page_size", [1, 16, 24])
def test_append_then_prefill_then_decode(page_size: int) -> None:
    """Write a prompt's keys through the table, attend causally, then decode one more."""
    full = make_paged([37, 8], page_size, seed=12, spare_blocks=3)  # the intended final contents
    context = [20, 0]  # cached before this step
    new = [17, 8]
    k_cache = torch.full_like(full.k_cache, float("nan"))
    v_cache = torch.full_like(full.v_cache, float("nan"))
    for b, n in enumerate(context):  # the cached part, written directly
        for pos in range(n):
            block = int(full.block_table[b, pos // page_size])
            k_cache[block, pos % page_size] = full.keys[b][pos]
            v_cache[block, pos % page_size] = full.values[b][pos]
    k_new = torch.cat([full.keys[b][context[b] :] for b in range(2)])
    v_new = torch.cat([full.values[b][context[b] :] for b in range(2)])
    qo = indptr(new)
    qo_indptr = torch.tensor(qo, dtype=torch.int32)
    append_paged_kv(k_new, v_new, k_cache, v_cache, full.block_table, full.seq_lens, qo_indptr)

    for b, n in enumerate(full.seq_lens.tolist()):
        for pos in range(n):
            block = int(full.block_table[b, pos // page_size])
            assert torch.equal(k_cache[block, pos % page_size], full.keys[b][pos])
            assert torch.equal(v_cache[block, pos % page_size], full.values[b][pos])

    q = random_q(qo[-1], 4, torch.float32, seed=13)
    out = paged_prefill(q, k_cache, v_cache, full.block_table, full.seq_lens, qo_indptr)
    assert_matches(out, sdpa_prefill(q, qo, full), torch.float32)

    # decode: one more token per sequence; the table has a spare column for it
    gen = torch.Generator().manual_seed(14)
    k_next = torch.randn(2, 2, HEAD_DIM, generator=gen)
    v_next = torch.randn(2, 2, HEAD_DIM, generator=gen)
    lens = full.seq_lens + 1
    table = full.block_table.clone()
    spare = [b for b in range(k_cache.shape[0]) if b not in set(table.flatten().tolist())]
    for b, n in enumerate(full.seq_lens.tolist()):
        if n % page_size == 0:
            table[b, n // page_size] = spare.pop()
    step = torch.arange(3, dtype=torch.int32)
    append_paged_kv(k_next, v_next, k_cache, v_cache, table, lens, step)
    q = random_q(2, 4, torch.float32, seed=15)
    full.keys = [torch.cat([full.keys[b], k_next[b : b + 1]]) for b in range(2)]
    full.values = [torch.cat([full.values[b], v_next[b : b + 1]]) for b in range(2)]
    assert_matches(
        paged_decode(q, k_cache, v_cache, table, lens), sdpa_decode(q, full), torch.float32
    )


# -- backend choice and bad input ------------------------------------------------------


def small_decode_input(**changes: object) -> dict[str, object]:
    paged = make_paged([5, 9], 4)
    args: dict[str, object] = {
        "q": random_q(2, 4, torch.float32, seed=0),
        "k_cache": paged.k_cache,
        "v_cache": paged.v_cache,
        "block_table": paged.block_table,
        "seq_lens": paged.seq_lens,
    }
    args.update(changes)
    return args


def test_auto_on_cpu_picks_the_reference() -> None:
    args = small_decode_input()
    assert (
        select_backend("auto", args["q"], args["k_cache"], args["block_table"]).NAME == "reference"
    )


def test_unknown_backend_lists_the_accepted_ones() -> None:
    with pytest.raises(
        BackendError, match="unknown kernel backend 'cuda'.*auto, reference, triton"
    ):
        paged_decode(**small_decode_input(), backend="cuda")


def test_flashinfer_on_cpu_says_why() -> None:
    with pytest.raises(BackendError, match="'flashinfer' (is unavailable|cannot serve)"):
        paged_decode(**small_decode_input(), backend="flashinfer")


def test_flashinfer_names_what_it_cannot_serve() -> None:
    from kvplug.kernels import flashinfer_backend
    from kvplug.kernels.layout import PagedShape

    cuda = torch.device("cuda")
    shape = PagedShape(2, 8, 2, 128, 10, 24, 4)
    assert flashinfer_backend.unsupported(shape, torch.float16, cuda) is None
    assert "float16 or bfloat16" in flashinfer_backend.unsupported(shape, torch.float32, cuda)
    odd = PagedShape(2, 8, 2, 96, 10, 24, 4)
    assert "head_dim" in flashinfer_backend.unsupported(odd, torch.float16, cuda)
    assert "CUDA" in flashinfer_backend.unsupported(shape, torch.float16, torch.device("cpu"))


@pytest.mark.parametrize(
    ("changes", "message"),
    [
        ({"q": torch.zeros(2, 3, HEAD_DIM)}, "multiple of kv_heads"),
        ({"q": torch.zeros(2, 4, HEAD_DIM, dtype=torch.float16)}, "share one dtype"),
        ({"q": torch.zeros(2, 4, HEAD_DIM, dtype=torch.float64)}, "accepted: float32"),
        ({"q": torch.zeros(2, 4, 8)}, "head_dim=16"),
        ({"block_table": torch.zeros(2, 4, dtype=torch.int64)}, "block_table must be int32"),
        ({"seq_lens": torch.tensor([5, 0], dtype=torch.int32)}, "must be >= 1"),
        ({"seq_lens": torch.tensor([5, 99], dtype=torch.int32)}, "more than the block table"),
        ({"block_table": torch.full((2, 4), 77, dtype=torch.int32)}, r"block ids in use"),
        ({"v_cache": torch.zeros(3, 4, 2, HEAD_DIM)}, "v_cache shape"),
    ],
)
def test_bad_input_names_the_problem(changes: dict[str, object], message: str) -> None:
    with pytest.raises(KernelInputError, match=message):
        paged_decode(**small_decode_input(**changes))


def test_bad_qo_indptr_is_rejected() -> None:
    args = small_decode_input()
    cache = (args["k_cache"], args["v_cache"], args["block_table"], args["seq_lens"])  # [5, 9]
    q = random_q(4, 4, torch.float32, seed=0)
    with pytest.raises(KernelInputError, match="rise from 0"):
        paged_prefill(q, *cache, torch.tensor([0, 3, 3], dtype=torch.int32))
    q = random_q(8, 4, torch.float32, seed=0)
    with pytest.raises(KernelInputError, match="must fit in its seq_lens"):
        paged_prefill(q, *cache, torch.tensor([0, 6, 8], dtype=torch.int32))
