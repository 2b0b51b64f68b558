"""TEST FIXTURE ONLY, never installed for users: a stand-in for SGLang's ``sgl_kernel``.

SGLang 0.5.23 imports ``sgl_kernel`` (its compiled CUDA/CPU ops) at module level on the
way to its server, even with ``SGLANG_USE_CPU_ENGINE=1 --device cpu --attention-backend
torch_native``, and no package registry ships a CPU build of it. kvplug's SGLang server
tests (tests/test_sglang_server.py) put this directory on the server subprocess's
PYTHONPATH, and nowhere else, so that the real server starts on a CPU-only machine.

What it provides: one op in plain PyTorch, `assign_req_to_token_pool_cpu` (SGLang's CPU
path calls it when it writes a batch's KV slots into its request-to-token table); and any
other ``from sgl_kernel import NAME`` succeeds and binds a function that raises
``NotImplementedError`` if called. On the path these tests run (a Llama-style model on the
CPU without AMX, torch_native attention, page size 1, no speculative decoding, no
quantization) SGLang imports eight such names (``copy_all_layer_kv_cache_cpu``, and
speculative decoding's ``*_cpu`` helpers) and computes with plain PyTorch: its CPU layers
fall back to their native forward when the kernels are absent. A call would show in the
server log as ``sgl_kernel stub: NAME called`` and fail the request, so a test passing
means none was called. ``torch.ops.sgl_kernel.*`` is left empty: SGLang probes it
with ``hasattr`` and skips models that need it (their import errors are logged, ignored).

``$SGL_KERNEL_STUB_LOG``, if set, names a file that records each name imported, one a line.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import Any


def _record(name: str) -> None:
    path = os.environ.get("SGL_KERNEL_STUB_LOG")
    if path:
        with open(path, "a", encoding="utf-8") as log:
            log.write(f"{name}\n")


def assign_req_to_token_pool_cpu(
    req_pool_indices: Any,
    req_to_token: Any,
    start_offset: Any,
    end_offset: Any,
    out_cache_loc: Any,
    max_context_len: int,
) -> None:
    """``req_to_token[r, start:end] = `` the next ``end - start`` slots of
    `out_cache_loc`, for each request ``r`` of the batch in order."""
    offset = 0
    rows = zip(req_pool_indices.tolist(), start_offset.tolist(), end_offset.tolist(), strict=True)
    for row, start, end in rows:
        req_to_token[row, start:end] = out_cache_loc[offset : offset + end - start]
        offset += end - start


def __getattr__(name: str) -> Callable[..., Any]:
    if name.startswith("__"):  # module dunders (__path__, __file__, ...) stay absent
        raise AttributeError(name)
    _record(name)

    def not_implemented(*args: Any, **kwargs: Any) -> Any:
        raise NotImplementedError(f"sgl_kernel stub: {name} called (a test fixture, no ops)")

    not_implemented.__name__ = name
    return not_implemented
