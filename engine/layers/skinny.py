"""Products of a few rows (small-batch decode) on CUDA, with the operands swapped.

At 2 to 64 rows a decode step still reads every weight once and does little
arithmetic on it, so its products are bound by the weights' bytes. cuBLAS
serves them with tiles sized for its M dimension, i.e. the rows; the kernel
here computes ``out.T = W @ x.T`` instead, so the matrix units' wide side runs
over the weight's output rows (``BLOCK_N``) and the narrow one over the input
rows (``BLOCK_M``, the row count rounded up to a power of two, at least 16).
Outputs with few row tiles and a long K (the down projection: 64 tiles of 64)
are split over K as well where that measured faster: each split stores its
float32 partial, and the last split of a tile to arrive (counted with an
atomic) adds them up and writes the output, so the product stays one kernel.

Used for ``[M, K]`` bf16/fp16 inputs on CUDA with 2 <= M <= 64 whose weight
fits the tiles of :func:`tiles`; anything else goes to ``F.linear``.
"""

from __future__ import annotations

from functools import cache
from typing import Any, NamedTuple

import torch

from engine.layers import pdl

MAX_ROWS = 64
PARTIAL_BYTES = 16 << 20
"""Float32 scratch of the split partials, per device; shapes whose partials would
not fit are not split."""
MAX_ROW_TILES = 1 << 16
"""Arrival counters per device: one per row tile of the widest split output."""


class Tiles(NamedTuple):
    block_n: int
    block_k: int
    split_k: int
    warps: int
    stages: int


def block_m(m: int) -> int:
    """The input-row tile for ``m`` rows: a power of two, at least 16 (the matrix
    instructions' narrowest operand)."""
    return max(16, 1 << (m - 1).bit_length())


_TILES: dict[tuple[str, int], Tiles | None] = {
    ("small", 16): Tiles(64, 256, 1, 4, 4),
    ("small", 32): Tiles(64, 256, 1, 4, 4),
    ("small", 64): None,
    ("long_k", 16): Tiles(64, 256, 1, 4, 5),
    ("long_k", 32): Tiles(64, 256, 2, 4, 4),
    ("long_k", 64): Tiles(64, 128, 2, 4, 5),
    ("wide", 16): Tiles(128, 128, 1, 4, 4),
    ("wide", 32): Tiles(128, 128, 1, 4, 4),
    ("wide", 64): Tiles(128, 64, 1, 4, 4),
}
"""(kind of weight, input-row tile) -> tiles; None: cuBLAS was as fast. Measured
on an H200 over Llama-3.1-8B's shapes (``python -m benchmarks.kernels.bench_gemv --rows``):
"small" is a matrix of at most 8192 x 4096 (QKV, o), "long_k" one with K of
8192 or more (down), "wide" the rest (gate/up, LM head). Each entry fits the
SM's shared memory at its own row tile only."""


def tiles(m: int, n: int, k: int) -> Tiles | None:
    """The tiles for ``m`` rows against an ``[n, k]`` weight, or None where the
    kernel does not apply (cuBLAS serves it)."""
    if not 2 <= m <= MAX_ROWS:
        return None
    kind = "small" if n * k <= 8192 * 4096 else "long_k" if k >= 8192 else "wide"
    t = _TILES[kind, block_m(m)]
    return t if t is not None and applies(t, m, n, k) else None


def applies(t: Tiles, m: int, n: int, k: int) -> bool:
    """Whether ``t`` tiles ``m`` rows against an ``[n, k]`` weight: whole tiles
    and, when split, partials and counters within the device's scratch."""
    if n % t.block_n or k % (t.block_k * t.split_k):
        return False
    return t.split_k == 1 or (
        t.split_k * n * block_m(m) * 4 <= PARTIAL_BYTES and n // t.block_n <= MAX_ROW_TILES
    )


@cache
def _kernel() -> Any:
    import triton
    import triton.language as tl

    prologue = pdl.prologue()

    @triton.jit
    def skinny(x_ptr, w_ptr, b_ptr, out_ptr, part_ptr, count_ptr, M, N, K, stride_xm,
               HAS_BIAS: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
               BLOCK_K: tl.constexpr, SPLIT_K: tl.constexpr, PDL: tl.constexpr = False):  # fmt: skip
        if PDL:  # engine.layers.pdl; a constant: nothing at all when off
            prologue()
        pid_n = tl.program_id(0)
        pid_k = tl.program_id(1)
        rows = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        ms = tl.arange(0, BLOCK_M)
        m_ok = ms < M
        k_len = K // SPLIT_K
        acc = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
        for k in range(pid_k * k_len, (pid_k + 1) * k_len, BLOCK_K):
            cols = k + tl.arange(0, BLOCK_K)
            w = tl.load(w_ptr + rows[:, None] * K + cols[None, :])
            xt = tl.load(
                x_ptr + ms[None, :] * stride_xm + cols[:, None], mask=m_ok[None, :], other=0.0
            )
            acc = tl.dot(w, xt, acc)
        out_ptrs = out_ptr + ms[None, :] * N + rows[:, None]
        if SPLIT_K == 1:
            if HAS_BIAS:
                acc += tl.load(b_ptr + rows).to(tl.float32)[:, None]
            tl.store(out_ptrs, acc.to(out_ptr.dtype.element_ty), mask=m_ok[None, :])
        else:
            # Partials as [split, N, BLOCK_M]; the barrier orders every thread's
            # stores before the (release) count, and the last arrival reads them
            # from L2 (.cg), where the other SMs' stores landed.
            parts = part_ptr + rows[:, None] * BLOCK_M + ms[None, :]
            tl.store(parts + pid_k * N * BLOCK_M, acc)
            tl.debug_barrier()
            arrived = tl.atomic_add(count_ptr + pid_n, 1, sem="acq_rel")
            if arrived == SPLIT_K - 1:
                total = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
                for s in tl.static_range(SPLIT_K):
                    total += tl.load(parts + s * N * BLOCK_M, cache_modifier=".cg")
                if HAS_BIAS:
                    total += tl.load(b_ptr + rows).to(tl.float32)[:, None]
                tl.store(out_ptrs, total.to(out_ptr.dtype.element_ty), mask=m_ok[None, :])
                # Ready for the next product: kernels on the stream run in order.
                tl.atomic_xchg(count_ptr + pid_n, 0)

    return skinny


_scratch: dict[torch.device, tuple[torch.Tensor, torch.Tensor]] = {}


def scratch_of(device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """The device's partials and arrival counters. One set serves every product:
    the engine runs its forwards on one stream, so no two split products are in
    flight at once, and each leaves its counters at zero."""
    s = _scratch.get(device)
    if s is None:
        s = _scratch[device] = (
            torch.empty(PARTIAL_BYTES // 4, dtype=torch.float32, device=device),
            torch.zeros(MAX_ROW_TILES, dtype=torch.int32, device=device),
        )
    return s


def fits(x: torch.Tensor, w: torch.Tensor) -> Tiles | None:
    """The tiles for ``x @ w.T`` on the kernel, or None where it does not apply."""
    if not (x.is_cuda and x.dim() == 2 and x.stride(1) == 1):
        return None
    if x.dtype not in (torch.bfloat16, torch.float16) or w.dtype != x.dtype:
        return None
    if not w.is_contiguous() or w.shape[1] != x.shape[1]:
        return None
    return tiles(x.shape[0], w.shape[0], w.shape[1])


def run_skinny(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, t: Tiles
) -> torch.Tensor:
    """The kernel on ``x`` ``[M, K]`` (any device Triton runs on)."""
    m, k = x.shape
    n = weight.shape[0]
    out = torch.empty((m, n), dtype=x.dtype, device=x.device)
    parts, counts = scratch_of(x.device) if t.split_k > 1 else (out, out)
    _kernel()[(n // t.block_n, t.split_k)](
        x, weight, weight if bias is None else bias, out, parts, counts, m, n, k, x.stride(0),
        HAS_BIAS=bias is not None, BLOCK_M=block_m(m), BLOCK_N=t.block_n, BLOCK_K=t.block_k,
        SPLIT_K=t.split_k, num_warps=t.warps, num_stages=t.stages, **pdl.launch_options(x.device),
    )  # fmt: skip
    return out
