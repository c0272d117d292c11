"""Linear layers whose weights may be loaded in named shards (fused QKV, gate/up)."""

from __future__ import annotations

import torch
from torch import nn
from torch.nn import functional as F


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
        return F.linear(x, self.weight, self.bias)
