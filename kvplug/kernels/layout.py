"""The paged KV layout every backend shares: checks, token slots, FlashInfer metadata.

Layout (the same for every backend and every page size):

- ``k_cache``, ``v_cache``: ``[num_blocks, page_size, kv_heads, head_dim]``. Block ``i``
  holds ``page_size`` consecutive token positions of one sequence.
- ``block_table``: int32 ``[batch, max_blocks]``. Row ``b`` lists the blocks of sequence
  ``b`` in position order: position ``p`` lives in block ``block_table[b, p // page_size]``
  at slot ``p % page_size``. Only the first ``ceil(seq_lens[b] / page_size)`` entries of a
  row are read; the rest may hold anything.
- ``seq_lens``: int32 ``[batch]``, the tokens in the cache for each sequence, counting the
  tokens of the current step (its new keys and values are written first).
- ``qo_indptr`` (prefill and append): int32 ``[batch + 1]``; sequence ``b``'s new tokens are
  rows ``qo_indptr[b]:qo_indptr[b + 1]`` of ``q`` (and of the new ``k``/``v``). They are its
  last positions: new token ``i`` of a sequence with ``n`` new tokens sits at position
  ``seq_lens[b] - n + i``.

Slots past a sequence's length are never read, so they may hold anything, NaN included.
This module imports torch; `kvplug.kernels` imports it only when a kernel is called.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kvplug.kernels import KernelInputError

SUPPORTED_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


@dataclass(frozen=True)
class PagedShape:
    """The sizes of one paged-attention call, read from its tensors."""

    batch: int
    q_heads: int
    kv_heads: int
    head_dim: int
    num_blocks: int
    page_size: int
    max_blocks: int  # block_table columns

    @property
    def group_size(self) -> int:
        """Query heads that share one KV head (1 for multi-head attention)."""
        return self.q_heads // self.kv_heads

    @property
    def max_tokens(self) -> int:
        """The longest sequence the block table can address."""
        return self.max_blocks * self.page_size


def check_inputs(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_table: torch.Tensor,
    seq_lens: torch.Tensor,
    qo_indptr: torch.Tensor | None = None,
    *,
    check_values: bool = True,
) -> PagedShape:
    """Check a decode (``qo_indptr is None``) or prefill call; return its sizes.

    Raises `KernelInputError` naming the first problem found. Shapes and dtypes are always
    checked; with `check_values` the lengths and the block ids in use are checked too,
    which reads them to the host (a synchronisation on a GPU).
    """
    if k_cache.dim() != 4:
        raise KernelInputError(
            "k_cache must be [num_blocks, page_size, kv_heads, head_dim], "
            f"got shape {tuple(k_cache.shape)}"
        )
    if v_cache.shape != k_cache.shape:
        raise KernelInputError(
            f"v_cache shape {tuple(v_cache.shape)} != k_cache shape {tuple(k_cache.shape)}"
        )
    num_blocks, page_size, kv_heads, head_dim = k_cache.shape
    if q.dim() != 3 or q.shape[2] != head_dim:
        rows = "batch" if qo_indptr is None else "total_q_tokens"
        raise KernelInputError(
            f"q must be [{rows}, q_heads, head_dim={head_dim}], got shape {tuple(q.shape)}"
        )
    q_heads = q.shape[1]
    if kv_heads == 0 or q_heads % kv_heads:
        raise KernelInputError(f"q_heads ({q_heads}) must be a multiple of kv_heads ({kv_heads})")
    if q.dtype not in SUPPORTED_DTYPES:
        raise KernelInputError(
            f"dtype {q.dtype} is not supported; accepted: float32, float16, bfloat16"
        )
    if k_cache.dtype != q.dtype or v_cache.dtype != q.dtype:
        raise KernelInputError(
            f"q, k_cache and v_cache must share one dtype, got "
            f"{q.dtype}, {k_cache.dtype}, {v_cache.dtype}"
        )
    devices = {t.device for t in (q, k_cache, v_cache, block_table, seq_lens)}
    if qo_indptr is not None:
        devices.add(qo_indptr.device)
    if len(devices) > 1:
        names = sorted(map(str, devices))
        raise KernelInputError(f"all tensors must be on one device, got {names}")
    if block_table.dim() != 2 or block_table.dtype != torch.int32:
        raise KernelInputError(
            "block_table must be int32 [batch, max_blocks], got "
            f"{block_table.dtype} shape {tuple(block_table.shape)}"
        )
    batch = block_table.shape[0]
    if seq_lens.shape != (batch,) or seq_lens.dtype != torch.int32:
        raise KernelInputError(
            f"seq_lens must be int32 [batch={batch}], got {seq_lens.dtype} "
            f"shape {tuple(seq_lens.shape)}"
        )
    if qo_indptr is None:
        if q.shape[0] != batch:
            raise KernelInputError(f"decode q has {q.shape[0]} rows but the batch is {batch}")
    elif qo_indptr.shape != (batch + 1,) or qo_indptr.dtype != torch.int32:
        raise KernelInputError(
            f"qo_indptr must be int32 [batch + 1 = {batch + 1}], got {qo_indptr.dtype} "
            f"shape {tuple(qo_indptr.shape)}"
        )
    shape = PagedShape(
        batch, q_heads, kv_heads, head_dim, num_blocks, page_size, block_table.shape[1]
    )
    if check_values:
        _check_values(shape, q, block_table, seq_lens, qo_indptr)
    return shape


def _check_values(
    shape: PagedShape,
    q: torch.Tensor,
    block_table: torch.Tensor,
    seq_lens: torch.Tensor,
    qo_indptr: torch.Tensor | None,
) -> None:
    lens = seq_lens.cpu()
    if shape.batch and int(lens.min()) < 1:
        raise KernelInputError(f"every seq_lens entry must be >= 1, got {lens.tolist()}")
    if shape.batch and int(lens.max()) > shape.max_tokens:
        raise KernelInputError(
            f"seq_lens up to {int(lens.max())} need more than the block table's "
            f"{shape.max_blocks} blocks of {shape.page_size} tokens ({shape.max_tokens})"
        )
    if qo_indptr is not None:
        indptr = qo_indptr.cpu()
        q_lens = indptr[1:] - indptr[:-1]
        if int(indptr[0]) != 0 or int(indptr[-1]) != q.shape[0] or bool((q_lens < 0).any()):
            raise KernelInputError(
                f"qo_indptr must rise from 0 to q's {q.shape[0]} rows, got {indptr.tolist()}"
            )
        if bool((q_lens > lens).any()):
            raise KernelInputError(
                "each sequence's new tokens must fit in its seq_lens (which counts them): "
                f"new {q_lens.tolist()} vs seq_lens {lens.tolist()}"
            )
    used = used_entries(block_table.cpu(), lens, shape.page_size)
    if used.numel() and (int(used.min()) < 0 or int(used.max()) >= shape.num_blocks):
        raise KernelInputError(
            f"block ids in use must be in [0, {shape.num_blocks}), got "
            f"{int(used.min())}..{int(used.max())}"
        )


def pages_per_sequence(seq_lens: torch.Tensor, page_size: int) -> torch.Tensor:
    """``ceil(seq_lens / page_size)``: the blocks each sequence occupies."""
    return (seq_lens + page_size - 1) // page_size


def used_entries(block_table: torch.Tensor, seq_lens: torch.Tensor, page_size: int) -> torch.Tensor:
    """The block ids in use, sequence after sequence, in position order (1-D)."""
    pages = pages_per_sequence(seq_lens, page_size)
    columns = torch.arange(block_table.shape[1], device=block_table.device)
    return block_table[columns[None, :] < pages[:, None]]


@dataclass(frozen=True)
class FlashInferPages:
    """A block table in FlashInfer's paged-KV format (all int32, on the table's device).

    ``indices[indptr[b]:indptr[b + 1]]`` are sequence ``b``'s pages in order, and its last
    page holds ``last_page_len[b]`` tokens, from 1 to ``page_size``.
    """

    indptr: torch.Tensor  # [batch + 1]
    indices: torch.Tensor  # [indptr[-1]]
    last_page_len: torch.Tensor  # [batch]


def flashinfer_pages(
    block_table: torch.Tensor, seq_lens: torch.Tensor, page_size: int
) -> FlashInferPages:
    """Convert a block table and sequence lengths (each >= 1) to FlashInfer's format."""
    pages = pages_per_sequence(seq_lens, page_size)
    indptr = torch.zeros(len(seq_lens) + 1, dtype=torch.int32, device=seq_lens.device)
    indptr[1:] = torch.cumsum(pages, 0)
    indices = used_entries(block_table, seq_lens, page_size).to(torch.int32)
    last_page_len = (seq_lens - (pages - 1) * page_size).to(torch.int32)
    return FlashInferPages(indptr, indices, last_page_len)


def token_pages_to_pages(
    token_indptr: torch.Tensor, token_indices: torch.Tensor, page_size: int
) -> FlashInferPages:
    """Regroup token-granular KV metadata (page size 1) into pages of `page_size` tokens.

    This is how SGLang describes its cache to FlashInfer: one entry per token, where with
    ``--page-size P`` token slot ``s`` lives in page ``s // P`` at offset ``s % P`` and a
    sequence's tokens fill its pages in order. Each sequence must hold >= 1 token.
    """
    lens = token_indptr[1:] - token_indptr[:-1]
    sequence = torch.repeat_interleave(torch.arange(len(lens), device=lens.device), lens)
    position = torch.arange(len(token_indices), device=lens.device) - token_indptr[sequence]
    first_in_page = position % page_size == 0
    indices = (token_indices[first_in_page] // page_size).to(torch.int32)
    pages = pages_per_sequence(lens, page_size)
    indptr = torch.zeros_like(token_indptr, dtype=torch.int32)
    indptr[1:] = torch.cumsum(pages, 0)
    last_page_len = (lens - (pages - 1) * page_size).to(torch.int32)
    return FlashInferPages(indptr, indices, last_page_len)


def new_token_slots(
    block_table: torch.Tensor,
    seq_lens: torch.Tensor,
    qo_indptr: torch.Tensor,
    page_size: int,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The (block id, slot) of each new token, as two int64 tensors of ``qo_indptr[-1]``.

    New tokens are a sequence's last ones: token ``i`` of ``n`` new tokens of sequence
    ``b`` lands at position ``seq_lens[b] - n + i``.
    """
    q_lens = qo_indptr[1:] - qo_indptr[:-1]
    sequence = torch.repeat_interleave(torch.arange(len(q_lens), device=q_lens.device), q_lens)
    index_in_step = torch.arange(int(qo_indptr[-1]), device=q_lens.device) - qo_indptr[sequence]
    position = (seq_lens - q_lens)[sequence] + index_in_step
    blocks = block_table[sequence, position // page_size].long()
    return blocks, (position % page_size).long()
