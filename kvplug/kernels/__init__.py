"""KV-block kernel backends: a torch reference, Triton and FlashInfer.

For now this only reports which backends could run here; a later change adds the
kernels themselves. Importing this package imports no torch and no kernel library.
"""

from __future__ import annotations

import importlib.util
import os

AVAILABLE = "available"


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
        return dict.fromkeys(("reference", "triton", "flashinfer"), "torch not installed")
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


__all__ = ["AVAILABLE", "available_backends"]
