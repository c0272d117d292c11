"""Matrix-vector products for one-row inputs on CUDA (batch-1 decode).

A decode step of one request reads every weight once and does little else, so
its time is the weights' bytes over the memory bandwidth. cuBLAS serves a
one-row product with kernels tuned for wider ones, well under the memory's
rate for the smaller products (o and down through split-K plus a reduction
kernel). The Triton kernel here streams ``BLOCK_N`` weight rows per program,
accumulating in float32, closer to the memory's rate (figures:
docs/perf/2026-12-01-one-row-gemv.md). ``silu_mul_linear`` also
takes the SiLU-and-mul of the MLP into the down projection's loads (one kernel
less per layer).

Used for a ``[1, K]`` bf16/fp16 input on CUDA whose shape fits the tiles;
``linear`` gives inputs of a few rows to ``engine.layers.skinny`` where its
tiles apply, and any other input to ``F.linear`` (``silu_mul_linear`` to the
unfused pair), as it does every input on the CPU.
"""

from __future__ import annotations

from functools import cache
from typing import Any, NamedTuple

import torch
from torch.nn import functional as F

from engine.layers import pdl, skinny


class Tiles(NamedTuple):
    block_n: int
    block_k: int
    warps: int
    stages: int


def tiles(n: int, k: int) -> Tiles | None:
    """The measured tiles for an ``[n, k]`` weight, or None where they do not fit."""
    # Measured on an H200 over Llama-3.1-8B's shapes: few rows per program and
    # a long K tile (one row of 2048 for the smaller QKV and o matrices); the
    # 128k-row LM head prefers wider, shorter tiles.
    if n >= 65536:
        block_n, block_k, warps = 16, 256, 4
    elif n * k <= 8192 * 4096:
        block_n, block_k, warps = 1, 2048, 8
    else:
        block_n, block_k, warps = 4, 1024, 4
    while block_k > 128 and k % block_k:
        block_k //= 2
    if n % block_n or k % block_k:
        return None
    return Tiles(block_n, block_k, warps, 4)


@cache
def _kernels() -> tuple[Any, Any]:
    import triton
    import triton.language as tl

    prologue = pdl.prologue()
    l2_prefetch = pdl.l2_prefetch()

    @triton.jit
    def prefetch_rows(w_ptr, K, PREFETCH: tl.constexpr, PREFETCH_PROGRAMS: tl.constexpr,
                      BLOCK_N: tl.constexpr, THREADS: tl.constexpr):  # fmt: skip
        # With PDL only (_launch), before the wait: the launch's first
        # programs ask for their weight rows (PREFETCH bytes each, whole rows).
        if tl.program_id(0) < PREFETCH_PROGRAMS:
            first = (w_ptr + tl.program_id(0).to(tl.int64) * BLOCK_N * K).to(tl.int64)
            l2_prefetch(first, PREFETCH, PREFETCH, BLOCK_N, THREADS)

    @triton.jit
    def gemv(x_ptr, w_ptr, b_ptr, out_ptr, K, HAS_BIAS: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, PREFETCH: tl.constexpr = 0, PREFETCH_PROGRAMS: tl.constexpr = 0, THREADS: tl.constexpr = 128, PDL: tl.constexpr = False):  # fmt: skip
        rows = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
        if PREFETCH > 0:  # a constant: nothing at all when off
            prefetch_rows(w_ptr, K, PREFETCH, PREFETCH_PROGRAMS, BLOCK_N, THREADS)
        if PDL:  # engine.layers.pdl; a constant: nothing at all when off
            prologue()
        acc = tl.zeros((BLOCK_N, BLOCK_K), dtype=tl.float32)
        for k in range(0, K, BLOCK_K):
            cols = k + tl.arange(0, BLOCK_K)
            w = tl.load(w_ptr + rows[:, None] * K + cols[None, :])
            x = tl.load(x_ptr + cols)
            acc += w.to(tl.float32) * x.to(tl.float32)[None, :]
        out = tl.sum(acc, axis=1)
        if HAS_BIAS:
            out += tl.load(b_ptr + rows).to(tl.float32)
        tl.store(out_ptr + rows, out.to(out_ptr.dtype.element_ty))

    @triton.jit
    def silu_gemv(
        gu_ptr,
        w_ptr,
        out_ptr,
        K,
        BLOCK_N: tl.constexpr,
        BLOCK_K: tl.constexpr,
        PREFETCH: tl.constexpr = 0,
        PREFETCH_PROGRAMS: tl.constexpr = 0,
        THREADS: tl.constexpr = 128,
        PDL: tl.constexpr = False,
    ):
        rows = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
        if PREFETCH > 0:  # a constant: nothing at all when off
            prefetch_rows(w_ptr, K, PREFETCH, PREFETCH_PROGRAMS, BLOCK_N, THREADS)
        if PDL:  # engine.layers.pdl; a constant: nothing at all when off
            prologue()
        acc = tl.zeros((BLOCK_N, BLOCK_K), dtype=tl.float32)
        for k in range(0, K, BLOCK_K):
            cols = k + tl.arange(0, BLOCK_K)
            w = tl.load(w_ptr + rows[:, None] * K + cols[None, :])
            g = tl.load(gu_ptr + cols).to(tl.float32)
            u = tl.load(gu_ptr + K + cols).to(tl.float32)
            # Rounded to the input's dtype, as the unfused activation is stored.
            a = (g / (1.0 + tl.exp(-g)) * u).to(gu_ptr.dtype.element_ty).to(tl.float32)
            acc += w.to(tl.float32) * a[None, :]
        tl.store(out_ptr + rows, tl.sum(acc, axis=1).to(out_ptr.dtype.element_ty))

    return gemv, silu_gemv


def _fits(x: torch.Tensor, w: torch.Tensor, k: int) -> Tiles | None:
    if not (x.is_cuda and x.dim() == 2 and x.shape[0] == 1 and x.is_contiguous()):
        return None
    if x.dtype not in (torch.bfloat16, torch.float16) or w.dtype != x.dtype:
        return None
    if not w.is_contiguous() or w.shape[1] != k:
        return None
    return tiles(w.shape[0], k)


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """``F.linear(x, weight, bias)``; one-row CUDA inputs through the GEMV kernel,
    a few rows through ``engine.layers.skinny``'s."""
    if x.shape[0] > skinny.MAX_ROWS or not x.is_cuda:  # a prefill's rows, or no GPU
        return F.linear(x, weight, bias)
    t = _fits(x, weight, x.shape[-1])
    if t is not None:
        return run_gemv(x, weight, bias, t)
    s = skinny.fits(x, weight)
    if s is not None:
        return skinny.run_skinny(x, weight, bias, s)
    return F.linear(x, weight, bias)


def run_gemv(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, t: Tiles
) -> torch.Tensor:
    """The GEMV kernel on ``x`` ``[1, K]`` (any device Triton runs on)."""
    n = weight.shape[0]
    out = torch.empty((1, n), dtype=x.dtype, device=x.device)
    gemv, _ = _kernels()
    gemv[(n // t.block_n,)](
        x, weight, weight if bias is None else bias, out, x.shape[1],
        HAS_BIAS=bias is not None, BLOCK_N=t.block_n, BLOCK_K=t.block_k,
        num_warps=t.warps, num_stages=t.stages, **_launch(weight, t),
    )  # fmt: skip
    return out


def silu_mul_linear(gate_up: torch.Tensor, weight: torch.Tensor, silu_and_mul: Any) -> torch.Tensor:
    """``F.linear(silu_and_mul(gate_up), weight)``: one kernel for a one-row
    CUDA input, else the two steps (``silu_and_mul`` is the layer's kernel)."""
    k = gate_up.shape[-1] // 2
    t = _fits(gate_up, weight, k)
    if t is None:
        return linear(silu_and_mul(gate_up), weight)
    return run_silu_gemv(gate_up, weight, t)


def run_silu_gemv(gate_up: torch.Tensor, weight: torch.Tensor, t: Tiles) -> torch.Tensor:
    """The fused SiLU-and-mul GEMV kernel on ``gate_up`` ``[1, 2K]``."""
    n = weight.shape[0]
    out = torch.empty((1, n), dtype=gate_up.dtype, device=gate_up.device)
    _, silu_gemv = _kernels()
    silu_gemv[(n // t.block_n,)](
        gate_up, weight, out, gate_up.shape[1] // 2, BLOCK_N=t.block_n, BLOCK_K=t.block_k,
        num_warps=t.warps, num_stages=t.stages, **_launch(weight, t),
    )  # fmt: skip
    return out


def _launch(weight: torch.Tensor, t: Tiles) -> dict[str, Any]:
    """A launch's PDL options and, with PDL, its L2 prefetch of the weight:
    the whole rows of its first programs (``pdl.prefetch_programs``; a few
    rows a program, thousands of programs in waves: the first are those
    placed while the kernel ahead runs)."""
    launch = pdl.launch_options(weight.device)
    if not launch["PDL"]:
        return launch
    span = weight.shape[1] * weight.element_size()  # a row's bytes, rows contiguous
    programs = pdl.prefetch_programs(weight.shape[0] // t.block_n, t.block_n * span)
    if not programs:
        return launch
    return {**launch, "PREFETCH": span, "PREFETCH_PROGRAMS": programs, "THREADS": 32 * t.warps}
