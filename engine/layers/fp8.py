"""FP8 (e4m3) linear weights with one scale per output channel.

A weight ``W [N, K]`` is stored as ``Q = round_e4m3(W / s)`` with
``s[n] = max_k |W[n, k]| / 448`` (448: e4m3's largest finite value), so each
row uses the format's whole range. Activations are quantized the same way per
token (row of ``x``) when the product runs, so

    y[m, n] = sx[m] * s[n] * sum_k Qx[m, k] * Q[n, k]

is the FP8 product. ``linear`` computes that sum in float32 from the
dequantized values on any device: the definition the tensor-core kernels are
checked against. The attention and MLP projections take FP8 weights; the
embedding, the LM head and the norms stay in the model's dtype.

Checkpoint formats read (``engine.model_config``'s ``quantization``): FP8
weights with a ``weight_scale`` per output channel (``[N, 1]`` or ``[N]``) or
per tensor (a scalar), as compressed-tensors' ``float-quantized`` format and
the plain ``fp8`` method without blocks store them. An ``input_scale`` (a
static activation scale) is not used: activations are always scaled per token.
"""

from __future__ import annotations

import torch

E4M3 = torch.float8_e4m3fn
E4M3_MAX = 448.0
TINY = 1e-12
"""Floor of a scale, so an all-zero row or token quantizes to zeros."""


def quantize_rows(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``(Q e4m3 [N, K], scale float32 [N])`` of ``w`` ``[N, K]``, one scale per row."""
    w32 = w.float()
    scale = (w32.abs().amax(dim=-1) / E4M3_MAX).clamp_min(TINY)
    q = (w32 / scale[:, None]).clamp(-E4M3_MAX, E4M3_MAX).to(E4M3)
    return q, scale


def dequantize_rows(q: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """float32 ``Q * scale`` row by row."""
    return q.float() * scale.float()[:, None]


def linear(
    x: torch.Tensor, q: torch.Tensor, scale: torch.Tensor, bias: torch.Tensor | None = None
) -> torch.Tensor:
    """``x @ W.T (+ bias)`` for the FP8 weight ``(q, scale)``, ``x`` quantized
    per token: the sum in float32, the result in ``x``'s dtype."""
    xq, sx = quantize_rows(x.reshape(-1, x.shape[-1]))
    y = (xq.float() @ q.float().t()) * sx[:, None] * scale.float()[None, :]
    if bias is not None:
        y = y + bias.float()
    return y.to(x.dtype).reshape(*x.shape[:-1], q.shape[0])


def fp8_parameters(module: torch.nn.Module, out_features: int, in_features: int) -> None:
    """Give ``module`` an e4m3 ``weight`` ``[out, in]`` and its float32
    ``weight_scale`` ``[out]`` in place of a full-precision weight."""
    device = module.weight.device if getattr(module, "weight", None) is not None else None
    module.weight = torch.nn.Parameter(
        torch.empty(out_features, in_features, dtype=E4M3, device=device), requires_grad=False
    )
    module.weight_scale = torch.nn.Parameter(
        torch.ones(out_features, dtype=torch.float32, device=device), requires_grad=False
    )
