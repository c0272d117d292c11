"""FP8 products of a few rows (small-batch decode) in one Triton kernel.

For ``M <= MAX_ROWS`` rows a product is memory-bound: its time is the
weight's bytes, which e4m3 halves. ``torch._scaled_mm`` would also need the
activations quantized by separate kernels first; here each program quantizes
the rows itself (their amax over K, then ``round_e4m3(x / sx)``, as
``engine.layers.fp8.quantize_rows`` does) and streams ``BLOCK_N`` weight rows
once for all ``M`` input rows, so a product is one kernel:

    y[m, n] = sx[m] * s[n] * sum_k round_e4m3(x[m, k] / sx[m]) * Q[n, k]

the same numbers as ``engine.layers.fp8.linear`` up to the order of the sum.
"""

from __future__ import annotations

from functools import cache
from typing import Any, NamedTuple

import torch

from engine.layers.fp8_quant import E4M3, E4M3_MAX, SCALE_FLOOR

MAX_ROWS = 4
"""Rows this kernel takes; more go to ``torch._scaled_mm``."""


class Tiles(NamedTuple):
    block_n: int
    block_k: int
    warps: int


def tiles(n: int, k: int, rows: int = 1) -> Tiles | None:
    """Tiles for an ``[n, k]`` weight and ``rows`` input rows, or None where
    they do not divide it. (The bf16 GEMV's choice for the same shapes, the k
    tile shortened as rows are added: the accumulator holds rows x n x k.)"""
    block_n, block_k, warps = (1, 2048, 8) if n * k <= 8192 * 4096 else (4, 1024, 4)
    block_k = max(128, block_k // (1 << (rows - 1).bit_length()))
    while block_k > 128 and k % block_k:
        block_k //= 2
    if n % block_n or k % block_k:
        return None
    return Tiles(block_n, block_k, warps)


@cache
def _kernel() -> Any:
    import triton
    import triton.language as tl

    @triton.jit
    def fp8_rows_kernel(
        x,
        w,
        w_scale,
        bias,
        out,
        N,
        K,
        stride_x,
        stride_o,
        ROWS: tl.constexpr,
        FP8_MAX: tl.constexpr,
        SCALE_FLOOR: tl.constexpr,
        HAS_BIAS: tl.constexpr,
        BLOCK_N: tl.constexpr,
        BLOCK_K: tl.constexpr,
    ):
        n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
        m = tl.arange(0, ROWS)
        kk = tl.arange(0, BLOCK_K)
        # Each row's scale: its largest magnitude over K, mapped to 448.
        amax = tl.zeros([ROWS], dtype=tl.float32)
        for k0 in range(0, K, BLOCK_K):
            xv = tl.load(x + m[:, None] * stride_x + (k0 + kk)[None, :]).to(tl.float32)
            amax = tl.maximum(amax, tl.max(tl.abs(xv), axis=1))
        sx = tl.maximum(amax / FP8_MAX, SCALE_FLOOR)
        acc = tl.zeros([ROWS, BLOCK_N, BLOCK_K], dtype=tl.float32)
        for k0 in range(0, K, BLOCK_K):
            xv = tl.load(x + m[:, None] * stride_x + (k0 + kk)[None, :]).to(tl.float32)
            xq = tl.clamp(xv / sx[:, None], -FP8_MAX, FP8_MAX)
            xq = xq.to(tl.float8e4nv).to(tl.float32)
            wv = tl.load(w + n[:, None] * K + (k0 + kk)[None, :]).to(tl.float32)
            acc += xq[:, None, :] * wv[None, :, :]
        y = tl.sum(acc, axis=2) * sx[:, None] * tl.load(w_scale + n)[None, :]
        if HAS_BIAS:
            y += tl.load(bias + n).to(tl.float32)[None, :]
        tl.store(out + m[:, None] * stride_o + n[None, :], y.to(out.dtype.element_ty))

    return fp8_rows_kernel


def fits(x: torch.Tensor, q: torch.Tensor) -> Tiles | None:
    """The tiles for ``x`` ``[M, K]`` (``M <= MAX_ROWS``, contiguous rows,
    half precision) against the e4m3 weight ``q``, or None."""
    if x.dim() != 2 or not 1 <= x.shape[0] <= MAX_ROWS or x.stride(-1) != 1:
        return None
    if x.dtype not in (torch.bfloat16, torch.float16) or q.dtype != E4M3 or not q.is_contiguous():
        return None
    return tiles(q.shape[0], q.shape[1], x.shape[0])


def run(
    x: torch.Tensor,
    q: torch.Tensor,
    scale: torch.Tensor,
    bias: torch.Tensor | None,
    t: Tiles,
) -> torch.Tensor:
    """The kernel on ``x`` ``[M, K]`` (any device Triton runs on)."""
    m, k = x.shape
    n = q.shape[0]
    rows = 1 << (m - 1).bit_length()  # a power of two; the padding rows are zeros
    if rows != m:
        x = torch.cat([x, x.new_zeros(rows - m, k)])
    out = torch.empty((rows, n), dtype=x.dtype, device=x.device)
    _kernel()[(n // t.block_n,)](
        x, q, scale, scale if bias is None else bias, out, n, k, x.stride(0), out.stride(0),
        ROWS=rows, FP8_MAX=E4M3_MAX, SCALE_FLOOR=SCALE_FLOOR, HAS_BIAS=bias is not None,
        BLOCK_N=t.block_n, BLOCK_K=t.block_k,
        num_warps=t.warps,
    )  # fmt: skip
    return out[:m]
