"""RMSNorm, optionally fused with the residual add that precedes it, and with
the per-token FP8 quantization of its output for an FP8 product after it."""

from __future__ import annotations

import torch
from torch import nn

from engine.layers import fp8_quant
from engine.layers.fp8_quant import Quantized
from engine.layers.kernels import LayerKernels
from engine.layers.linear import quantized_upstream


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float, kernels: LayerKernels) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps
        self.kernels = kernels

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.kernels.rms_norm(x, self.weight, self.eps)

    def add_forward(
        self, x: torch.Tensor, residual: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """``(norm(x + residual), x + residual)``; ``x`` and ``residual`` may be
        overwritten."""
        return self.kernels.add_rms_norm(x, residual, self.weight, self.eps)

    def forward_for(
        self, x: torch.Tensor, residual: torch.Tensor | None, consumer: nn.Module | None
    ) -> tuple[torch.Tensor | Quantized, torch.Tensor]:
        """``(norm(x + residual), x + residual)``, or ``(norm(x), x)`` with no
        residual; the norm quantized per token in the same kernel where
        ``consumer`` (the product it feeds) takes it so."""
        if consumer is not None and quantized_upstream(consumer, x):
            return fp8_quant.norm_quantize(x, residual, self.weight, self.eps)
        if residual is None:
            return self(x), x
        return self.add_forward(x, residual)
