"""Linear layers whose weights may be loaded in named shards (fused QKV, gate/up).

With ``fp8=True`` a layer holds an e4m3 weight and a float32 ``weight_scale``
per output row (``engine.layers.fp8``); otherwise ``weight_scale`` is None."""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

from engine.layers import fp8 as fp8_math
from engine.layers import fp8_skinny
from engine.layers.gemv import linear, silu_mul_linear


class MergedLinear(nn.Module):
    """One matmul for several projections stacked on the output dim.

    ``shards`` maps a checkpoint shard name (e.g. "q", "k", "v") to its output
    size, in stacking order.
    """

    def __init__(
        self, in_features: int, shards: dict[str, int], bias: bool, fp8: bool = False
    ) -> None:
        super().__init__()
        self.shards = dict(shards)
        out = sum(shards.values())
        self.weight = nn.Parameter(torch.empty(out, in_features))
        self.bias = nn.Parameter(torch.zeros(out)) if bias else None
        fp8_math.weight_format(self, fp8)

    def shard_slice(self, name: str) -> slice:
        start = 0
        for n, size in self.shards.items():
            if n == name:
                return slice(start, start + size)
            start += size
        raise KeyError(name)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return any_linear(x, self.weight, self.bias, self.weight_scale)


class Linear(nn.Linear):
    """``nn.Linear`` whose one-row CUDA inputs take the GEMV kernel."""

    def __init__(
        self, in_features: int, out_features: int, bias: bool = True, fp8: bool = False
    ) -> None:
        super().__init__(in_features, out_features, bias)
        fp8_math.weight_format(self, fp8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return any_linear(x, self.weight, self.bias, self.weight_scale)

    def silu_mul_forward(
        self, gate_up: torch.Tensor, silu_and_mul: Callable[[torch.Tensor], torch.Tensor]
    ) -> torch.Tensor:
        """``self(silu_and_mul(gate_up))``, fused where the GEMV kernel applies."""
        assert self.bias is None
        if self.weight_scale is not None:
            return any_linear(silu_and_mul(gate_up), self.weight, None, self.weight_scale)
        return silu_mul_linear(gate_up, self.weight, silu_and_mul)


def any_linear(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    weight_scale: torch.Tensor | None,
) -> torch.Tensor:
    """``linear``, or the FP8 product where the weight has a scale: on CUDA,
    a few rows in ``fp8_skinny``'s one kernel, else ``fp8.linear``."""
    if weight_scale is None:
        return linear(x, weight, bias)
    if x.is_cuda and x.dim() == 2:
        t = fp8_skinny.fits(x, weight)
        if t is not None:
            return fp8_skinny.run(x, weight, weight_scale, bias, t)
    return fp8_math.linear(x, weight, weight_scale, bias)
