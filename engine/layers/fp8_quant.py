"""Per-token FP8 quantization of activations in Triton kernels (CUDA).

``engine.layers.fp8.quantize_rows`` in torch ops is five kernels (amax, two
divisions, clamp, cast) per projection; before ``torch._scaled_mm`` at decode
batch sizes those launches cost more than the work. Here one program per row
finds the row's amax over K, then writes ``round_e4m3(x / s)`` and ``s``: the
same numbers (IEEE divisions, as torch's).

Two more kernels make the activation and quantize it in the same pass, so the
products after a norm or SiLU-and-mul take no quantization kernel of their
own (``Quantized``): ``norm_quantize`` (the residual add and RMSNorm, as
FlashInfer's fused kernel computes them) and ``silu_mul_quantize``. Each holds
a row in registers; the value quantized is the one the unfused kernel would
have written, rounded to the model's dtype.
"""

from __future__ import annotations

from functools import cache
from typing import Any, NamedTuple

import torch

from engine.layers import pdl

E4M3 = torch.float8_e4m3fn
E4M3_MAX = float(torch.finfo(E4M3).max)
SCALE_FLOOR = 1e-12
"""Floor of a scale, so an all-zero row or token quantizes to zeros."""
PRECISE_K = 8192
"""Longest K an FP8 product sums in the tensor cores' own accumulator. On
sm_90 the e4m3 tensor-core instructions accumulate in fewer bits than
float32: Llama's down product (K 14336) summed so at 16 rows came out
4.0e-3 of its norm from float64 (``tests/test_fp8_gpu.py`` holds it under
4e-3), against 1.7e-3 with each k tile's sum kept in float32. So a longer K
keeps float32 sums: ``fp8_skinny.tiles`` splits it or keeps each tile's sum
(``Tiles.precise``), and ``fp8.linear`` asks cuBLASLt for its promoted
accumulation (``torch._scaled_mm``'s ``use_fast_accum`` off); up to it both
let the tensor cores accumulate, the faster way."""
FUSED_MAX_K = 32768
"""Widest row the fused kernels hold in registers."""


class Quantized(NamedTuple):
    """Activations quantized per token: e4m3 rows ``[M, K]``, their float32
    scales ``[M]``, and the dtype they were made in (the product's output)."""

    q: torch.Tensor
    scale: torch.Tensor
    dtype: torch.dtype

    @property
    def shape(self) -> torch.Size:
        return self.q.shape


class Deferred(NamedTuple):
    """Rows whose per-token quantization is left to the FP8 product that reads
    them (``engine.layers.fp8_skinny``): half-precision rows ``[M, K]``, and
    float32 maxima ``[M, P]`` whose largest in each row is the row's largest
    magnitude (``fp8_skinny.gated`` writes a maximum per program)."""

    rows: torch.Tensor
    maxes: torch.Tensor

    @property
    def dtype(self) -> torch.dtype:
        return self.rows.dtype

    @property
    def shape(self) -> torch.Size:
        return self.rows.shape


@cache
def _kernel() -> Any:
    import triton
    import triton.language as tl

    prologue = pdl.prologue()

    @triton.jit
    def quantize_rows_kernel(
        x,
        q,
        scale,
        K,
        stride_x,
        stride_q,
        FP8_MAX: tl.constexpr,
        FLOOR: tl.constexpr,
        BLOCK_K: tl.constexpr,
        PDL: tl.constexpr = False,
    ):
        if PDL:  # engine.layers.pdl; a constant: nothing at all when off
            prologue()
        row = tl.program_id(0).to(tl.int64)
        kk = tl.arange(0, BLOCK_K)
        amax = tl.zeros([BLOCK_K], dtype=tl.float32)
        for k0 in range(0, K, BLOCK_K):
            v = tl.load(x + row * stride_x + k0 + kk, mask=k0 + kk < K, other=0.0)
            amax = tl.maximum(amax, tl.abs(v.to(tl.float32)))
        s = tl.maximum(tl.math.div_rn(tl.max(amax, axis=0), FP8_MAX), FLOOR)
        inv_s = tl.math.div_rn(1.0, s)
        for k0 in range(0, K, BLOCK_K):
            live = k0 + kk < K
            v = tl.load(x + row * stride_x + k0 + kk, mask=live, other=0.0).to(tl.float32)
            q0 = v * inv_s  # v / s as an IEEE division, as _fused_kernels' do
            v = tl.clamp(tl.fma(tl.fma(-q0, s, v), inv_s, q0), -FP8_MAX, FP8_MAX)
            tl.store(q + row * stride_q + k0 + kk, v.to(tl.float8e4nv), mask=live)
        tl.store(scale + row, s)

    return quantize_rows_kernel


@cache
def _fused_kernels() -> tuple[Any, Any, Any]:
    import triton
    import triton.language as tl

    prologue = pdl.prologue()

    # Both end as quantize_rows_kernel does, on a row held whole: y / s
    # rounded as an IEEE division (div_rn), in three instructions a value
    # where div_rn takes a range check and a call: the quotient by the row's
    # rounded reciprocal, its remainder (exact in an fma), one correction
    # (Markstein; fp8_skinny's deferred rows do the same).
    @triton.jit
    def norm_quantize_kernel(x, residual, weight, q, scale, K, stride_x, stride_r, stride_q, eps,
                             HAS_RESIDUAL: tl.constexpr, FP8_MAX: tl.constexpr,
                             FLOOR: tl.constexpr, BLOCK: tl.constexpr, PDL: tl.constexpr = False):  # fmt: skip
        if PDL:  # engine.layers.pdl; a constant: nothing at all when off
            prologue()
        row = tl.program_id(0).to(tl.int64)
        k = tl.arange(0, BLOCK)
        live = k < K
        hf = tl.load(x + row * stride_x + k, mask=live, other=0.0).to(tl.float32)
        if HAS_RESIDUAL:
            # As FlashInfer's fused add + RMSNorm: the sum stored rounded, the
            # norm taken of it unrounded.
            hf += tl.load(residual + row * stride_r + k, mask=live, other=0.0).to(tl.float32)
            tl.store(residual + row * stride_r + k, hf.to(residual.dtype.element_ty), mask=live)
        rstd = 1.0 / tl.sqrt(tl.sum(hf * hf, axis=0) / K + eps)
        w = tl.load(weight + k, mask=live, other=0.0).to(tl.float32)
        y = (hf * rstd * w).to(x.dtype.element_ty).to(tl.float32)
        s = tl.maximum(tl.math.div_rn(tl.max(tl.abs(y), axis=0), FP8_MAX), FLOOR)
        inv_s = tl.math.div_rn(1.0, s)
        q0 = y * inv_s
        v = tl.clamp(tl.fma(tl.fma(-q0, s, y), inv_s, q0), -FP8_MAX, FP8_MAX)
        tl.store(q + row * stride_q + k, v.to(tl.float8e4nv), mask=live)
        tl.store(scale + row, s)

    @triton.jit
    def silu_mul_quantize_kernel(gate_up, q, scale, N, stride_g, stride_q,
                                 FP8_MAX: tl.constexpr, FLOOR: tl.constexpr,
                                 BLOCK: tl.constexpr, PDL: tl.constexpr = False):  # fmt: skip
        if PDL:  # engine.layers.pdl; a constant: nothing at all when off
            prologue()
        row = tl.program_id(0).to(tl.int64)
        k = tl.arange(0, BLOCK)
        live = k < N
        g = tl.load(gate_up + row * stride_g + k, mask=live, other=0.0).to(tl.float32)
        u = tl.load(gate_up + row * stride_g + N + k, mask=live, other=0.0).to(tl.float32)
        y = (g / (1.0 + tl.exp(-g)) * u).to(gate_up.dtype.element_ty).to(tl.float32)
        s = tl.maximum(tl.math.div_rn(tl.max(tl.abs(y), axis=0), FP8_MAX), FLOOR)
        inv_s = tl.math.div_rn(1.0, s)
        q0 = y * inv_s
        v = tl.clamp(tl.fma(tl.fma(-q0, s, y), inv_s, q0), -FP8_MAX, FP8_MAX)
        tl.store(q + row * stride_q + k, v.to(tl.float8e4nv), mask=live)
        tl.store(scale + row, s)

    @triton.jit
    def quantize_rows_held_kernel(x, q, scale, K, stride_x, stride_q, FP8_MAX: tl.constexpr,
                                  FLOOR: tl.constexpr, BLOCK: tl.constexpr,
                                  PDL: tl.constexpr = False):  # fmt: skip
        # quantize_rows_kernel's numbers, the row read once and all at once.
        if PDL:  # engine.layers.pdl; a constant: nothing at all when off
            prologue()
        row = tl.program_id(0).to(tl.int64)
        k = tl.arange(0, BLOCK)
        live = k < K
        y = tl.load(x + row * stride_x + k, mask=live, other=0.0).to(tl.float32)
        s = tl.maximum(tl.math.div_rn(tl.max(tl.abs(y), axis=0), FP8_MAX), FLOOR)
        inv_s = tl.math.div_rn(1.0, s)
        q0 = y * inv_s
        v = tl.clamp(tl.fma(tl.fma(-q0, s, y), inv_s, q0), -FP8_MAX, FP8_MAX)
        tl.store(q + row * stride_q + k, v.to(tl.float8e4nv), mask=live)
        tl.store(scale + row, s)

    return norm_quantize_kernel, silu_mul_quantize_kernel, quantize_rows_held_kernel


def _row_launch(k: int) -> dict[str, int]:
    block = 1 << (k - 1).bit_length()
    return {"BLOCK": block, "num_warps": min(16, max(4, block // 1024))}


def norm_quantize(
    x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor, eps: float
) -> tuple[Quantized, torch.Tensor]:
    """``(quantized rms_norm(x + residual), x + residual)`` in one kernel: the
    sum rounded to ``x``'s dtype (written into ``residual``) and normalized
    unrounded, as FlashInfer's fused kernel does; the norm's output rounded
    to ``x``'s dtype before it is quantized. ``residual`` None:
    ``(quantized rms_norm(x), x)``. Rows of ``x`` ``[M, K]`` contiguous."""
    m, k = x.shape
    q = torch.empty((m, k), dtype=E4M3, device=x.device)
    scale = torch.empty(m, dtype=torch.float32, device=x.device)
    res = x if residual is None else residual
    if m:
        _fused_kernels()[0][(m,)](
            x, res, weight, q, scale, k, x.stride(0), res.stride(0), q.stride(0), eps,
            HAS_RESIDUAL=residual is not None, FP8_MAX=E4M3_MAX, FLOOR=SCALE_FLOOR,
            **_row_launch(k), **pdl.launch_options(x.device),
        )  # fmt: skip
    return Quantized(q, scale, x.dtype), res


def silu_mul_quantize(gate_up: torch.Tensor) -> Quantized:
    """``silu(gate) * up`` of ``gate_up`` ``[M, 2N]`` (``[gate | up]``), rounded
    to its dtype and quantized per row, in one kernel."""
    m, n = gate_up.shape[0], gate_up.shape[1] // 2
    q = torch.empty((m, n), dtype=E4M3, device=gate_up.device)
    scale = torch.empty(m, dtype=torch.float32, device=gate_up.device)
    if m:
        _fused_kernels()[1][(m,)](
            gate_up, q, scale, n, gate_up.stride(0), q.stride(0),
            FP8_MAX=E4M3_MAX, FLOOR=SCALE_FLOOR, **_row_launch(n),
            **pdl.launch_options(gate_up.device),
        )  # fmt: skip
    return Quantized(q, scale, gate_up.dtype)


def quantize_rows(x: torch.Tensor, block_k: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """``(Q e4m3 [M, K], scale float32 [M])`` of ``x`` ``[M, K]`` (rows with
    unit stride), one kernel (any device Triton runs on). Rows of up to
    ``FUSED_MAX_K`` (and ``block_k`` None) are held whole by a program, read once
    and all at once, as the fused kernels hold theirs; longer ones (or a
    ``block_k`` given) are read twice in tiles of ``block_k`` (None: 1024),
    for their largest magnitude, then to quantize."""
    m, k = x.shape
    q = torch.empty((m, k), dtype=E4M3, device=x.device)
    scale = torch.empty(m, dtype=torch.float32, device=x.device)
    if not m:
        return q, scale
    launch = pdl.launch_options(x.device)
    if block_k is None and k <= FUSED_MAX_K:
        _fused_kernels()[2][(m,)](
            x, q, scale, k, x.stride(0), q.stride(0), FP8_MAX=E4M3_MAX, FLOOR=SCALE_FLOOR,
            **_row_launch(k), **launch,
        )  # fmt: skip
    else:
        _kernel()[(m,)](
            x, q, scale, k, x.stride(0), q.stride(0), FP8_MAX=E4M3_MAX, FLOOR=SCALE_FLOOR,
            BLOCK_K=min(block_k or 1024, 1 << (k - 1).bit_length()), num_warps=4, **launch,
        )  # fmt: skip
    return q, scale
