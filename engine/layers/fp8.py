"""FP8 (e4m3) linear weights with one scale per output channel.

A weight ``W [N, K]`` is stored as ``Q = round_e4m3(W / s)`` with
``s[n] = max_k |W[n, k]| / 448`` (448: e4m3's largest finite value), so each
row uses the format's whole range. Activations are quantized the same way per
token (row of ``x``) when the product runs, so

    y[m, n] = sx[m] * s[n] * sum_k Qx[m, k] * Q[n, k]

is the FP8 product: ``reference_product`` computes it in float32 from the
dequantized values (the definition), ``linear`` through ``torch._scaled_mm``
where that applies. The attention and MLP projections take FP8 weights; the
embedding, the LM head and the norms stay in the model's dtype.

Checkpoint formats read (``engine.model_config``'s ``quantization``): FP8
weights with a ``weight_scale`` per output channel (``[N, 1]`` or ``[N]``) or
per tensor (a scalar), as compressed-tensors' ``float-quantized`` format and
the plain ``fp8`` method without blocks store them. An ``input_scale`` (a
static activation scale) is not used: activations are always scaled per token.
"""

from __future__ import annotations

from functools import cache

import torch

from engine.layers import fp8_quant
from engine.layers.fp8_quant import E4M3, E4M3_MAX, PRECISE_K, SCALE_FLOOR, Quantized


def quantize_rows(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``(Q e4m3 [N, K], scale float32 [N])`` of ``w`` ``[N, K]``, one scale per row."""
    w32 = w.float()
    scale = (w32.abs().amax(dim=-1) / E4M3_MAX).clamp_min(SCALE_FLOOR)
    q = (w32 / scale[:, None]).clamp(-E4M3_MAX, E4M3_MAX).to(E4M3)
    return q, scale


def dequantize_rows(q: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """float32 ``Q * scale`` row by row."""
    return q.float() * scale.float()[:, None]


def linear(
    x: torch.Tensor | Quantized,
    q: torch.Tensor,
    scale: torch.Tensor,
    bias: torch.Tensor | None = None,
) -> torch.Tensor:
    """``x @ W.T (+ bias)`` for the FP8 weight ``(q, scale)``, ``x`` quantized
    per token (here, or already by the kernel that made it: ``Quantized``);
    the result in ``x``'s dtype. ``torch._scaled_mm`` (cuBLASLt's FP8
    tensor-core GEMM on Hopper, its own kernel on the CPU) where it takes the
    shapes and dtype, summing in the tensor cores' own accumulator up to
    ``fp8_quant.PRECISE_K``, else ``reference_product``. (On CUDA a few rows
    take ``engine.layers.fp8_skinny`` instead: ``engine.layers.linear.any_linear``.)"""
    if isinstance(x, Quantized):
        xq, sx, dtype, lead = x.q, x.scale, x.dtype, x.q.shape[:-1]
    else:
        x2 = x.reshape(-1, x.shape[-1])
        # On CUDA in one kernel (fp8_quant), elsewhere in torch ops: the same numbers.
        xq, sx = fp8_quant.quantize_rows(x2) if x2.is_cuda else quantize_rows(x2)
        dtype, lead = x.dtype, x.shape[:-1]
    if scaled_mm_fits(xq, q, dtype):
        y = torch._scaled_mm(
            xq,
            q.t(),
            scale_a=sx[:, None].contiguous(),
            scale_b=scale.float()[None, :].contiguous(),
            out_dtype=dtype,
            use_fast_accum=q.shape[1] <= PRECISE_K,
        )
    else:
        y = reference_product(xq, sx, q, scale).to(dtype)
    if bias is not None:
        y = y + bias
    return y.reshape(*lead, q.shape[0])


def scaled_mm_fits(xq: torch.Tensor, q: torch.Tensor, dtype: torch.dtype) -> bool:
    """Whether ``torch._scaled_mm`` takes this product with one scale per row
    of each operand: both dims of the weight multiples of 16; on CUDA a GPU
    with FP8 tensor cores (sm 8.9+) and a bf16 result."""
    if q.shape[0] % 16 or q.shape[1] % 16:
        return False
    if xq.is_cuda:
        return dtype == torch.bfloat16 and _fp8_tensor_cores(xq.device.index)
    return dtype in (torch.float32, torch.bfloat16, torch.float16)


@cache
def _fp8_tensor_cores(device_index: int | None) -> bool:
    """Whether the GPU has FP8 tensor cores (sm 8.9+); asked once per device,
    not on every product."""
    return torch.cuda.get_device_capability(device_index) >= (8, 9)


def reference_product(
    xq: torch.Tensor, sx: torch.Tensor, q: torch.Tensor, scale: torch.Tensor
) -> torch.Tensor:
    """float32 ``sx[m] * scale[n] * sum_k xq[m, k] * q[n, k]`` from the
    dequantized values: the definition, on any device."""
    return (xq.float() @ q.float().t()) * sx.float()[:, None] * scale.float()[None, :]


def weight_format(module: torch.nn.Module, fp8: bool) -> None:
    """Set ``module.weight_scale``: None for its full-precision ``weight``; with
    ``fp8``, an e4m3 ``weight`` of the same shape in place of that one and its
    float32 scale per output row."""
    if not fp8:
        module.register_parameter("weight_scale", None)
        return
    w = module.weight
    module.weight = torch.nn.Parameter(
        torch.empty(w.shape, dtype=E4M3, device=w.device), requires_grad=False
    )
    module.weight_scale = torch.nn.Parameter(
        torch.ones(w.shape[0], dtype=torch.float32, device=w.device), requires_grad=False
    )
