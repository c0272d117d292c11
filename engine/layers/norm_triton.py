"""RMSNorm of a forward's rows, alone or after the residual add, as one Triton
kernel (one program a row, the row held in registers), launched with
programmatic dependent launch (``engine.layers.pdl``).

FlashInfer's norm kernels are launched the ordinary way: the kernel after a
norm cannot be scheduled until the norm has finished, nor the norm until the
kernel before it has. Where the products after the norms prefetch their
weights before their wait (``engine.layers.pdl.PREFETCH_BYTES``),
``FlashInferKernels`` gives 2-D rows to this kernel instead. The numbers are
those of FlashInfer's fused add + RMSNorm: the sum stored rounded to the
model's dtype and normalized unrounded (as ``fp8_quant.norm_quantize``, which
quantizes the same value).
"""

from __future__ import annotations

from functools import cache
from typing import Any

import torch

from engine.layers import pdl

MAX_K = 32768
"""Widest row a program holds in registers; wider rows go to FlashInfer."""


@cache
def _kernel() -> Any:
    import triton
    import triton.language as tl

    prologue = pdl.prologue()

    @triton.jit
    def rms_norm_kernel(x, residual, weight, out, K, stride_x, stride_r, stride_o, eps,
                        HAS_RESIDUAL: tl.constexpr, BLOCK: tl.constexpr,
                        PDL: tl.constexpr = False):  # fmt: skip
        if PDL:  # engine.layers.pdl; a constant: nothing at all when off
            prologue()
        row = tl.program_id(0).to(tl.int64)
        k = tl.arange(0, BLOCK)
        live = k < K
        hf = tl.load(x + row * stride_x + k, mask=live, other=0.0).to(tl.float32)
        if HAS_RESIDUAL:
            hf += tl.load(residual + row * stride_r + k, mask=live, other=0.0).to(tl.float32)
            tl.store(residual + row * stride_r + k, hf.to(residual.dtype.element_ty), mask=live)
        rstd = 1.0 / tl.sqrt(tl.sum(hf * hf, axis=0) / K + eps)
        w = tl.load(weight + k, mask=live, other=0.0).to(tl.float32)
        tl.store(out + row * stride_o + k, (hf * rstd * w).to(out.dtype.element_ty), mask=live)

    return rms_norm_kernel


def fits(x: torch.Tensor) -> bool:
    """Whether the kernel takes ``x``: 2-D half-precision rows of unit stride,
    at most ``MAX_K`` wide."""
    return (
        x.dim() == 2
        and x.dtype in (torch.bfloat16, torch.float16)
        and x.stride(-1) == 1
        and x.shape[1] <= MAX_K
    )


def _launch(
    x: torch.Tensor,
    residual: torch.Tensor | None,
    weight: torch.Tensor,
    eps: float,
    out: torch.Tensor,
) -> None:
    m, k = x.shape
    if not fits(x) or (residual is not None and residual.shape != x.shape):
        raise ValueError(f"rows {tuple(x.shape)} {x.dtype} do not fit the norm kernel")
    if m == 0:
        return
    res = x if residual is None else residual
    block = 1 << (k - 1).bit_length()
    _kernel()[(m,)](
        x, res, weight, out, k, x.stride(0), res.stride(0), out.stride(0), eps,
        HAS_RESIDUAL=residual is not None, BLOCK=block,
        num_warps=min(16, max(4, block // 1024)), **pdl.launch_options(x.device),
    )  # fmt: skip


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm of the rows of ``x`` ``[n, d]``, a new tensor."""
    out = torch.empty_like(x)
    _launch(x, None, weight, eps, out)
    return out


def add_rms_norm(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(rms_norm(x + residual), x + residual)`` in place, as FlashInfer's
    fused kernel: the sum into ``residual``, the norm into ``x`` (each program
    reads its row before it writes it)."""
    _launch(x, residual, weight, eps, x)
    return x, residual
