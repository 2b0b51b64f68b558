"""Engine hooks that let vLLM and SGLang run FlashInfer at any page size. GPU only.

**Untested here.** These hooks need a CUDA GPU, FlashInfer and the engine; kvplug's CI
has none of them. On such a machine they import cleanly, `vllm_hook_status()` and
`sglang_hook_status()` say why they cannot run, and activating one raises
`EngineHookError` with that reason. Importing this module imports no engine, no torch
and no FlashInfer. The metadata conversion they rely on
(`kvplug.kernels.layout.token_pages_to_pages`) is tested on CPU.

vLLM (checked against vLLM 0.32's ``vllm/v1/attention/backends/registry.py``): vLLM's
FlashInfer backend advertises kernel block sizes 16, 32 and 64 only (larger ones only on
Blackwell's trtllm-gen path). `register_vllm_backend` registers ``KVPLUG_FLASHINFER``, a
subclass that accepts every block size; FlashInfer's FA2/FA3 wrappers take the page size
at run time. Activate it in every vLLM process (workers are separate processes), e.g. from
a ``vllm.general_plugins`` entry point that calls `vllm_plugin`, then serve with
``--attention-backend KVPLUG_FLASHINFER --block-size 8`` and
``--attention-config '{"use_trtllm_attention": false}'`` so decode stays on the wrappers.

SGLang (checked against ``sglang/srt/layers/attention/attention_registry.py``): SGLang's
FlashInfer backend describes the cache to FlashInfer one token per page (page size 1),
whatever ``--page-size`` is. `register_sglang_backend` registers ``kvplug_flashinfer``:
SGLang's own FlashInfer backend whose paged wrappers are wrapped by
`PageSizeAdapter`, which regroups that token-level metadata into real pages and views
the KV buffers as ``[pages, page_size, heads, head_dim]`` before calling FlashInfer. Run
with ``--page-size 16 --attention-backend kvplug_flashinfer --disable-cuda-graph`` (the
CUDA-graph path replans through ``fast_decode_plan``, which the adapter does not see).
"""

from __future__ import annotations

import importlib.util
from functools import cache
from typing import Any

from kvplug.errors import KVPlugError

VLLM_BACKEND_NAME = "KVPLUG_FLASHINFER"
SGLANG_BACKEND_NAME = "kvplug_flashinfer"


class EngineHookError(KVPlugError, RuntimeError):
    """An engine hook activated where it cannot run (no GPU, engine or FlashInfer)."""


def _installed(module: str) -> bool:
    try:
        return importlib.util.find_spec(module) is not None
    except (ImportError, ValueError):
        return False


def _hook_status(engine: str) -> str:
    """``"available"`` or why the `engine` hook cannot run here."""
    if not _installed(engine):
        return f"needs {engine} installed (pip install 'kvplug[{engine}]')"
    if not _installed("flashinfer"):
        return "needs flashinfer installed (pip install flashinfer-python)"
    import torch

    if not torch.cuda.is_available():
        return "needs a CUDA GPU: FlashInfer's paged kernels run only on CUDA"
    return "available"


def vllm_hook_status() -> str:
    """``"available"`` or why the vLLM hook cannot run here."""
    return _hook_status("vllm")


def sglang_hook_status() -> str:
    """``"available"`` or why the SGLang hook cannot run here."""
    return _hook_status("sglang")


# -- vLLM ------------------------------------------------------------------------------


def register_vllm_backend() -> str:
    """Register ``KVPLUG_FLASHINFER`` in vLLM's attention-backend registry; return its name.

    Raises `EngineHookError` where it cannot run. Registering twice is harmless.
    """
    status = vllm_hook_status()
    if status != "available":
        raise EngineHookError(f"kvplug's vLLM FlashInfer hook {status}")
    from vllm.v1.attention.backends.registry import AttentionBackendEnum, register_backend

    if VLLM_BACKEND_NAME not in AttentionBackendEnum.__members__:
        register_backend(VLLM_BACKEND_NAME, f"{__name__}.KVPlugFlashInferBackend")
    return VLLM_BACKEND_NAME


def vllm_plugin() -> None:
    """A ``vllm.general_plugins`` entry point: register where possible, else do nothing."""
    if vllm_hook_status() == "available":
        register_vllm_backend()


@cache
def _vllm_backend_class() -> type:
    status = vllm_hook_status()
    if status != "available":
        raise EngineHookError(f"kvplug's vLLM FlashInfer backend {status}")
    from vllm.v1.attention.backend import MultipleOf
    from vllm.v1.attention.backends.flashinfer import FlashInferBackend

    class KVPlugFlashInferBackend(FlashInferBackend):
        """vLLM's FlashInfer backend at any block size.

        Only the advertised block sizes change. ``get_name`` stays "FLASHINFER" so vLLM's
        FlashInfer-specific set-up (KV layout, warm-up) still applies.
        """

        @staticmethod
        def get_supported_kernel_block_sizes(kv_cache_spec: Any = None) -> list[Any]:
            return [MultipleOf(1)]

    KVPlugFlashInferBackend.__module__ = __name__  # where vLLM and pickle look it up
    KVPlugFlashInferBackend.__qualname__ = "KVPlugFlashInferBackend"
    return KVPlugFlashInferBackend


def __getattr__(name: str) -> Any:
    # vLLM resolves "kvplug.kernels.engine_hooks.KVPlugFlashInferBackend" by name; the class
    # is built on that first access so that importing this module never imports vLLM.
    if name == "KVPlugFlashInferBackend":
        return _vllm_backend_class()
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


# -- SGLang ----------------------------------------------------------------------------


class PageSizeAdapter:
    """A FlashInfer paged wrapper that SGLang plans at page size 1, run at `page_size`.

    SGLang's slots are page-aligned under ``--page-size P`` (slot ``s`` is offset ``s % P``
    of page ``s // P``), so its one-token-per-page metadata regroups exactly into pages.
    Decode wrappers are planned ``(indptr, indices, last_page_len, heads..., 1, ...)``;
    prefill wrappers take ``qo_indptr`` first. Every other attribute passes through.
    """

    def __init__(self, wrapper: Any, page_size: int, *, has_qo_indptr: bool) -> None:
        self._wrapper = wrapper
        self._page_size = page_size
        self._first = 1 if has_qo_indptr else 0  # where (indptr, indices, last_page_len) start

    def plan(self, *args: Any, **kwargs: Any) -> Any:
        from kvplug.kernels.layout import token_pages_to_pages

        args = list(args)
        i = self._first
        pages = token_pages_to_pages(args[i], args[i + 1], self._page_size)
        args[i : i + 3] = [pages.indptr, pages.indices, pages.last_page_len]
        if len(args) > i + 6:  # page_size follows num_qo_heads, num_kv_heads, head_dim
            args[i + 6] = self._page_size
        else:
            kwargs["page_size"] = self._page_size
        return self._wrapper.plan(*args, **kwargs)

    begin_forward = plan

    def run(self, q: Any, kv_cache: Any, *args: Any, **kwargs: Any) -> Any:
        return self._wrapper.run(q, self._paged(kv_cache), *args, **kwargs)

    forward = run

    def _paged(self, kv_cache: Any) -> Any:
        if isinstance(kv_cache, tuple):
            return tuple(self._paged(part) for part in kv_cache)
        heads, head_dim = kv_cache.shape[-2:]
        return kv_cache.view(-1, self._page_size, heads, head_dim)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._wrapper, name)


def register_sglang_backend() -> str:
    """Register ``kvplug_flashinfer`` in SGLang's attention-backend registry; return its name.

    Raises `EngineHookError` where it cannot run.
    """
    status = sglang_hook_status()
    if status != "available":
        raise EngineHookError(f"kvplug's SGLang FlashInfer hook {status}")
    from sglang.srt.layers.attention.attention_registry import register_attention_backend

    register_attention_backend(SGLANG_BACKEND_NAME)(_create_sglang_backend)
    return SGLANG_BACKEND_NAME


def _create_sglang_backend(runner: Any) -> Any:
    from sglang.srt.layers.attention.flashinfer_backend import FlashInferAttnBackend

    backend = FlashInferAttnBackend(runner)
    page_size = runner.server_args.page_size
    if page_size > 1:
        backend.decode_wrappers = [
            PageSizeAdapter(w, page_size, has_qo_indptr=False) for w in backend.decode_wrappers
        ]
        for name in ("prefill_wrappers_paged", "prefill_wrappers_verify"):
            wrappers = getattr(backend, name, [])
            setattr(
                backend,
                name,
                [PageSizeAdapter(w, page_size, has_qo_indptr=True) for w in wrappers],
            )
    return backend
