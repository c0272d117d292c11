"""Causal attention of fresh prompts in Triton, planned on the device.

A forward whose every request starts at position 0 (no cached prefix, no
decode rows) holds its whole attention in its own QKV output: row ``i``
attends rows ``i - positions[i]`` through ``i``, where ``positions[i]`` is
its position in its prompt and the rows of a prompt are consecutive. The
kernel reads q, k and v through their strides (views into the QKV
projection's output, after the rotary embedding) and finds each row's first
key from the positions alone. So it needs no schedule from the host: its
grid depends only on the number of rows, and a CUDA graph of a token bucket
replays it for any prompts that fill the bucket. FlashInfer's prefill needs
``plan()`` on the host every forward, the longest host work before a
prompt's first attention call, which the device waits for on a lone prompt
(docs/benchmarks.md, FP8 prefill).

One program per query head and block of ``BLOCK_M`` rows: an online softmax
over key tiles of ``BLOCK_N`` rows, from the first key of the block's
earliest prompt to the block's last row; the causal mask and each row's own
first key mask the rest. A block may hold the end of one prompt and the
start of the next. Rows past ``n_rows`` (a bucket's padding) are neither
read as keys nor written; a row whose position says more than its index
(stale padding positions) attends from row 0, so nothing is read out of
bounds.

Not for rows that attend cached pages (a prefix, decode rows): those go to
the paged kernels. The KV pages are written apart (the layer's KV write).
"""

from __future__ import annotations

from functools import cache
from typing import Any, NamedTuple

import torch

from engine.layers import pdl


class FreshTiles(NamedTuple):
    """Rows a program (``block_m``), keys a tile (``block_n``), warps, stages.

    The default is the fastest of the tiles ``bench_prefill_attention``
    times on the H200 at 1024, 2048 and 4x256 prompt tokens (docs/benchmarks.md,
    FP8 prefill); compiled for sm_90 at head sizes 128 and 64 it spills
    nothing and copies K and V 16 bytes at a time (``cp.async``;
    ``tests/test_triton_sm90.py``)."""

    block_m: int = 64
    block_n: int = 64
    warps: int = 4
    stages: int = 2


WIDE_HEAD_TILES = FreshTiles(64, 64, 8, 2)
"""The default past head size 128: on 4 warps a 64 x 256 fp32 accumulator
spills; on 8 it does not (``tests/test_triton_sm90.py``)."""


@cache
def _kernel() -> Any:
    import triton
    import triton.language as tl

    prologue = pdl.prologue()

    # The strides stay specialized: divisible by 16, they let K and V tiles be
    # copied 16 bytes at a time; unspecialized, element by element.
    @triton.jit(do_not_specialize=["n_rows"])
    def fresh_attend(q, k, v, positions, out, n_rows,
                     stride_qt, stride_qh, stride_kt, stride_kh, stride_vt, stride_vh,
                     stride_ot, stride_oh, qk_scale,
                     G: tl.constexpr, D: tl.constexpr, BLOCK_M: tl.constexpr,
                     BLOCK_N: tl.constexpr, KV_E4M3: tl.constexpr = False,
                     PDL: tl.constexpr = False):  # fmt: skip
        if PDL:  # engine.layers.pdl; a constant: nothing at all when off
            prologue()
        # Heads vary fastest and the last blocks (the most keys under the
        # causal mask) start first, so the short ones fill in behind them.
        h = tl.program_id(0)
        block = tl.num_programs(1) - 1 - tl.program_id(1)
        kv_h = h // G
        rows = block * BLOCK_M + tl.arange(0, BLOCK_M)
        live = rows < n_rows
        pos = tl.load(positions + rows, mask=live, other=0).to(tl.int32)
        first = tl.maximum(rows - pos, 0)  # the first row of each row's prompt
        lo = tl.min(tl.where(live, first, n_rows))
        hi = tl.minimum(block * BLOCK_M + BLOCK_M, n_rows)
        # Tiles from `clear` (past every row's first key) that end by the
        # block's first row are attended whole by every row: no mask.
        clear = tl.cdiv(tl.max(tl.where(live, first, 0)), BLOCK_N) * BLOCK_N
        d = tl.arange(0, D)
        qb = tl.load(q + rows[:, None] * stride_qt + h * stride_qh + d[None, :],
                     mask=live[:, None], other=0.0)  # fmt: skip
        m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
        l_i = tl.zeros([BLOCK_M], tl.float32)
        acc = tl.zeros([BLOCK_M, D], tl.float32)
        # A block of padding alone has lo = hi: no tile.
        for start in range(tl.where(lo < hi, (lo // BLOCK_N) * BLOCK_N, hi), hi, BLOCK_N):
            cols = start + tl.arange(0, BLOCK_N)
            inside = cols < hi
            kb = tl.load(k + cols[:, None] * stride_kt + kv_h * stride_kh + d[None, :],
                         mask=inside[:, None], other=0.0)  # fmt: skip
            if KV_E4M3:  # as the pages hold it: saturated, rounded to e4m3
                kb = tl.clamp(kb.to(tl.float32), -448.0, 448.0).to(tl.float8e4nv).to(qb.dtype)
            s = tl.dot(qb, tl.trans(kb))  # unscaled: the scale goes into one fma below
            if (start < clear) | (start + BLOCK_N > block * BLOCK_M):
                ok = (cols[None, :] <= rows[:, None]) & (cols[None, :] >= first[:, None])
                s = tl.where(ok, s, float("-inf"))
            m_new = tl.maximum(m_i, tl.max(s, 1) * qk_scale)  # log2 units
            # A row with no key in this tile yet keeps -inf: subtract 0 then,
            # so that its weights are 0 rather than NaN.
            m_use = tl.where(m_new == float("-inf"), 0.0, m_new)
            alpha = tl.math.exp2(m_i - m_use)
            p = tl.math.exp2(s * qk_scale - m_use[:, None])
            l_i = l_i * alpha + tl.sum(p, 1)
            vb = tl.load(v + cols[:, None] * stride_vt + kv_h * stride_vh + d[None, :],
                         mask=inside[:, None], other=0.0)  # fmt: skip
            if KV_E4M3:
                vb = tl.clamp(vb.to(tl.float32), -448.0, 448.0).to(tl.float8e4nv).to(qb.dtype)
            acc = acc * alpha[:, None] + tl.dot(p.to(vb.dtype), vb)
            m_i = m_new
        acc = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]
        tl.store(out + rows[:, None] * stride_ot + h * stride_oh + d[None, :],
                 acc.to(out.dtype.element_ty), mask=live[:, None])  # fmt: skip

    return fresh_attend


def check(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor) -> None:
    """Shapes and layouts the kernel takes: q and out ``[n, heads, D]``, k and
    v ``[n, kv_heads, D]``, the last dimension contiguous, heads a multiple
    of the KV heads, D a power of two from 16."""
    n, heads, head_dim = q.shape
    if k.shape != v.shape or k.shape[0] != n or k.shape[2] != head_dim:
        raise ValueError(f"k and v must be [{n}, kv_heads, {head_dim}], got {k.shape}, {v.shape}")
    if out.shape != q.shape:
        raise ValueError(f"out must be {tuple(q.shape)}, got {tuple(out.shape)}")
    if heads % k.shape[1]:
        raise ValueError(f"{heads} query heads do not group over {k.shape[1]} KV heads")
    if head_dim < 16 or head_dim & (head_dim - 1):
        raise ValueError(f"head_dim must be a power of two from 16, got {head_dim}")
    if any(t.stride(-1) != 1 for t in (q, k, v, out)):
        raise ValueError("q, k, v and out need a contiguous last dimension")


def fresh_prefill(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    positions: torch.Tensor,
    out: torch.Tensor,
    sm_scale: float,
    n_rows: int | None = None,
    fresh_tiles: FreshTiles | None = None,
    kv_e4m3: bool = False,
) -> torch.Tensor:
    """Causal attention of fresh prompts (module doc) into ``out``: q, k, v
    and out as ``check`` takes them, ``positions`` ``[n]`` each row's position
    in its prompt. ``n_rows``: the rows that are real (default all); the
    rest are padding, neither attended nor written. ``kv_e4m3``: k and v
    are attended as e4m3 pages hold them (saturated at +-448, rounded), so
    that the result is what a paged kernel over those pages computes."""
    check(q, k, v, out)
    n, heads, head_dim = q.shape
    rows = n if n_rows is None else n_rows
    t = fresh_tiles or (FreshTiles() if head_dim <= 128 else WIDE_HEAD_TILES)
    if n == 0:
        return out
    grid = (heads, -(-n // t.block_m))
    log2e = 1.4426950408889634
    _kernel()[grid](
        q, k, v, positions, out, rows,
        q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1),
        out.stride(0), out.stride(1), sm_scale * log2e,
        G=heads // k.shape[1], D=head_dim, BLOCK_M=t.block_m, BLOCK_N=t.block_n, KV_E4M3=kv_e4m3,
        num_warps=t.warps, num_stages=t.stages, **pdl.launch_options(q.device),
    )  # fmt: skip
    return out
