"""Per-token FP8 quantization of activations in one Triton kernel (CUDA).

``engine.layers.fp8.quantize_rows`` in torch ops is five kernels (amax, two
divisions, clamp, cast) per projection; before ``torch._scaled_mm`` at decode
batch sizes those launches cost more than the work. Here one program per row
finds the row's amax over K, then writes ``round_e4m3(x / s)`` and ``s``: the
same numbers (IEEE divisions, as torch's).
"""

from __future__ import annotations

from functools import cache
from typing import Any

import torch

E4M3 = torch.float8_e4m3fn
E4M3_MAX = float(torch.finfo(E4M3).max)
SCALE_FLOOR = 1e-12
"""Floor of a scale, so an all-zero row or token quantizes to zeros."""


@cache
def _kernel() -> Any:
    import triton
    import triton.language as tl

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
    ):
        row = tl.program_id(0).to(tl.int64)
        kk = tl.arange(0, BLOCK_K)
        amax = tl.zeros([BLOCK_K], dtype=tl.float32)
        for k0 in range(0, K, BLOCK_K):
            v = tl.load(x + row * stride_x + k0 + kk, mask=k0 + kk < K, other=0.0)
            amax = tl.maximum(amax, tl.abs(v.to(tl.float32)))
        s = tl.maximum(tl.math.div_rn(tl.max(amax, axis=0), FP8_MAX), FLOOR)
        for k0 in range(0, K, BLOCK_K):
            live = k0 + kk < K
            v = tl.load(x + row * stride_x + k0 + kk, mask=live, other=0.0).to(tl.float32)
            v = tl.clamp(tl.math.div_rn(v, s), -FP8_MAX, FP8_MAX)
            tl.store(q + row * stride_q + k0 + kk, v.to(tl.float8e4nv), mask=live)
        tl.store(scale + row, s)

    return quantize_rows_kernel


def quantize_rows(x: torch.Tensor, block_k: int = 1024) -> tuple[torch.Tensor, torch.Tensor]:
    """``(Q e4m3 [M, K], scale float32 [M])`` of ``x`` ``[M, K]`` (rows with
    unit stride), one kernel (any device Triton runs on)."""
    m, k = x.shape
    q = torch.empty((m, k), dtype=E4M3, device=x.device)
    scale = torch.empty(m, dtype=torch.float32, device=x.device)
    if m:
        _kernel()[(m,)](
            x, q, scale, k, x.stride(0), q.stride(0),
            FP8_MAX=E4M3_MAX, FLOOR=SCALE_FLOOR, BLOCK_K=min(block_k, 1 << (k - 1).bit_length()),
            num_warps=4,
        )  # fmt: skip
    return q, scale
