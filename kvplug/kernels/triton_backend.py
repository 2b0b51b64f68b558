"""The Triton backend: one kernel code path for every page size.

The page size is a run-time argument, not a compile-time constant. A kernel walks a
sequence in tiles of ``BLOCK_N`` logical positions and, for each position ``p``, loads
block id ``block_table[b, p // page_size]`` and reads slot ``p % page_size`` of that
block. So page sizes 1, 24 or 256 take the same path, and a tile may span many pages or
part of one. Positions past the sequence are masked out of every load, so unused slots
(even NaN ones) are never read.

Decode runs in two kernels (split-KV, as FlashInfer does):

1. `_decode_split_kernel`, one program per (sequence, KV head, split): the query heads
   that share the KV head attend over one contiguous range of positions and write an
   unnormalised partial result, its running max and its softmax denominator;
2. `_decode_merge_kernel`, one program per (sequence, query head): rescales and adds the
   partial results. Splits keep a GPU busy when the batch is small and sequences long.

Prefill (`_prefill_kernel`) runs one program per (sequence, query head, tile of
``BLOCK_M`` new tokens) with a causal mask by position.

Scores are kept in log2 units (scaled by ``scale * log2(e)``) so the kernels use exp2.
Under ``TRITON_INTERPRET=1`` the kernels run on CPU tensors; otherwise on CUDA tensors.
Whether they are interpreted is fixed when this module is imported.
"""

from __future__ import annotations

import math
import os

import torch
import triton
import triton.language as tl

from kvplug.kernels.layout import PagedShape

NAME = "triton"

INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"
LOG2_E = 1.4426950408889634

# Tile sizes: tokens per decode/prefill step, and new tokens per prefill program.
DECODE_BLOCK_N = 64
PREFILL_BLOCK_M = 32
PREFILL_BLOCK_N = 32
MAX_SPLITS = 64


def unsupported(shape: PagedShape, dtype: torch.dtype, device: torch.device) -> str | None:
    """Why this backend cannot serve the call, or None."""
    if INTERPRETED and device.type != "cpu":
        return (
            "the Triton kernels were loaded in interpreter mode (TRITON_INTERPRET=1), "
            f"which runs on CPU tensors, but the tensors are on {device}"
        )
    if not INTERPRETED and device.type != "cuda":
        return (
            f"Triton kernels need CUDA tensors, got {device}; set TRITON_INTERPRET=1 "
            "before importing kvplug's kernels to run them on CPU"
        )
    if shape.head_dim > 256:
        return f"head_dim {shape.head_dim} > 256 is not supported"
    return None


def _dot_dtype(dtype: torch.dtype) -> tl.dtype:
    """The dtype fed to ``tl.dot``: the cache dtype, except bfloat16 in the interpreter.

    The interpreter stores bfloat16 as raw 16-bit integers and its ``tl.dot`` multiplies
    those integers, so interpreted bfloat16 tiles are upcast to float32 first.
    """
    if dtype == torch.float32 or (INTERPRETED and dtype == torch.bfloat16):
        return tl.float32
    return tl.float16 if dtype == torch.float16 else tl.bfloat16


def _dot_precision(dtype: torch.dtype) -> str:
    """IEEE float32 products for float32 inputs (the default, tf32, loses ~3 digits)."""
    return "ieee" if _dot_dtype(dtype) == tl.float32 else "tf32"


@triton.jit
def _load_tokens(
    cache_ptr,
    table_row_ptr,
    pos,
    valid,
    kv_head,
    dims,
    dim_ok,
    page_size,
    stride_block,
    stride_slot,
    stride_head,
):
    """Gather ``cache[table[pos // page_size], pos % page_size, kv_head, dims]``."""
    block = tl.load(table_row_ptr + pos // page_size, mask=valid, other=0).to(tl.int64)
    slot = pos % page_size
    offsets = block[:, None] * stride_block + slot[:, None] * stride_slot + dims[None, :]
    return tl.load(
        cache_ptr + kv_head * stride_head + offsets,
        mask=valid[:, None] & dim_ok[None, :],
        other=0.0,
    )


@triton.jit
def _decode_split_kernel(
    q_ptr,
    k_ptr,
    v_ptr,
    table_ptr,
    seq_lens_ptr,
    part_acc_ptr,  # float32 [batch, q_heads, num_splits, BLOCK_D]
    part_max_ptr,  # float32 [batch, q_heads, num_splits]
    part_sum_ptr,  # float32 [batch, q_heads, num_splits]
    scale_log2,
    page_size,
    tokens_per_split,
    num_splits,
    q_heads,
    stride_qb,
    stride_qh,
    stride_kb,
    stride_ks,
    stride_kh,
    stride_vb,
    stride_vs,
    stride_vh,
    stride_table,
    GROUP: tl.constexpr,
    GROUP_P: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_N: tl.constexpr,
    DOT_DTYPE: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
):
    b = tl.program_id(0)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)
    seq_len = tl.load(seq_lens_ptr + b)
    start = split * tokens_per_split
    end = tl.minimum(seq_len, start + tokens_per_split)

    rows = tl.arange(0, GROUP_P)  # query heads of this KV head, padded for tl.dot
    row_ok = rows < GROUP
    heads = kv_head * GROUP + rows
    dims = tl.arange(0, BLOCK_D)
    dim_ok = dims < HEAD_DIM
    q = tl.load(
        q_ptr + b * stride_qb + heads[:, None] * stride_qh + dims[None, :],
        mask=row_ok[:, None] & dim_ok[None, :],
        other=0.0,
    ).to(DOT_DTYPE)

    running_max = tl.full([GROUP_P], float("-inf"), tl.float32)
    denominator = tl.zeros([GROUP_P], tl.float32)
    acc = tl.zeros([GROUP_P, BLOCK_D], tl.float32)
    table_row = table_ptr + b * stride_table
    for tile in range(start, end, BLOCK_N):
        pos = tile + tl.arange(0, BLOCK_N)
        valid = pos < end
        k = _load_tokens(
            k_ptr, table_row, pos, valid, kv_head, dims, dim_ok, page_size,
            stride_kb, stride_ks, stride_kh,
        )  # fmt: skip
        scores = tl.dot(q, tl.trans(k.to(DOT_DTYPE)), input_precision=DOT_PRECISION)
        scores = tl.where(valid[None, :], scores * scale_log2, float("-inf"))
        # every tile holds a valid position, so new_max is finite
        new_max = tl.maximum(running_max, tl.max(scores, 1))
        rescale = tl.exp2(running_max - new_max)
        p = tl.exp2(scores - new_max[:, None])
        denominator = denominator * rescale + tl.sum(p, 1)
        v = _load_tokens(
            v_ptr, table_row, pos, valid, kv_head, dims, dim_ok, page_size,
            stride_vb, stride_vs, stride_vh,
        )  # fmt: skip
        acc = acc * rescale[:, None] + tl.dot(
            p.to(DOT_DTYPE), v.to(DOT_DTYPE), input_precision=DOT_PRECISION
        )
        running_max = new_max

    # An empty split (start >= seq_len) stores max -inf and sum 0: the merge weighs it 0.
    part = (b * q_heads + heads) * num_splits + split
    tl.store(part_max_ptr + part, running_max, mask=row_ok)
    tl.store(part_sum_ptr + part, denominator, mask=row_ok)
    tl.store(
        part_acc_ptr + part[:, None] * BLOCK_D + dims[None, :],
        acc,
        mask=row_ok[:, None] & dim_ok[None, :],
    )


@triton.jit
def _decode_merge_kernel(
    part_acc_ptr,
    part_max_ptr,
    part_sum_ptr,
    out_ptr,
    num_splits,
    q_heads,
    stride_ob,
    stride_oh,
    HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_S: tl.constexpr,
):
    b = tl.program_id(0)
    head = tl.program_id(1)
    splits = tl.arange(0, BLOCK_S)
    split_ok = splits < num_splits
    dims = tl.arange(0, BLOCK_D)
    dim_ok = dims < HEAD_DIM
    part = (b * q_heads + head) * num_splits + splits
    maxes = tl.load(part_max_ptr + part, mask=split_ok, other=float("-inf"))
    sums = tl.load(part_sum_ptr + part, mask=split_ok, other=0.0)
    accs = tl.load(
        part_acc_ptr + part[:, None] * BLOCK_D + dims[None, :],
        mask=split_ok[:, None] & dim_ok[None, :],
        other=0.0,
    )
    weight = tl.exp2(maxes - tl.max(maxes, 0))  # split 0 is never empty: the max is finite
    out = tl.sum(weight[:, None] * accs, 0) / tl.sum(weight * sums, 0)
    tl.store(
        out_ptr + b * stride_ob + head * stride_oh + dims,
        out.to(out_ptr.dtype.element_ty),
        mask=dim_ok,
    )


@triton.jit
def _prefill_kernel(
    q_ptr,
    k_ptr,
    v_ptr,
    out_ptr,
    table_ptr,
    seq_lens_ptr,
    qo_indptr_ptr,
    scale_log2,
    page_size,
    stride_qt,
    stride_qh,
    stride_ot,
    stride_oh,
    stride_kb,
    stride_ks,
    stride_kh,
    stride_vb,
    stride_vs,
    stride_vh,
    stride_table,
    GROUP: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    DOT_DTYPE: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
):
    b = tl.program_id(0)
    head = tl.program_id(1)
    q_tile = tl.program_id(2)
    kv_head = head // GROUP
    q_start = tl.load(qo_indptr_ptr + b)
    q_len = tl.load(qo_indptr_ptr + b + 1) - q_start
    seq_len = tl.load(seq_lens_ptr + b)
    context = seq_len - q_len  # cached tokens before the first new one

    rows = q_tile * BLOCK_M + tl.arange(0, BLOCK_M)
    row_ok = rows < q_len
    query_pos = context + rows
    dims = tl.arange(0, BLOCK_D)
    dim_ok = dims < HEAD_DIM
    q = tl.load(
        q_ptr + (q_start + rows)[:, None] * stride_qt + head * stride_qh + dims[None, :],
        mask=row_ok[:, None] & dim_ok[None, :],
        other=0.0,
    ).to(DOT_DTYPE)

    # Keys up to this tile's last query position; none if the tile is past q_len.
    end = tl.minimum(seq_len, context + (q_tile + 1) * BLOCK_M)
    end = tl.where(q_tile * BLOCK_M < q_len, end, 0)
    running_max = tl.full([BLOCK_M], float("-inf"), tl.float32)
    denominator = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    table_row = table_ptr + b * stride_table
    for tile in range(0, end, BLOCK_N):
        pos = tile + tl.arange(0, BLOCK_N)
        valid = pos < end
        k = _load_tokens(
            k_ptr, table_row, pos, valid, kv_head, dims, dim_ok, page_size,
            stride_kb, stride_ks, stride_kh,
        )  # fmt: skip
        scores = tl.dot(q, tl.trans(k.to(DOT_DTYPE)), input_precision=DOT_PRECISION)
        visible = valid[None, :] & (pos[None, :] <= query_pos[:, None])
        scores = tl.where(visible, scores * scale_log2, float("-inf"))
        # position 0 is visible to every row, so after the first tile every max is finite
        new_max = tl.maximum(running_max, tl.max(scores, 1))
        rescale = tl.exp2(running_max - new_max)
        p = tl.exp2(scores - new_max[:, None])
        denominator = denominator * rescale + tl.sum(p, 1)
        v = _load_tokens(
            v_ptr, table_row, pos, valid, kv_head, dims, dim_ok, page_size,
            stride_vb, stride_vs, stride_vh,
        )  # fmt: skip
        acc = acc * rescale[:, None] + tl.dot(
            p.to(DOT_DTYPE), v.to(DOT_DTYPE), input_precision=DOT_PRECISION
        )
        running_max = new_max

    # Rows of a tile past the new tokens saw no key (denominator 0); they are not stored.
    out = acc / tl.where(denominator > 0, denominator, 1.0)[:, None]
    tl.store(
        out_ptr + (q_start + rows)[:, None] * stride_ot + head * stride_oh + dims[None, :],
        out.to(out_ptr.dtype.element_ty),
        mask=row_ok[:, None] & dim_ok[None, :],
    )


def _dot_width(n: int) -> int:
    """A power of two >= n and >= 16, the smallest tile side ``tl.dot`` accepts."""
    return max(16, triton.next_power_of_2(n))


def _dense_rows(t: torch.Tensor) -> torch.Tensor:
    """`t` itself if its last dimension is contiguous (the kernels assume it), else a copy."""
    return t if t.stride(-1) == 1 else t.contiguous()


def choose_num_splits(shape: PagedShape, device: torch.device) -> int:
    """Splits per sequence for decode: enough programs to fill a GPU about twice.

    Uses the block table's capacity, not the actual lengths, so it needs no host sync;
    splits past a sequence's end do no work. The interpreter runs one split.
    """
    if device.type != "cuda":
        return 1
    programs = shape.batch * shape.kv_heads
    sms = torch.cuda.get_device_properties(device).multi_processor_count
    most = min(MAX_SPLITS, math.ceil(shape.max_tokens / DECODE_BLOCK_N))
    return max(1, min(most, math.ceil(2 * sms / max(programs, 1))))


def decode(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_table: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
    *,
    num_splits: int | None = None,
) -> torch.Tensor:
    """Paged decode; see `kvplug.kernels.paged_decode`. Inputs are assumed checked."""
    batch, q_heads, head_dim = q.shape
    _, page_size, kv_heads, _ = k_cache.shape
    shape = PagedShape(
        batch, q_heads, kv_heads, head_dim, k_cache.shape[0], page_size, block_table.shape[1]
    )
    splits = num_splits or choose_num_splits(shape, q.device)
    per_split = math.ceil(shape.max_tokens / splits / DECODE_BLOCK_N) * DECODE_BLOCK_N
    q, k_cache, v_cache = (_dense_rows(t) for t in (q, k_cache, v_cache))
    block_table = block_table.contiguous()
    block_d = _dot_width(head_dim)
    group = q_heads // kv_heads
    part_acc = torch.empty(batch, q_heads, splits, block_d, device=q.device, dtype=torch.float32)
    part_max = torch.empty(batch, q_heads, splits, device=q.device, dtype=torch.float32)
    part_sum = torch.empty_like(part_max)
    out = torch.empty_like(q)
    _decode_split_kernel[(batch, kv_heads, splits)](
        q, k_cache, v_cache, block_table, seq_lens,
        part_acc, part_max, part_sum,
        scale * LOG2_E, page_size, per_split, splits, q_heads,
        q.stride(0), q.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        v_cache.stride(0), v_cache.stride(1), v_cache.stride(2),
        block_table.stride(0),
        GROUP=group, GROUP_P=_dot_width(group), HEAD_DIM=head_dim, BLOCK_D=block_d,
        BLOCK_N=DECODE_BLOCK_N, DOT_DTYPE=_dot_dtype(q.dtype),
        DOT_PRECISION=_dot_precision(q.dtype),
    )  # fmt: skip
    _decode_merge_kernel[(batch, q_heads)](
        part_acc, part_max, part_sum, out, splits, q_heads, out.stride(0), out.stride(1),
        HEAD_DIM=head_dim, BLOCK_D=block_d, BLOCK_S=triton.next_power_of_2(splits),
    )  # fmt: skip
    return out


def prefill(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_table: torch.Tensor,
    seq_lens: torch.Tensor,
    qo_indptr: torch.Tensor,
    scale: float,
) -> torch.Tensor:
    """Paged causal prefill; see `kvplug.kernels.paged_prefill`. Inputs are assumed checked.

    Reads the longest query length to the host to size the grid.
    """
    total_q, q_heads, head_dim = q.shape
    _, page_size, kv_heads, _ = k_cache.shape
    batch = block_table.shape[0]
    q, k_cache, v_cache = (_dense_rows(t) for t in (q, k_cache, v_cache))
    block_table = block_table.contiguous()
    out = torch.empty_like(q)
    longest = int((qo_indptr[1:] - qo_indptr[:-1]).max()) if batch else 0
    if longest == 0:
        return out
    grid = (batch, q_heads, triton.cdiv(longest, PREFILL_BLOCK_M))
    _prefill_kernel[grid](
        q, k_cache, v_cache, out, block_table, seq_lens, qo_indptr,
        scale * LOG2_E, page_size,
        q.stride(0), q.stride(1), out.stride(0), out.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        v_cache.stride(0), v_cache.stride(1), v_cache.stride(2),
        block_table.stride(0),
        GROUP=q_heads // kv_heads, HEAD_DIM=head_dim, BLOCK_D=_dot_width(head_dim),
        BLOCK_M=PREFILL_BLOCK_M, BLOCK_N=PREFILL_BLOCK_N, DOT_DTYPE=_dot_dtype(q.dtype),
        DOT_PRECISION=_dot_precision(q.dtype),
    )  # fmt: skip
    return out
