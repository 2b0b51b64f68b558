"""The reference backend: plain PyTorch gather and softmax, one sequence at a time.

It is the oracle the other backends are tested against, so it favours plain code over
speed: gather a sequence's pages in table order, drop the unused tail of the last page,
and compute softmax attention in float32. It runs on any device torch supports.
"""

from __future__ import annotations

import torch

from kvplug.kernels.layout import PagedShape, pages_per_sequence

NAME = "reference"


def unsupported(shape: PagedShape, dtype: torch.dtype, device: torch.device) -> str | None:
    """Why this backend cannot serve the call, or None. It serves every checked input."""
    return None


def gather_sequence(cache: torch.Tensor, table_row: torch.Tensor, seq_len: int) -> torch.Tensor:
    """One sequence's keys (or values) in position order: ``[seq_len, kv_heads, head_dim]``."""
    num_blocks, page_size, kv_heads, head_dim = cache.shape
    num_pages = int(pages_per_sequence(torch.tensor(seq_len), page_size))
    pages = cache[table_row[:num_pages].long()]  # [num_pages, page_size, kv_heads, head_dim]
    return pages.reshape(num_pages * page_size, kv_heads, head_dim)[:seq_len]


def attend(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float, causal: bool
) -> torch.Tensor:
    """Softmax attention of ``q [L, q_heads, D]`` over ``k, v [n, kv_heads, D]``.

    With `causal`, the L queries are the last L of the n positions (query ``i`` sits at
    position ``n - L + i``) and see only positions up to their own. Computed in float32,
    returned in q's dtype.
    """
    num_q, q_heads, head_dim = q.shape
    num_kv, kv_heads, _ = k.shape
    grouped = q.float().view(num_q, kv_heads, q_heads // kv_heads, head_dim)  # [L, K, G, D]
    scores = torch.einsum("lkgd,nkd->kgln", grouped, k.float()) * scale
    if causal:
        query_pos = torch.arange(num_kv - num_q, num_kv, device=q.device)
        key_pos = torch.arange(num_kv, device=q.device)
        scores = scores.masked_fill(key_pos[None, :] > query_pos[:, None], float("-inf"))
    weights = torch.softmax(scores, dim=-1)
    out = torch.einsum("kgln,nkd->lkgd", weights, v.float())
    return out.reshape(num_q, q_heads, head_dim).to(q.dtype)


def decode(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_table: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
) -> torch.Tensor:
    """One query token per sequence: ``q [batch, q_heads, D]`` -> ``[batch, q_heads, D]``."""
    out = torch.empty_like(q)
    for b, seq_len in enumerate(seq_lens.tolist()):
        k = gather_sequence(k_cache, block_table[b], seq_len)
        v = gather_sequence(v_cache, block_table[b], seq_len)
        out[b] = attend(q[b : b + 1], k, v, scale, causal=False)[0]
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
    """Causal attention of each sequence's new tokens over its whole cache.

    ``q [total_q, q_heads, D]`` -> the same shape; see `kvplug.kernels.layout`.
    """
    out = torch.empty_like(q)
    starts = qo_indptr.tolist()
    for b, seq_len in enumerate(seq_lens.tolist()):
        rows = slice(starts[b], starts[b + 1])
        if rows.start == rows.stop:
            continue
        k = gather_sequence(k_cache, block_table[b], seq_len)
        v = gather_sequence(v_cache, block_table[b], seq_len)
        out[rows] = attend(q[rows], k, v, scale, causal=True)
    return out
