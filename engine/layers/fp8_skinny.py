"""FP8 products of a few rows (small-batch decode) on the FP8 tensor cores.

At 1 to ``MAX_ROWS`` rows a product is bound by the weight's bytes, which e4m3
halves; a kernel that widened each e4m3 byte to a float on the CUDA cores was
slower on the H200 than the bf16 one (docs/benchmarks.md, FP8). Here the
tensor cores take the e4m3 weight as it is stored, with the operands
swapped as ``engine.layers.skinny`` does for bf16: ``out.T = Q @ xq.T``, the
matrix units' wide side over the weight's output rows (``BLOCK_N``), the
narrow one over the input rows (padded to 16, 32 or 64: ``block_m``):

    y[m, n] = sx[m] * s[n] * sum_k round_e4m3(x[m, k] / sx[m]) * Q[n, k]

the same numbers as ``engine.layers.fp8.linear`` up to the order of the sum.
The engine hands it rows quantized already (``Quantized``: by the norm or
SiLU-and-mul before it, or ``fp8_quant.quantize_rows``), the same rows a
larger batch hands ``torch._scaled_mm``, so a request's activations do not
depend on its batch. Given half-precision rows, each program quantizes them
itself (their amax over all of K, then ``round_e4m3(x / sx)``), so such a
product is one kernel.
Outputs with few row tiles and a long K may also be split over K, the partials
added by the last split to arrive (``engine.layers.skinny``'s scheme and its
scratch).

An MLP of up to ``DEFERRED_ROWS`` rows can take two kernels, not three
(``gated``, then ``run`` on its ``Deferred`` output; ``linear.GATED_MLP``):
the gate/up product computes ``silu(gate) * up`` in its epilogue, each
program a gate tile and the up tile of the same columns, and stores it in
the model's dtype with each program's largest magnitude per row; the down
product reduces those maxima to the row's scale and quantizes each k tile it
streams in (padding rows too: the cost does not grow with the rows; one row
alone, repeated over the tile's columns, where there is one). The
numbers are those of the separate SiLU-and-mul quantization kernel
(``fp8_quant.silu_mul_quantize``), whose launch, and whose pass over the row
on a single SM at one row, this saves.
"""

from __future__ import annotations

from functools import cache
from typing import Any, NamedTuple

import torch

from engine.layers import pdl
from engine.layers.fp8_quant import E4M3, E4M3_MAX, PRECISE_K, SCALE_FLOOR, Deferred, Quantized
from engine.layers.skinny import MAX_ROW_TILES, PARTIAL_BYTES, scratch_of

MAX_ROWS = 64
"""Rows this kernel takes, in one input-row tile (``fits``); more go to
``torch._scaled_mm``, which at 17 to 64 rows was slower than the bf16 product
on the H200 (docs/benchmarks.md, FP8)."""
BLOCK_M = 16
"""The narrowest input-row tile: the matrix instructions' narrowest operand."""
DEFERRED_ROWS = BLOCK_M
"""Most rows a product quantizes as it loads them (``Deferred``): one row
tile, whose every element (padding too) each k tile quantizes."""


def block_m(m: int) -> int:
    """The input-row tile of ``m`` rows: 16, 32 or 64."""
    return max(BLOCK_M, 1 << (m - 1).bit_length())


class Tiles(NamedTuple):
    block_n: int
    block_k: int
    split_k: int
    warps: int
    stages: int
    unroll_scale: bool = True
    """The scale pass unrolled over K (its loads in flight together)."""
    precise: bool = False
    """Each k tile's sum added to a float32 one (Triton's
    ``max_num_imprecise_acc``), rather than the tensor cores accumulating
    all of a program's K in their own narrower accumulator (sm_90)."""


def tiles(n: int, k: int, rows_tile: int = BLOCK_M) -> Tiles | None:
    """The tiles for an ``[n, k]`` e4m3 weight against ``rows_tile`` input
    rows, quantized or ``Deferred``, or None where they do not fit. (The best
    of sweeps over Llama-3.1-8B's shapes. One row tile, on an H100: 64-row
    tiles over four stages, k tiles of 512 for weights of 4096 rows or fewer
    and of 256 for wider ones, and a K longer than ``PRECISE_K`` split in two
    with each k tile's sum kept in float32. On deferred rows the split is
    faster: their loop, which quantizes the row tile as each k tile streams
    in, is issue-bound rather than bound by the weight's bytes, so twice the
    programs on twice the SMs gain (``bench_fp8 --mlp``'s deferred sweep). On
    quantized rows it is about as fast as one program a column tile, and the
    same tiles for both make the gated MLP's numbers those of the three
    kernels. Two or four row tiles, on an H200: shorter k tiles over three
    stages, the shared memory of a wider row tile, and splits of K for all
    but the wide weights, into sums of at most ``PRECISE_K``.)"""
    if rows_tile > BLOCK_M:
        t = Tiles(64, 256, 1 if n >= 16384 else 4 if n <= 4096 else 2, 4, 3)
        split = 1  # no program sums more than PRECISE_K in the tensor cores alone
        while k > split * PRECISE_K:
            split *= 2
        t = t._replace(split_k=max(t.split_k, split))
    else:
        long_k = k > PRECISE_K
        t = Tiles(64, 512 if n <= 4096 else 256, 2 if long_k else 1, 4, 4, precise=long_k)
    # A shorter k tile, then no split (each k tile's sum then kept in float32
    # where K is long), where K needs it.
    for c in (t, t._replace(split_k=1, precise=k > PRECISE_K)):
        while c.block_k > 128 and not applies(c, n, k, rows_tile):
            c = c._replace(block_k=c.block_k // 2)
        if applies(c, n, k, rows_tile):
            return c
    return None


def applies(t: Tiles, n: int, k: int, rows_tile: int = BLOCK_M) -> bool:
    """Whether ``t`` tiles an ``[n, k]`` weight: whole tiles and, when split,
    partials (``rows_tile`` rows of them) and counters within the device's
    scratch."""
    if n % t.block_n or k % (t.block_k * t.split_k):
        return False
    return t.split_k == 1 or (
        t.split_k * n * rows_tile * 4 <= PARTIAL_BYTES and n // t.block_n <= MAX_ROW_TILES
    )


@cache
def _kernel() -> Any:
    import triton
    import triton.language as tl

    prologue = pdl.prologue()
    l2_prefetch = pdl.l2_prefetch()

    @triton.jit
    def fp8_skinny(x, x_scale, w, w_scale, bias, out, part, count, maxes, M, N, stride_x,
                   K: tl.constexpr, FP8_MAX: tl.constexpr, SCALE_FLOOR: tl.constexpr,
                   HAS_BIAS: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                   BLOCK_K: tl.constexpr, SPLIT_K: tl.constexpr, UNROLL_SCALE: tl.constexpr,
                   PRE_QUANTIZED: tl.constexpr, GATED: tl.constexpr = False,
                   DEFERRED: tl.constexpr = False, PARTS: tl.constexpr = 1,
                   PARTS_BLOCK: tl.constexpr = 1, PRECISE: tl.constexpr = False,
                   ONE_ROW: tl.constexpr = False, PREFETCH: tl.constexpr = 0,
                   THREADS: tl.constexpr = 128, PDL: tl.constexpr = False):  # fmt: skip
        pid_n = tl.program_id(0)
        pid_k = tl.program_id(1)
        n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        if PREFETCH > 0:  # with PDL only (pdl.prefetch_bytes): the weight, before the wait
            first = (w + pid_k * (K // SPLIT_K)).to(tl.int64) + pid_n.to(tl.int64) * BLOCK_N * K
            l2_prefetch(first, K, PREFETCH, BLOCK_N, THREADS)
            if GATED:  # the up rows of the same columns
                l2_prefetch(first + N.to(tl.int64) * K, K, PREFETCH, BLOCK_N, THREADS)
        if PDL:  # engine.layers.pdl; a constant: nothing at all when off
            prologue()
        ms = tl.arange(0, BLOCK_M)
        m_ok = ms < M
        kk = tl.arange(0, BLOCK_K)
        # Each input row's scale, over all of K (every split quantizes alike):
        # its largest magnitude mapped to 448. Padding rows load as zeros.
        # Unrolled (K is a compile-time constant) the loads are independent
        # and in flight together: one memory latency, not one per tile of K.
        xs = x + ms[None, :] * stride_x + kk[:, None]
        if PRE_QUANTIZED:
            # x holds the rows in e4m3 already, their scales in x_scale.
            sx = tl.load(x_scale + ms, mask=m_ok, other=1.0)
        elif DEFERRED:
            # Deferred rows: x in half precision, each row's largest magnitude
            # spread over PARTS maxima ([M, PARTS] in maxes); the scale as
            # fp8_quant's kernels find it, and its reciprocal for the loop.
            pp = tl.arange(0, PARTS_BLOCK)
            parts_ok = (pp < PARTS)[:, None] & m_ok[None, :]
            mx = tl.load(maxes + ms[None, :] * PARTS + pp[:, None], mask=parts_ok, other=0.0)
            sx = tl.maximum(tl.math.div_rn(tl.max(mx, axis=0), FP8_MAX), SCALE_FLOOR)
            inv_sx = tl.math.div_rn(1.0, sx)
            if ONE_ROW:  # the same scale, of the one row, as a scalar
                mx1 = tl.load(maxes + pp, mask=pp < PARTS, other=0.0)
                sx1 = tl.maximum(tl.math.div_rn(tl.max(mx1, axis=0), FP8_MAX), SCALE_FLOOR)
                inv_sx1 = tl.math.div_rn(1.0, sx1)
        else:
            amax = tl.zeros([BLOCK_M], dtype=tl.float32)
            if UNROLL_SCALE:
                for k0 in tl.static_range(0, K, BLOCK_K):
                    xa = tl.load(xs + k0, mask=m_ok[None, :], other=0.0).to(tl.float32)
                    amax = tl.maximum(amax, tl.max(tl.abs(xa), axis=0))
            else:
                for k0 in range(0, K, BLOCK_K):
                    xa = tl.load(xs + k0, mask=m_ok[None, :], other=0.0).to(tl.float32)
                    amax = tl.maximum(amax, tl.max(tl.abs(xa), axis=0))
            sx = tl.maximum(amax / FP8_MAX, SCALE_FLOOR)
        k_len = K // SPLIT_K
        acc = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
        acc_up = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)  # GATED only
        for k0 in range(pid_k * k_len, (pid_k + 1) * k_len, BLOCK_K):
            wv = tl.load(w + n[:, None] * K + (k0 + kk)[None, :])
            if ONE_ROW:
                # One deferred row: its k tile quantized alone (as below) and
                # repeated over the tile's columns, not 16 rows quantized;
                # the padding columns' sums are never stored.
                xf = tl.load(x + k0 + kk).to(tl.float32)
                q0 = xf * inv_sx1
                xq1 = tl.fma(tl.fma(-q0, sx1, xf), inv_sx1, q0)
                xq1 = tl.clamp(xq1, -FP8_MAX, FP8_MAX).to(tl.float8e4nv)
                xq = tl.broadcast_to(xq1[:, None], (BLOCK_K, BLOCK_M))
            elif DEFERRED:
                xv = tl.load(xs + k0, mask=m_ok[None, :], other=0.0)
                # x / sx rounded as an IEEE division (fp8_quant's div_rn), in
                # three instructions: the quotient by the rounded reciprocal,
                # its remainder (exact in an fma), one correction (Markstein).
                xf = xv.to(tl.float32)
                q0 = xf * inv_sx[None, :]
                rem = tl.fma(-q0, sx[None, :], xf)
                xq = tl.fma(rem, inv_sx[None, :], q0)
                xq = tl.clamp(xq, -FP8_MAX, FP8_MAX).to(tl.float8e4nv)
            elif PRE_QUANTIZED:
                xq = tl.load(xs + k0, mask=m_ok[None, :], other=0.0)
            else:
                xv = tl.load(xs + k0, mask=m_ok[None, :], other=0.0)
                xq = tl.clamp(xv.to(tl.float32) / sx[None, :], -FP8_MAX, FP8_MAX)
                xq = xq.to(tl.float8e4nv)
            acc = tl.dot(wv, xq, acc, max_num_imprecise_acc=BLOCK_K if PRECISE else None)
            if GATED:  # the up rows of the same columns, N rows below
                wu = tl.load(w + (N + n)[:, None] * K + (k0 + kk)[None, :])
                acc_up = tl.dot(wu, xq, acc_up, max_num_imprecise_acc=BLOCK_K if PRECISE else None)
        scale = tl.load(w_scale + n)[:, None] * sx[None, :]
        out_ptrs = out + ms[None, :] * N + n[:, None]
        if GATED:
            # fp8_quant.silu_mul_quantize's value: gate and up rounded to the
            # output dtype as the product would store them, the SiLU product
            # rounded again; then this tile's largest magnitude per row.
            dt = out.dtype.element_ty
            g = (acc * scale).to(dt).to(tl.float32)
            u = (acc_up * (tl.load(w_scale + N + n)[:, None] * sx[None, :])).to(dt).to(tl.float32)
            y = (g / (1.0 + tl.exp(-g)) * u).to(dt)
            tl.store(out_ptrs, y, mask=m_ok[None, :])
            tile_max = tl.max(tl.abs(y.to(tl.float32)), axis=0)
            tl.store(maxes + ms * (N // BLOCK_N) + pid_n, tile_max, mask=m_ok)
        elif SPLIT_K == 1:
            y = acc * scale
            if HAS_BIAS:
                y += tl.load(bias + n).to(tl.float32)[:, None]
            tl.store(out_ptrs, y.to(out.dtype.element_ty), mask=m_ok[None, :])
        else:
            # engine.layers.skinny's protocol: partials as [split, N, BLOCK_M],
            # the barrier before the (release) count, the last arrival reads
            # them from L2 and leaves the counter at zero.
            parts = part + n[:, None] * BLOCK_M + ms[None, :]
            tl.store(parts + pid_k * N * BLOCK_M, acc)
            tl.debug_barrier()
            arrived = tl.atomic_add(count + pid_n, 1, sem="acq_rel")
            if arrived == SPLIT_K - 1:
                total = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
                for s in tl.static_range(SPLIT_K):
                    total += tl.load(parts + s * N * BLOCK_M, cache_modifier=".cg")
                y = total * scale
                if HAS_BIAS:
                    y += tl.load(bias + n).to(tl.float32)[:, None]
                tl.store(out_ptrs, y.to(out.dtype.element_ty), mask=m_ok[None, :])
                tl.atomic_xchg(count + pid_n, 0)

    return fp8_skinny


def _rows(x: torch.Tensor | Quantized | Deferred) -> torch.Tensor:
    return x.q if isinstance(x, Quantized) else x.rows if isinstance(x, Deferred) else x


def fits(x: torch.Tensor | Quantized | Deferred, q: torch.Tensor) -> Tiles | None:
    """The tiles for ``x`` ``[M, K]`` (``M <= MAX_ROWS``, contiguous rows, half
    precision, already quantized, or ``Deferred``: ``M <= DEFERRED_ROWS``)
    against the e4m3 weight ``q``, or None."""
    rows = _rows(x)
    if rows.dim() != 2 or not 1 <= rows.shape[0] <= MAX_ROWS or rows.stride(-1) != 1:
        return None
    if isinstance(x, Deferred) and rows.shape[0] > DEFERRED_ROWS:
        return None
    # x.dtype: the rows' own, or the dtype quantized rows were made in.
    if x.dtype not in (torch.bfloat16, torch.float16) or q.dtype != E4M3 or not q.is_contiguous():
        return None
    if q.shape[1] != rows.shape[1]:
        return None
    return tiles(q.shape[0], q.shape[1], block_m(rows.shape[0]))


def gated_tiles(n: int, k: int) -> Tiles | None:
    """The tiles of ``gated`` for a ``[2n, k]`` gate/up weight (one row tile,
    no split: the epilogue needs a column's whole sum), or None. (The best of
    ``bench_fp8 --mlp``'s sweep on Llama-3.1-8B's MLP, an H100, at 1, 4 and 16
    rows alike: two weight tiles of 64 x 256 a stage, over four stages.)"""
    for t in (Tiles(64, 256, 1, 4, 4), Tiles(64, 128, 1, 4, 4)):
        if applies(t, n, k):
            return t
    return None


def gated_fits(x: torch.Tensor | Quantized, q: torch.Tensor) -> Tiles | None:
    """The tiles of ``gated`` for ``x`` ``[M, K]`` against the gate/up weight
    ``q`` ``[2N, K]`` (``[gate | up]``), or None: at most ``DEFERRED_ROWS``
    rows, so that the down product can quantize them as it loads them."""
    if isinstance(x, Deferred) or q.shape[0] % 2 or fits(x, q) is None:
        return None
    if _rows(x).shape[0] > DEFERRED_ROWS:
        return None
    return gated_tiles(q.shape[0] // 2, q.shape[1])


def run(
    x: torch.Tensor | Quantized | Deferred,
    q: torch.Tensor,
    scale: torch.Tensor,
    bias: torch.Tensor | None,
    t: Tiles,
) -> torch.Tensor:
    """The kernel on ``x`` ``[M, K]`` (``M <= MAX_ROWS``), half precision
    (quantized here), ``Quantized`` (taken as it is) or ``Deferred``
    (quantized tile by tile as it is loaded), on any device Triton runs on."""
    rows = _rows(x)
    m, k = rows.shape
    n = q.shape[0]
    rows_tile = block_m(m)
    if m > MAX_ROWS or not applies(t, n, k, rows_tile):
        raise ValueError(f"tiles {t} do not take {m} rows against a [{n}, {k}] weight")
    if isinstance(x, Deferred) and m > DEFERRED_ROWS:
        raise ValueError(f"{m} deferred rows: at most {DEFERRED_ROWS}")
    out = torch.empty((m, n), dtype=x.dtype, device=rows.device)
    _launch(x, q, scale, bias, out, t)
    return out


def gated(x: torch.Tensor | Quantized, q: torch.Tensor, scale: torch.Tensor, t: Tiles) -> Deferred:
    """``silu(gate) * up`` of ``x @ W.T`` for the gate/up weight ``(q, scale)``
    ``[2N, K]`` (``[gate | up]``), in ``x``'s dtype, as the rows the down
    product quantizes (``Deferred``, a maximum per row and program): one
    kernel, each program a gate tile and the up tile of its columns."""
    rows = _rows(x)
    m, k = rows.shape
    n = q.shape[0] // 2
    if q.shape[0] % 2 or m > DEFERRED_ROWS or t.split_k != 1 or not applies(t, n, k):
        raise ValueError(f"tiles {t} do not gate {m} rows against a [{2 * n}, {k}] weight")
    out = torch.empty((m, n), dtype=x.dtype, device=rows.device)
    maxes = torch.empty((m, n // t.block_n), dtype=torch.float32, device=rows.device)
    _launch(x, q, scale, None, out, t, gated_maxes=maxes)
    return Deferred(out, maxes)


def _launch(
    x: torch.Tensor | Quantized | Deferred,
    q: torch.Tensor,
    scale: torch.Tensor,
    bias: torch.Tensor | None,
    out: torch.Tensor,
    t: Tiles,
    gated_maxes: torch.Tensor | None = None,
) -> None:
    """One launch over ``out``'s columns (``gated_maxes``: the gated product's,
    whose maxima go there)."""
    rows = _rows(x)
    m, k = rows.shape
    n = out.shape[1]
    pre, deferred = isinstance(x, Quantized), isinstance(x, Deferred)
    x_scale = x.scale if pre else scale  # unread where the kernel quantizes
    parts, counts = scratch_of(rows.device) if t.split_k > 1 else (out, out)
    maxes = gated_maxes if gated_maxes is not None else x.maxes if deferred else scale
    n_parts = maxes.shape[1] if deferred else 1
    launch = pdl.launch_options(rows.device)
    rows_per_program = t.block_n * (2 if gated_maxes is not None else 1)
    prefetch = pdl.prefetch_bytes(n // t.block_n * t.split_k * rows_per_program, k // t.split_k)
    _kernel()[(n // t.block_n, t.split_k)](
        rows, x_scale, q, scale, scale if bias is None else bias, out, parts, counts, maxes, m,
        n, rows.stride(0), k, FP8_MAX=E4M3_MAX, SCALE_FLOOR=SCALE_FLOOR,
        HAS_BIAS=bias is not None, BLOCK_M=block_m(m), BLOCK_N=t.block_n, BLOCK_K=t.block_k,
        SPLIT_K=t.split_k, UNROLL_SCALE=t.unroll_scale, PRE_QUANTIZED=pre, PRECISE=t.precise,
        GATED=gated_maxes is not None, DEFERRED=deferred, ONE_ROW=deferred and m == 1,
        PARTS=n_parts,
        PARTS_BLOCK=1 << (n_parts - 1).bit_length(),
        PREFETCH=prefetch if launch["PDL"] else 0, THREADS=32 * t.warps,
        num_warps=t.warps, num_stages=t.stages, **launch,
    )  # fmt: skip
