"""RMSNorm, optionally fused with the residual add that precedes it."""

from __future__ import annotations

import torch
from torch import nn

from engine.layers.kernels import LayerKernels


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
