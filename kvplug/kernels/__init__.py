"""Paged-attention kernels for any page size: a torch reference, Triton and FlashInfer.

Public API (see `kvplug.kernels.layout` for the cache layout and the shapes):

- `paged_decode(q, k_cache, v_cache, block_table, seq_lens)`: one new token per sequence;
- `paged_prefill(q, k_cache, v_cache, block_table, seq_lens, qo_indptr)`: several new
  tokens per sequence after its cached context, causal;
- `append_paged_kv(k, v, k_cache, v_cache, block_table, seq_lens, qo_indptr)`: write the
  new tokens' keys and values through the block table (before attending to them);
- `available_backends()`: each backend, "available" or why not.

Backends: ``reference`` (plain PyTorch, the oracle), ``triton`` (one code path for every
page size) and ``flashinfer`` (FlashInfer's paged wrappers, CUDA only). ``backend="auto"``
takes the fastest one that can serve the call: on CUDA tensors flashinfer, then triton,
then reference; on CPU tensors the reference (the Triton interpreter is far slower). A
named backend that is unavailable or cannot serve the input raises `BackendError` saying
why; malformed input raises `KernelInputError`.

Importing this package imports no torch and no kernel library; the first kernel call
does.

| module | owns |
|---|---|
| `__init__` | the public API, backend discovery and selection (``auto``), the errors |
| `layout` | the paged KV layout all backends share: checks, token slots, FlashInfer metadata |
| `reference` | the plain-PyTorch backend, the oracle the others are tested against |
| `triton_backend` | the Triton kernels: one code path for every page size |
| `flashinfer_backend` | kvplug's block table on FlashInfer's paged wrappers (CUDA only) |
| `engine_hooks` | letting vLLM and SGLang run FlashInfer at any page size (GPU only, untested) |
"""

from __future__ import annotations

import importlib
import importlib.util
import math
import os
from types import ModuleType
from typing import TYPE_CHECKING

from kvplug.errors import KVPlugError

if TYPE_CHECKING:
    import torch

AVAILABLE = "available"
BACKENDS = ("reference", "triton", "flashinfer")
_MODULES = {
    "reference": "kvplug.kernels.reference",
    "triton": "kvplug.kernels.triton_backend",
    "flashinfer": "kvplug.kernels.flashinfer_backend",
}


class BackendError(KVPlugError, RuntimeError):
    """A kernel backend that is unknown, not available here, or cannot serve the input."""


class KernelInputError(KVPlugError, ValueError):
    """Tensors that do not form a valid paged-attention input (shape, dtype or values)."""


def _installed(module: str) -> bool:
    try:
        return importlib.util.find_spec(module) is not None
    except (ImportError, ValueError):
        return False


def _torch_sees_gpu() -> bool | str:
    """Whether torch sees a CUDA GPU, or why torch would not import. Imports torch."""
    try:
        import torch
    except Exception as exc:  # a broken torch install is a reason, not a crash
        return f"torch failed to import: {type(exc).__name__}: {exc}"
    return torch.cuda.is_available()


def available_backends() -> dict[str, str]:
    """Map each backend ("reference", "triton", "flashinfer") to "available" or why not.

    Installation is checked with `find_spec`; torch is imported, in this process, only
    when triton or flashinfer is installed and the answer depends on seeing a GPU.
    """
    if not _installed("torch"):
        return dict.fromkeys(BACKENDS, "torch not installed")
    has_triton, has_flashinfer = _installed("triton"), _installed("flashinfer")
    interpret = os.environ.get("TRITON_INTERPRET") == "1"
    gpu: bool | str = False
    if (has_triton and not interpret) or has_flashinfer:
        gpu = _torch_sees_gpu()

    def needing_gpu(installed: bool, name: str, no_gpu: str) -> str:
        if not installed:
            return f"{name} not installed"
        if isinstance(gpu, str):
            return gpu
        return AVAILABLE if gpu else no_gpu

    if has_triton and interpret:
        triton = AVAILABLE  # the Triton interpreter runs kernels on CPU tensors
    else:
        triton = needing_gpu(
            has_triton,
            "triton",
            "triton installed but no GPU; set TRITON_INTERPRET=1 to run on CPU",
        )
    flashinfer = needing_gpu(has_flashinfer, "flashinfer", "flashinfer needs a CUDA GPU")
    return {"reference": AVAILABLE, "triton": triton, "flashinfer": flashinfer}


def select_backend(
    backend: str,
    q: torch.Tensor,
    k_cache: torch.Tensor,
    block_table: torch.Tensor,
) -> ModuleType:
    """The backend module that will serve a call with these tensors.

    Raises `BackendError` for an unknown name, an unavailable backend, or an input the
    named backend cannot serve (with its reason).
    """
    from kvplug.kernels.layout import PagedShape

    if backend != "auto" and backend not in BACKENDS:
        raise BackendError(
            f"unknown kernel backend {backend!r}; accepted: auto, {', '.join(BACKENDS)}"
        )
    num_blocks, page_size, kv_heads, head_dim = k_cache.shape
    shape = PagedShape(
        batch=block_table.shape[0],
        q_heads=q.shape[1],
        kv_heads=kv_heads,
        head_dim=head_dim,
        num_blocks=num_blocks,
        page_size=page_size,
        max_blocks=block_table.shape[1],
    )
    status = available_backends()
    if backend != "auto":
        if status[backend] != AVAILABLE:
            raise BackendError(f"kernel backend {backend!r} is unavailable: {status[backend]}")
        module = importlib.import_module(_MODULES[backend])
        reason = module.unsupported(shape, q.dtype, q.device)
        if reason:
            raise BackendError(f"kernel backend {backend!r} cannot serve this input: {reason}")
        return module
    order = ("flashinfer", "triton", "reference") if q.device.type == "cuda" else ("reference",)
    for name in order:
        if status[name] == AVAILABLE:
            module = importlib.import_module(_MODULES[name])
            if module.unsupported(shape, q.dtype, q.device) is None:
                return module
    raise BackendError(f"no kernel backend can serve tensors on {q.device}: {status}")


def paged_decode(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_table: torch.Tensor,
    seq_lens: torch.Tensor,
    *,
    scale: float | None = None,
    backend: str = "auto",
) -> torch.Tensor:
    """Attention of one new query token per sequence over its paged keys and values.

    Args:
        q: ``[batch, q_heads, head_dim]``; q_heads a multiple of kv_heads (GQA).
        k_cache, v_cache: ``[num_blocks, page_size, kv_heads, head_dim]``, same dtype as q
            (float32, float16 or bfloat16); any page_size >= 1.
        block_table: int32 ``[batch, max_blocks]``.
        seq_lens: int32 ``[batch]``, each >= 1, counting the new token (already appended).
        scale: softmax scale; ``1 / sqrt(head_dim)`` when None.
        backend: "auto", "reference", "triton" or "flashinfer".

    Returns ``[batch, q_heads, head_dim]`` in q's dtype. Checks the inputs first, which
    reads the lengths to the host.
    """
    from kvplug.kernels.layout import check_inputs

    check_inputs(q, k_cache, v_cache, block_table, seq_lens)
    module = select_backend(backend, q, k_cache, block_table)
    return module.decode(q, k_cache, v_cache, block_table, seq_lens, _scale(scale, q))


def paged_prefill(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_table: torch.Tensor,
    seq_lens: torch.Tensor,
    qo_indptr: torch.Tensor,
    *,
    scale: float | None = None,
    backend: str = "auto",
) -> torch.Tensor:
    """Causal attention of several new tokens per sequence, appended after its context.

    Args:
        q: ``[total_q, q_heads, head_dim]``; sequence ``b``'s new tokens are rows
            ``qo_indptr[b]:qo_indptr[b + 1]``.
        k_cache, v_cache, block_table, scale, backend: as in `paged_decode`.
        seq_lens: int32 ``[batch]``, each sequence's tokens in the cache *including* its new
            ones (written first with `append_paged_kv`).
        qo_indptr: int32 ``[batch + 1]``, from 0 to total_q.

    New token ``i`` of ``n`` of sequence ``b`` sits at position ``seq_lens[b] - n + i`` and
    attends to positions ``0..seq_lens[b] - n + i``. Returns ``[total_q, q_heads, head_dim]``.
    """
    from kvplug.kernels.layout import check_inputs

    check_inputs(q, k_cache, v_cache, block_table, seq_lens, qo_indptr)
    module = select_backend(backend, q, k_cache, block_table)
    return module.prefill(q, k_cache, v_cache, block_table, seq_lens, qo_indptr, _scale(scale, q))


def append_paged_kv(
    k: torch.Tensor,
    v: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_table: torch.Tensor,
    seq_lens: torch.Tensor,
    qo_indptr: torch.Tensor,
) -> None:
    """Write new keys and values ``[total_new, kv_heads, head_dim]`` into the caches, in place.

    Takes the same `block_table`, `seq_lens` (after the append) and `qo_indptr` as
    `paged_prefill`: new token ``i`` of ``n`` of sequence ``b`` goes to position
    ``seq_lens[b] - n + i``. For decode, ``qo_indptr = arange(batch + 1)``.
    """
    from kvplug.kernels.layout import check_inputs, new_token_slots

    if k.shape != v.shape or k.dim() != 3 or k.shape[1:] != k_cache.shape[2:]:
        raise KernelInputError(
            f"k and v must both be [total_new, kv_heads, head_dim] = "
            f"[*, {k_cache.shape[2]}, {k_cache.shape[3]}], got {tuple(k.shape)} and "
            f"{tuple(v.shape)}"
        )
    check_inputs(k, k_cache, v_cache, block_table, seq_lens, qo_indptr)
    blocks, slots = new_token_slots(block_table, seq_lens, qo_indptr, k_cache.shape[1])
    k_cache[blocks, slots] = k
    v_cache[blocks, slots] = v


def _scale(scale: float | None, q: torch.Tensor) -> float:
    return 1.0 / math.sqrt(q.shape[-1]) if scale is None else float(scale)


__all__ = [
    "AVAILABLE",
    "BACKENDS",
    "BackendError",
    "KernelInputError",
    "append_paged_kv",
    "available_backends",
    "paged_decode",
    "paged_prefill",
    "select_backend",
]
