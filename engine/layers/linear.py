"""Linear layers whose weights may be loaded in named shards (fused QKV, gate/up).

With ``fp8=True`` a layer holds an e4m3 weight and a float32 ``weight_scale``
per output row (``engine.layers.fp8``); otherwise ``weight_scale`` is None."""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

from engine.layers import fp8 as fp8_math
from engine.layers import fp8_quant, fp8_skinny
from engine.layers.fp8_quant import Deferred, Quantized
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

    def forward(self, x: torch.Tensor | Quantized) -> torch.Tensor:
        return any_linear(x, self.weight, self.bias, self.weight_scale)


class Linear(nn.Linear):
    """``nn.Linear`` whose one-row CUDA inputs take the GEMV kernel."""

    def __init__(
        self, in_features: int, out_features: int, bias: bool = True, fp8: bool = False
    ) -> None:
        super().__init__(in_features, out_features, bias)
        fp8_math.weight_format(self, fp8)

    def forward(self, x: torch.Tensor | Quantized | Deferred) -> torch.Tensor:
        return any_linear(x, self.weight, self.bias, self.weight_scale)

    def silu_mul_forward(
        self, gate_up: torch.Tensor, silu_and_mul: Callable[[torch.Tensor], torch.Tensor]
    ) -> torch.Tensor:
        """``self(silu_and_mul(gate_up))``, fused where the GEMV kernel applies."""
        assert self.bias is None
        if self.weight_scale is not None:
            return self(silu_mul_input(self, gate_up, silu_and_mul))
        return silu_mul_linear(gate_up, self.weight, silu_and_mul)


def any_linear(
    x: torch.Tensor | Quantized | Deferred,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    weight_scale: torch.Tensor | None,
) -> torch.Tensor:
    """``linear``, or the FP8 product where the weight has a scale. On CUDA
    the rows are quantized per token first (unless they come ``Quantized``)
    by the same kernels at every batch size; a few rows then take
    ``fp8_skinny``, more ``fp8.linear`` (``torch._scaled_mm``). ``Deferred``
    rows (``gated_mlp``) only ever meet the weight they were made for."""
    if weight_scale is None:
        assert not isinstance(x, (Quantized, Deferred)), "FP8 rows for a full-precision weight"
        return linear(x, weight, bias)
    if isinstance(x, Deferred):
        t = fp8_skinny.fits(x, weight)
        if t is None:
            raise ValueError(f"deferred rows {tuple(x.shape)} for a {tuple(weight.shape)} weight")
        return fp8_skinny.run(x, weight, weight_scale, bias, t)
    if not isinstance(x, Quantized) and _quantizes_on_cuda(x, weight):
        x = Quantized(*fp8_quant.quantize_rows(x), x.dtype)
    if isinstance(x, Quantized) and x.q.is_cuda:
        t = fp8_skinny.fits(x, weight)
        if t is not None:
            return fp8_skinny.run(x, weight, weight_scale, bias, t)
    return fp8_math.linear(x, weight, weight_scale, bias)


def _quantizes_on_cuda(rows: torch.Tensor, weight: torch.Tensor) -> bool:
    """Whether FP8 products quantize ``rows`` (bf16 ``[M, K]`` on CUDA) in
    ``fp8_quant``'s kernels, which hold a row of up to ``FUSED_MAX_K``."""
    return (
        rows.is_cuda
        and rows.dtype == torch.bfloat16
        and rows.dim() == 2
        and rows.stride(-1) == 1
        and weight.shape[1] <= fp8_quant.FUSED_MAX_K
    )


def quantized_upstream(layer: nn.Module, rows: torch.Tensor) -> bool:
    """Whether ``layer`` takes its input quantized per token by the kernel
    that makes it (a norm, SiLU-and-mul: ``engine.layers.fp8_quant``): an
    FP8 weight and ``rows`` (the input, or what it is made from, row for
    row) bf16 on CUDA. At every batch size alike, so that a request's
    quantized activations do not depend on its batch."""
    if getattr(layer, "weight_scale", None) is None:
        return False
    return _quantizes_on_cuda(rows, layer.weight)


GATED_MLP = True
"""Whether an FP8 MLP of up to ``fp8_skinny.DEFERRED_ROWS`` rows computes
SiLU-and-mul in its gate/up product (``gated_mlp``): the same numbers as the
three kernels, a step of Llama-3.1-8B at one row 0.06 ms shorter on an H100
(docs/benchmarks.md, FP8)."""


def gated_mlp(gate_up: nn.Module, down: nn.Module, x: torch.Tensor | Quantized) -> Deferred | None:
    """``silu(gate) * up`` of ``gate_up(x)``, for ``down`` to quantize as it
    loads it (``fp8_skinny.gated``): one kernel in place of the gate/up
    product and the SiLU-and-mul quantization, with the same numbers. Where
    both layers hold FP8 weights, no bias, and ``x`` is a few rows quantized
    on CUDA (as every FP8 MLP's input is there: ``quantized_upstream``); else
    None."""
    if not GATED_MLP or not isinstance(x, Quantized) or not x.q.is_cuda:
        return None
    if getattr(gate_up, "weight_scale", None) is None or gate_up.bias is not None:
        return None
    if getattr(down, "weight_scale", None) is None or getattr(down, "bias", None) is not None:
        return None
    t = fp8_skinny.gated_fits(x, gate_up.weight)
    if t is None or fp8_skinny.tiles(*down.weight.shape) is None:
        return None
    if down.weight.shape[1] * 2 != gate_up.weight.shape[0]:
        return None
    return fp8_skinny.gated(x, gate_up.weight, gate_up.weight_scale, t)


def silu_mul_input(
    layer: nn.Module,
    gate_up: torch.Tensor,
    silu_and_mul: Callable[[torch.Tensor], torch.Tensor],
) -> torch.Tensor | Quantized:
    """``silu_and_mul(gate_up)``, quantized in the same kernel where
    ``layer`` takes it so."""
    if quantized_upstream(layer, gate_up):
        return fp8_quant.silu_mul_quantize(gate_up)
    return silu_and_mul(gate_up)
