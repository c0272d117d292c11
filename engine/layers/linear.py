"""Linear layers whose weights may be loaded in named shards (fused QKV, gate/up)."""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

from engine.layers.gemv import linear, silu_mul_linear


class MergedLinear(nn.Module):
    """One matmul for several projections stacked on the output dim.

    ``shards`` maps a checkpoint shard name (e.g. "q", "k", "v") to its output
    size, in stacking order.
    """

    def __init__(self, in_features: int, shards: dict[str, int], bias: bool) -> None:
        super().__init__()
        self.shards = dict(shards)
        out = sum(shards.values())
        self.weight = nn.Parameter(torch.empty(out, in_features))
        self.bias = nn.Parameter(torch.zeros(out)) if bias else None

    def shard_slice(self, name: str) -> slice:
        start = 0
        for n, size in self.shards.items():
            if n == name:
                return slice(start, start + size)
            start += size
        raise KeyError(name)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return linear(x, self.weight, self.bias)


class Linear(nn.Linear):
    """``nn.Linear`` whose one-row CUDA inputs take the GEMV kernel."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return linear(x, self.weight, self.bias)

    def silu_mul_forward(
        self, gate_up: torch.Tensor, silu_and_mul: Callable[[torch.Tensor], torch.Tensor]
    ) -> torch.Tensor:
        """``self(silu_and_mul(gate_up))``, fused where the GEMV kernel applies."""
        assert self.bias is None
        return silu_mul_linear(gate_up, self.weight, silu_and_mul)
