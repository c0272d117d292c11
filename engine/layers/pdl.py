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

One thing may come before the wait, with ``PREFETCH_BYTES`` set: asking
L2 for bytes no kernel of the step writes (a product's weight), with
``l2_prefetch`` (Hopper's bulk prefetch: one instruction a contiguous span,
no register loaded, nothing read into the program). A program placed early
then has its first weight bytes streaming in while the kernel before it
finishes, which at a small batch is a norm, a rotary or an attention kernel
of a few microseconds that leaves the memory idle. (The experts' down
product also reads which experts its rows are, for the prefetch's addresses
alone: ``engine.layers.moe_triton``; the routing kernel asks for its chosen
experts' first rows after choosing them: ``engine.layers.moe_route``.)
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


PREFETCH_BYTES = 0
"""Bytes of its weight a product's launch asks L2 for before its wait (with
programmatic dependent launch on): the first ``prefetch_bytes`` of each
weight row's span of every program, where all programs run at once, or the
whole spans of the first ``prefetch_programs``, where they run in waves.
0: none."""
PREFETCH_LINE = 128
"""The prefetched span of a row is a whole number of these bytes (L2 lines)."""


def prefetch_bytes(rows: int, span: int, budget: int | None = None) -> int:
    """Bytes of each of ``rows`` weight-row spans of ``span`` bytes a launch
    prefetches: at most the span, all of them together at most ``budget``
    (None: ``PREFETCH_BYTES``), whole lines; 0 where that is under a line."""
    budget = PREFETCH_BYTES if budget is None else budget
    per_row = min(span, budget // rows) // PREFETCH_LINE * PREFETCH_LINE
    return per_row if per_row >= PREFETCH_LINE else 0


def prefetch_programs(programs: int, program_bytes: int, budget: int | None = None) -> int:
    """How many of a launch's first ``programs`` prefetch their whole weight
    span of ``program_bytes``, all of them together at most ``budget`` (None:
    ``PREFETCH_BYTES``): for kernels of many short programs, placed in order,
    of which only the first can be placed while the kernel before runs."""
    budget = PREFETCH_BYTES if budget is None else budget
    return min(programs, budget // program_bytes)


@cache
def l2_prefetch_at() -> Any:
    """The Triton function ``l2_prefetch_at(addresses, nbytes, ok)``: ask L2
    for ``nbytes`` (a multiple of 16) from each 16-byte aligned address (an
    int64 tensor) where ``ok`` holds, with Hopper's bulk prefetch
    (``cp.async.bulk.prefetch.L2``: sm_90 and later; the kernels keep it
    behind a constexpr that is off under Triton's interpreter, which runs no
    PTX), the thread that holds an element asking for it: for a tensor of
    one element a thread (none held by several). It changes nothing a
    program computes."""
    import triton
    import triton.language as tl

    @triton.jit
    def prefetch_at(addresses, nbytes, ok):
        # The output is a dummy (inline asm must produce one); not pure, so
        # the compiler keeps it although nothing reads it.
        tl.inline_asm_elementwise(
            "{ .reg .pred p;\n"
            " setp.ne.s32 p, $3, 0;\n"
            " @p cp.async.bulk.prefetch.L2.global [$1], $2;\n"
            " mov.b32 $0, 0; }",
            "=r,l,r,r",
            [addresses, tl.full(addresses.shape, nbytes, tl.int32), ok.to(tl.int32)],
            dtype=tl.int32,
            is_pure=False,
            pack=1,
        )

    return prefetch_at


@cache
def l2_prefetch_one() -> Any:
    """The Triton function ``l2_prefetch_one(address, nbytes)``: as
    ``l2_prefetch_at`` for one address (an int64 scalar, which every thread
    holds), the program's first thread alone asking."""
    import triton
    import triton.language as tl

    prefetch_at = l2_prefetch_at()

    @triton.jit
    def prefetch_one(address, nbytes):
        # The thread's index in the program (the input is unused: inline asm
        # takes one at least).
        thread = tl.inline_asm_elementwise(
            "mov.u32 $0, %tid.x;", "=r,r", [tl.zeros([1], tl.int32)], dtype=tl.int32,
            is_pure=True, pack=1,
        )  # fmt: skip
        prefetch_at(tl.full([1], address, tl.int64), nbytes, thread == 0)

    return prefetch_one


@cache
def l2_prefetch() -> Any:
    """The Triton function ``l2_prefetch(first, stride, nbytes, ROWS,
    THREADS)``: ``l2_prefetch_at`` for ``nbytes`` of each of ``ROWS`` spans,
    the first at ``first``, the others ``stride`` bytes apart. ``THREADS``:
    the program's threads (32 x warps), each of which asks for one span at a
    time: a tensor of that many elements has one a thread."""
    import triton
    import triton.language as tl

    prefetch_at = l2_prefetch_at()

    @triton.jit
    def prefetch(first, stride, nbytes, ROWS: tl.constexpr, THREADS: tl.constexpr):
        i = tl.arange(0, THREADS)
        for r0 in tl.static_range(0, ROWS, THREADS):
            row = r0 + i
            prefetch_at(first + row.to(tl.int64) * stride, nbytes, row < ROWS)

    return prefetch
