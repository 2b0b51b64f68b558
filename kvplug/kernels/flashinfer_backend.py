"""The FlashInfer backend: kvplug's block table on FlashInfer's paged wrappers (CUDA only).

FlashInfer's FA2/FA3 paged kernels take the page size at run time. They describe a batch
as ``indptr`` / ``indices`` / ``last_page_len`` (see
`kvplug.kernels.layout.flashinfer_pages`) and read the caches as the ``(k_cache,
v_cache)`` tuple in "NHD" layout, which is exactly kvplug's
``[num_blocks, page_size, kv_heads, head_dim]``. So the only translation is the metadata.

A wrapper is planned once per batch (``plan``) and then run once per layer (``run``);
`PagedDecoder` and `PagedPrefiller` keep that split so a benchmark can time ``run``
alone. `decode` and `prefill` plan and run in one call. ``flashinfer`` is imported when
a wrapper is first built, never when this module is imported.
"""

from __future__ import annotations

from typing import Any

import torch

from kvplug.kernels.layout import FlashInferPages, PagedShape, flashinfer_pages

NAME = "flashinfer"

SUPPORTED_DTYPES = (torch.float16, torch.bfloat16)
SUPPORTED_HEAD_DIMS = (64, 128, 256)
WORKSPACE_BYTES = 128 * 1024 * 1024  # FlashInfer's recommended split-KV scratch space

_workspaces: dict[torch.device, torch.Tensor] = {}


def unsupported(shape: PagedShape, dtype: torch.dtype, device: torch.device) -> str | None:
    """Why FlashInfer cannot serve the call, or None."""
    if device.type != "cuda":
        return f"FlashInfer runs only on CUDA tensors, got {device}"
    if dtype not in SUPPORTED_DTYPES:
        return f"FlashInfer's paged kernels take float16 or bfloat16, got {dtype}"
    if shape.head_dim not in SUPPORTED_HEAD_DIMS:
        return f"FlashInfer serves head_dim {SUPPORTED_HEAD_DIMS}, got {shape.head_dim}"
    return None


def _workspace(device: torch.device) -> torch.Tensor:
    """One zeroed workspace per device, shared by every wrapper (as engines do)."""
    if device not in _workspaces:
        _workspaces[device] = torch.zeros(WORKSPACE_BYTES, dtype=torch.uint8, device=device)
    return _workspaces[device]


class PagedDecoder:
    """A FlashInfer decode wrapper planned for one batch's block table."""

    def __init__(
        self,
        block_table: torch.Tensor,
        seq_lens: torch.Tensor,
        *,
        q_heads: int,
        kv_heads: int,
        head_dim: int,
        page_size: int,
        dtype: torch.dtype,
        scale: float,
    ) -> None:
        import flashinfer

        self.pages: FlashInferPages = flashinfer_pages(block_table, seq_lens, page_size)
        # Tensor-core decode is faster for large GQA groups (vLLM's rule of thumb).
        self.wrapper: Any = flashinfer.BatchDecodeWithPagedKVCacheWrapper(
            _workspace(block_table.device), "NHD", use_tensor_cores=q_heads // kv_heads > 4
        )
        self.wrapper.plan(
            self.pages.indptr,
            self.pages.indices,
            self.pages.last_page_len,
            q_heads,
            kv_heads,
            head_dim,
            page_size,
            q_data_type=dtype,
            kv_data_type=dtype,
            sm_scale=scale,
        )

    def run(self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor) -> torch.Tensor:
        """``q [batch, q_heads, head_dim]`` -> ``[batch, q_heads, head_dim]``."""
        return self.wrapper.run(q, (k_cache, v_cache))


class PagedPrefiller:
    """A FlashInfer causal prefill/append wrapper planned for one batch."""

    def __init__(
        self,
        block_table: torch.Tensor,
        seq_lens: torch.Tensor,
        qo_indptr: torch.Tensor,
        *,
        q_heads: int,
        kv_heads: int,
        head_dim: int,
        page_size: int,
        dtype: torch.dtype,
        scale: float,
    ) -> None:
        import flashinfer

        self.pages = flashinfer_pages(block_table, seq_lens, page_size)
        self.wrapper: Any = flashinfer.BatchPrefillWithPagedKVCacheWrapper(
            _workspace(block_table.device), "NHD"
        )
        # FlashInfer's causal mask aligns queries to the end of the KV, as kvplug's does.
        self.wrapper.plan(
            qo_indptr,
            self.pages.indptr,
            self.pages.indices,
            self.pages.last_page_len,
            q_heads,
            kv_heads,
            head_dim,
            page_size,
            causal=True,
            sm_scale=scale,
            q_data_type=dtype,
            kv_data_type=dtype,
        )

    def run(self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor) -> torch.Tensor:
        """``q [total_q, q_heads, head_dim]`` -> the same shape."""
        return self.wrapper.run(q, (k_cache, v_cache))


def decode(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_table: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
) -> torch.Tensor:
    """Plan and run one decode step; see `kvplug.kernels.paged_decode`."""
    _, page_size, kv_heads, head_dim = k_cache.shape
    decoder = PagedDecoder(
        block_table,
        seq_lens,
        q_heads=q.shape[1],
        kv_heads=kv_heads,
        head_dim=head_dim,
        page_size=page_size,
        dtype=q.dtype,
        scale=scale,
    )
    return decoder.run(q, k_cache, v_cache)


def prefill(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_table: torch.Tensor,
    seq_lens: torch.Tensor,
    qo_indptr: torch.Tensor,
    scale: float,
) -> torch.Tensor:
    """Plan and run one causal prefill; see `kvplug.kernels.paged_prefill`."""
    _, page_size, kv_heads, head_dim = k_cache.shape
    prefiller = PagedPrefiller(
        block_table,
        seq_lens,
        qo_indptr,
        q_heads=q.shape[1],
        kv_heads=kv_heads,
        head_dim=head_dim,
        page_size=page_size,
        dtype=q.dtype,
        scale=scale,
    )
    return prefiller.run(q, k_cache, v_cache)
