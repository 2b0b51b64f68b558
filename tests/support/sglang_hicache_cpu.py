"""TEST FIXTURE ONLY: the three CUDA-only pieces of SGLang 0.5.23's HiCache, on the CPU.

SGLang's hierarchical cache runs its tree logic (backup, demotion, load-back, host
eviction) in Python, but three pieces below it need a CUDA device:

- the host pool registers its buffer with ``cudaHostRegister`` (no allocator is listed
  for a ``cpu`` device, so the CUDA one is the default);
- the ``direct`` I/O backend copies KV with ``sgl_kernel.kvcacheio.transfer_kv_direct``,
  a compiled CUDA op (no CPU build on any registry);
- the transfer engine synchronises a CUDA stream when a transfer fails.

`cpu_hicache` stands in for each with plain PyTorch for the duration of a test: a plain
CPU buffer, an index copy per layer, and a CPU stream that can be synchronised. Nothing
else of SGLang is changed; the KV really moves between the device and host pools (the
tests compare the bytes). Never installed for users.
"""

from __future__ import annotations

import importlib
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from typing import Any

import pytest
import torch

HOST_POOL_MODULES = ("sglang.srt.mem_cache.memory_pool_host", "sglang.srt.mem_cache.pool_host.mha")


def plain_host_buffer(dims: tuple, dtype: torch.dtype, device: str, **_: Any) -> torch.Tensor:
    """The host buffer, unpinned and unregistered (there is no CUDA driver)."""
    return torch.empty(dims, dtype=dtype, device=device)


def transfer_kv_direct(
    src_layers: Sequence[torch.Tensor],
    dst_layers: Sequence[torch.Tensor],
    src_indices: torch.Tensor,
    dst_indices: torch.Tensor,
    page_size: int,
) -> None:
    """``dst[dst_indices] = src[src_indices]`` for each layer's buffer: what the CUDA op
    does, row for row."""
    src_rows, dst_rows = src_indices.long().cpu(), dst_indices.long().cpu()
    for src, dst in zip(src_layers, dst_layers, strict=True):
        dst[dst_rows] = src[src_rows].to(dst.device)


@contextmanager
def cpu_hicache() -> Iterator[None]:
    """SGLang's HiCache with the stand-ins above (see the module doc)."""
    from sglang.srt.mem_cache.pool_host import common

    with pytest.MonkeyPatch.context() as patch:
        patch.setitem(common.ALLOC_MEMORY_FUNCS, "cpu", plain_host_buffer)
        for name in HOST_POOL_MODULES:
            module = importlib.import_module(name)
            patch.setattr(module, "transfer_kv_direct", transfer_kv_direct, raising=False)
        if not hasattr(torch.cpu.Stream, "synchronize"):
            patch.setattr(torch.cpu.Stream, "synchronize", lambda self: None, raising=False)
        yield


def cpu_hicache_server_args(**flags: Any) -> Any:
    """SGLang's `ServerArgs` for HiCache on the CPU: the direct copy path and the
    layer-first host layout (what this fixture's copy stands in for), plus `flags`."""
    from sglang.srt.server_args import ServerArgs

    return ServerArgs(
        model_path="dummy",
        device="cpu",
        page_size=1,
        hicache_io_backend="direct",
        hicache_mem_layout="layer_first",
        **flags,
    )
