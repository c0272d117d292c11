"""Programmatic dependent launch (compute capability 9.0 and later) for the
engine's Triton kernels.

A kernel launched with it may be scheduled while the kernel before it on the
stream is still finishing. Every program's first act is to wait
(``gdc_wait``) until that kernel has completed and its writes are visible,
and its second to let the kernel after it be scheduled the same way
(``gdc_launch_dependents``). What overlaps is a kernel's launch and the start
of its programs with the tail of the kernel before; no load or store comes
before the wait, so the results are an ordinary launch's. A decode step at a
small batch is some hundreds of kernels of a few microseconds each, where
that start is a visible part of every kernel. CUDA graphs keep the
dependency as captured.

Kernels take it as a ``PDL`` constexpr (``prologue`` first where set) and
their launches take ``launch_options(device)``; on other devices (ROCm's
included), under Triton's interpreter, or with a Triton that cannot launch
so, it is off.
"""

from __future__ import annotations

import os
from functools import cache
from typing import Any

import torch


@cache
def _triton_launches_it() -> bool:
    try:
        from triton.backends.nvidia.compiler import CUDAOptions
        from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait  # noqa: F401
    except ImportError:
        return False
    return "launch_pdl" in getattr(CUDAOptions, "__dataclass_fields__", {})


@cache
def _capability(index: int) -> tuple[int, int]:
    return torch.cuda.get_device_capability(index)


def compiled_capability(device: torch.device) -> tuple[int, int] | None:
    """The compute capability of ``device`` where Triton runs compiled PTX on
    it: an NVIDIA GPU, not under Triton's interpreter; else None (the CPU,
    ROCm's "cuda" devices)."""
    if device.type != "cuda" or os.environ.get("TRITON_INTERPRET") == "1":
        return None
    if torch.version.cuda is None:
        return None
    index = device.index if device.index is not None else torch.cuda.current_device()
    return _capability(index)


def enabled(device: torch.device) -> bool:
    """Whether kernels launched on ``device`` use it."""
    capability = compiled_capability(device)
    return capability is not None and capability >= (9, 0) and _triton_launches_it()


def launch_options(device: torch.device) -> dict[str, Any]:
    """The launch's keywords: the kernel's ``PDL`` constexpr and, where on,
    Triton's ``launch_pdl``."""
    return {"PDL": True, "launch_pdl": True} if enabled(device) else {"PDL": False}


@cache
def prologue() -> Any:
    """The Triton function a kernel calls first where its ``PDL`` constexpr
    is set (behind ``if PDL:``, so that Triton's interpreter, which does not
    see a kernel's closure, never looks it up)."""
    import triton
    import triton.language as tl

    @triton.jit
    def pdl_prologue():
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()

    return pdl_prologue
