"""Fused mixture-of-experts kernels (Triton, CUDA; every shape static, so a
CUDA graph captures them).

The tokens' experts and weights come from ``engine.layers.moe_route``.
Experts, two paths chosen by the number of (token, expert) pairs:

- **Few pairs** (decode at small batch): one program per pair and block of
  output rows reads only that pair's expert, as a matrix-vector product
  (a 2-D float32 accumulator over the k tiles, reduced once).
  ``gate_up`` computes the gate and up rows of a block together and stores
  ``silu(gate) * up``; ``down`` gives each token its ``top_k`` experts'
  products weighted by the router and summed, so no pair-sized output exists.
  Four kernels per layer with the router's product and its routing;
  weights read: the chosen experts' only.
- **Many pairs** (prefill, large batches): the pairs are grouped by expert
  into segments padded to the GEMM's row block (``align``: one kernel, every
  program counts all experts with a histogram and places its own expert's
  pairs, and marks its share of the blocks past the last segment), then two
  grouped GEMMs run over the blocks: ``gate_up`` with SiLU-and-mul in its
  epilogue, ``down`` with the router weight in its epilogue;
  a token's ``top_k`` rows (adjacent: pair ``t * top_k + j``) are summed
  last, in float32, by one kernel. Each expert's weights are read once per
  row block of its segment; blocks past the last segment exit.

Accumulation is float32; intermediates are stored in the activations' dtype.
float32 activations (a reference run on CUDA) multiply in IEEE float32, not
TF32.
``engine.layers.moe.experts_reference`` is the definition both paths are
tested against.
"""

from __future__ import annotations

from functools import cache
from typing import Any, NamedTuple

import torch

from engine.layers import pdl
from engine.layers.moe_route import pow2, route_rows, route_tiles, triton_cdiv

SMALL_PAIRS = 32
"""Up to this many (token, expert) pairs take the matrix-vector path."""
COMBINE_BLOCK = 1024
"""Output columns per program of the many-pairs path's last step (a token's
``top_k`` rows summed)."""


class GemvTiles(NamedTuple):
    """Tiles of the matrix-vector path: ``gate_up`` and ``down``'s rows per
    program, k per tile and warps."""

    up_n: int
    up_k: int
    up_warps: int
    down_n: int
    down_k: int
    down_warps: int


GEMV_TILES = GemvTiles(1, 1024, 2, 1, 256, 2)
"""Measured on an H200 at Qwen3-30B-A3B's shapes (``bench_moe --sweep``): one
row per program, two warps, for 1 to 4 tokens alike."""


class GemmTiles(NamedTuple):
    block_m: int
    block_n: int
    block_k: int
    warps: int
    stages: int


def gemm_tiles(pairs: int, experts: int) -> GemmTiles:
    """Row block by the average segment (the fewer pairs per expert, the less
    padding a small block wastes), the rest from it: the best of
    ``bench_moe --sweep`` on an H200 at Qwen3-30B-A3B's shapes, 8 to 8192
    tokens."""
    per_expert = pairs / experts
    if per_expert <= 8:
        return GemmTiles(16, 64, 128, 4, 4)
    if per_expert <= 24:
        return GemmTiles(32, 128, 128, 8, 3)
    if per_expert <= 96:
        return GemmTiles(64, 64, 64, 4, 3)
    return GemmTiles(128, 128, 64, 8, 3)


@cache
def _kernels() -> dict[str, Any]:
    # Triton compiles a kernel again for each new "specialization" of its
    # integer arguments (equal to 1, divisible by 16); the token and pair
    # counts are left unspecialized, so each kernel compiles once per tile
    # choice, and ``warm_up`` compiles every choice before serving.
    import triton
    import triton.language as tl

    prologue = pdl.prologue()
    l2_prefetch = pdl.l2_prefetch()

    @triton.jit
    def gemv_gate_up_kernel(
        x,
        w13,
        ids,
        act,
        stride_x,
        stride_we,
        stride_wn,
        stride_a,
        HIDDEN: tl.constexpr,
        INTER: tl.constexpr,
        TOP_K: tl.constexpr,
        BLOCK_N: tl.constexpr,
        BLOCK_K: tl.constexpr,
        PDL: tl.constexpr = False,
    ):
        if PDL:  # engine.layers.pdl; a constant: nothing at all when off
            prologue()
        # Program (pair, row block): the gate and up rows of the block, summed
        # over k in a 2-D accumulator reduced once (no reduction per tile). The
        # k loop is unrolled (the model's sizes are constants), so every tile's
        # loads are issued before the first is used: a program's bytes in
        # flight, not one tile's, hide the memory's latency.
        pair = tl.program_id(0)
        n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
        e = tl.load(ids + pair).to(tl.int64)
        row = x + (pair // TOP_K) * stride_x
        gate = w13 + e * stride_we + n[:, None] * stride_wn
        up = gate + INTER * stride_wn
        live = n < INTER
        acc_g = tl.zeros([BLOCK_N, BLOCK_K], dtype=tl.float32)
        acc_u = tl.zeros([BLOCK_N, BLOCK_K], dtype=tl.float32)
        for k0 in tl.static_range(0, HIDDEN, BLOCK_K):
            k = k0 + tl.arange(0, BLOCK_K)
            km = k < HIDDEN
            a = tl.load(row + k, mask=km, other=0.0).to(tl.float32)
            m = live[:, None] & km[None, :]
            acc_g += tl.load(gate + k[None, :], mask=m, other=0.0).to(tl.float32) * a[None, :]
            acc_u += tl.load(up + k[None, :], mask=m, other=0.0).to(tl.float32) * a[None, :]
        g = tl.sum(acc_g, axis=1)
        h = g / (1.0 + tl.exp(-g)) * tl.sum(acc_u, axis=1)
        tl.store(act + pair * stride_a + n, h.to(act.dtype.element_ty), mask=live)

    @triton.jit
    def gemv_down_kernel(
        act,
        w2,
        ids,
        weights,
        out,
        stride_a,
        stride_we,
        stride_wn,
        stride_o,
        HIDDEN: tl.constexpr,
        INTER: tl.constexpr,
        TOP_K: tl.constexpr,
        BLOCK_N: tl.constexpr,
        BLOCK_K: tl.constexpr,
        PREFETCH: tl.constexpr = 0,
        ROW_BYTES: tl.constexpr = 0,
        THREADS: tl.constexpr = 64,
        PDL: tl.constexpr = False,
    ):
        if PREFETCH > 0:  # with PDL only (pdl.prefetch_bytes): the weight, before the wait
            # The token's experts, routed two kernels back: the gate/up kernel
            # before this one had waited for the routing to complete before
            # this one could be launched. Read from L2 (.cg), which the
            # routing's stores reached, never from a line cached before them.
            # Only the prefetch's addresses come from this read: the products
            # read the ids again after the wait.
            for j in tl.static_range(TOP_K):
                e = tl.load(ids + tl.program_id(0) * TOP_K + j, cache_modifier=".cg")
                rows = e.to(tl.int64) * stride_we + tl.program_id(1) * BLOCK_N * stride_wn
                l2_prefetch((w2 + rows).to(tl.int64), ROW_BYTES, PREFETCH, BLOCK_N, THREADS)
        if PDL:  # engine.layers.pdl; a constant: nothing at all when off
            prologue()
        # Program (token, row block): the token's top_k experts' rows, each
        # weighted by the router, in one 2-D accumulator. Both loops are
        # unrolled, so the loads of every expert and k tile are in flight
        # together (with a loop over k, each expert's tiles waited in turn).
        t = tl.program_id(0)
        n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
        live = n < HIDDEN
        acc = tl.zeros([BLOCK_N, BLOCK_K], dtype=tl.float32)
        for j in tl.static_range(TOP_K):
            pair = t * TOP_K + j
            e = tl.load(ids + pair).to(tl.int64)
            w = tl.load(weights + pair)
            base = w2 + e * stride_we + n[:, None] * stride_wn
            for k0 in tl.static_range(0, INTER, BLOCK_K):
                k = k0 + tl.arange(0, BLOCK_K)
                km = k < INTER
                a = tl.load(act + pair * stride_a + k, mask=km, other=0.0).to(tl.float32)
                b = tl.load(base + k[None, :], mask=live[:, None] & km[None, :], other=0.0)
                acc += b.to(tl.float32) * (w * a)[None, :]
        tl.store(out + t * stride_o + n, tl.sum(acc, axis=1).to(out.dtype.element_ty), mask=live)

    @triton.jit(do_not_specialize=["pairs", "blocks"])
    def align_kernel(
        ids,
        sorted_pairs,
        block_expert,
        pairs,
        blocks,
        BLOCK_M: tl.constexpr,
        BINS: tl.constexpr,
        CHUNK: tl.constexpr,
        PDL: tl.constexpr = False,
    ):
        if PDL:  # engine.layers.pdl; a constant: nothing at all when off
            prologue()
        # Program e: where expert e's segment starts (the padded sizes of the
        # experts before it, from a histogram of all pairs), then its pairs in
        # their original order, the padding, and the expert of its blocks;
        # the blocks past the last segment, -1, shared out over the programs.
        # ``BINS`` exceeds the expert count: the last bin takes the padding.
        me = tl.program_id(0)
        counts = tl.zeros([BINS], dtype=tl.int32)
        for s in range(0, pairs, CHUNK):
            o = s + tl.arange(0, CHUNK)
            v = tl.load(ids + o, mask=o < pairs, other=BINS - 1)
            counts += tl.histogram(v, BINS)
        bins = tl.arange(0, BINS)
        padded = (counts + BLOCK_M - 1) // BLOCK_M * BLOCK_M
        start = tl.sum(tl.where(bins < me, padded, 0), axis=0)
        mine = tl.sum(tl.where(bins == me, counts, 0), axis=0)
        size = tl.sum(tl.where(bins == me, padded, 0), axis=0)
        placed = 0
        for s in range(0, pairs, CHUNK):
            o = s + tl.arange(0, CHUNK)
            v = tl.load(ids + o, mask=o < pairs, other=-1)
            hit = v == me
            pos = start + placed + tl.cumsum(hit.to(tl.int32), axis=0) - 1
            tl.store(sorted_pairs + pos, o, mask=hit)
            placed += tl.sum(hit.to(tl.int32), axis=0)
        for s in range(mine, size, CHUNK):
            o = s + tl.arange(0, CHUNK)
            tl.store(sorted_pairs + start + o, pairs, mask=o < size)
        for b in range(start // BLOCK_M, (start + size) // BLOCK_M):
            tl.store(block_expert + b, me)
        used = tl.sum(tl.where(bins < BINS - 1, padded, 0), axis=0) // BLOCK_M
        for b in range(used + me, blocks, tl.num_programs(0)):
            tl.store(block_expert + b, -1)

    @triton.jit(do_not_specialize=["pairs"])
    def grouped_gate_up_kernel(
        x,
        w13,
        sorted_pairs,
        block_expert,
        act,
        pairs,
        hidden,
        inter,
        stride_x,
        stride_we,
        stride_wn,
        stride_a,
        TOP_K: tl.constexpr,
        BLOCK_M: tl.constexpr,
        BLOCK_N: tl.constexpr,
        BLOCK_K: tl.constexpr,
        IEEE: tl.constexpr,
        PDL: tl.constexpr = False,
    ):
        if PDL:  # engine.layers.pdl; a constant: nothing at all when off
            prologue()
        pid_m = tl.program_id(0)
        e = tl.load(block_expert + pid_m).to(tl.int64)
        if e < 0:
            return
        rows = tl.load(sorted_pairs + pid_m * BLOCK_M + tl.arange(0, BLOCK_M))
        valid = rows < pairs
        tokens = tl.where(valid, rows // TOP_K, 0).to(tl.int64)
        n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
        live = n < inter
        k = tl.arange(0, BLOCK_K)
        a_ptr = x + tokens[:, None] * stride_x + k[None, :]
        g_ptr = w13 + e * stride_we + n[None, :] * stride_wn + k[:, None]
        u_ptr = g_ptr + inter * stride_wn
        acc_g = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
        acc_u = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
        for k0 in range(0, hidden, BLOCK_K):
            km = k0 + k < hidden
            a = tl.load(a_ptr, mask=valid[:, None] & km[None, :], other=0.0)
            bm = km[:, None] & live[None, :]
            g = tl.load(g_ptr, mask=bm, other=0.0)
            u = tl.load(u_ptr, mask=bm, other=0.0)
            if IEEE:
                acc_g = tl.dot(a, g, acc_g, input_precision="ieee")
                acc_u = tl.dot(a, u, acc_u, input_precision="ieee")
            else:
                acc_g = tl.dot(a, g, acc_g)
                acc_u = tl.dot(a, u, acc_u)
            a_ptr += BLOCK_K
            g_ptr += BLOCK_K
            u_ptr += BLOCK_K
        h = acc_g / (1.0 + tl.exp(-acc_g)) * acc_u
        dst = act + rows.to(tl.int64)[:, None] * stride_a + n[None, :]
        tl.store(dst, h.to(act.dtype.element_ty), mask=valid[:, None] & live[None, :])

    @triton.jit(do_not_specialize=["pairs"])
    def grouped_down_kernel(
        act,
        w2,
        sorted_pairs,
        block_expert,
        weights,
        out,
        pairs,
        hidden,
        inter,
        stride_a,
        stride_we,
        stride_wn,
        stride_o,
        BLOCK_M: tl.constexpr,
        BLOCK_N: tl.constexpr,
        BLOCK_K: tl.constexpr,
        IEEE: tl.constexpr,
        PDL: tl.constexpr = False,
    ):
        if PDL:  # engine.layers.pdl; a constant: nothing at all when off
            prologue()
        pid_m = tl.program_id(0)
        e = tl.load(block_expert + pid_m).to(tl.int64)
        if e < 0:
            return
        rows = tl.load(sorted_pairs + pid_m * BLOCK_M + tl.arange(0, BLOCK_M))
        valid = rows < pairs
        safe = tl.where(valid, rows, 0).to(tl.int64)
        n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
        live = n < hidden
        k = tl.arange(0, BLOCK_K)
        a_ptr = act + safe[:, None] * stride_a + k[None, :]
        b_ptr = w2 + e * stride_we + n[None, :] * stride_wn + k[:, None]
        acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
        for k0 in range(0, inter, BLOCK_K):
            km = k0 + k < inter
            a = tl.load(a_ptr, mask=valid[:, None] & km[None, :], other=0.0)
            b = tl.load(b_ptr, mask=km[:, None] & live[None, :], other=0.0)
            if IEEE:  # noqa: SIM108 (a constexpr branch, resolved at compile time)
                acc = tl.dot(a, b, acc, input_precision="ieee")
            else:
                acc = tl.dot(a, b, acc)
            a_ptr += BLOCK_K
            b_ptr += BLOCK_K
        acc *= tl.load(weights + safe, mask=valid, other=0.0)[:, None]
        dst = out + safe[:, None] * stride_o + n[None, :]
        tl.store(dst, acc.to(out.dtype.element_ty), mask=valid[:, None] & live[None, :])

    @triton.jit(do_not_specialize=["n"])
    def combine_kernel(per_pair, out, n, hidden, stride_p, stride_o,
                       TOP_K: tl.constexpr, BLOCK_H: tl.constexpr, PDL: tl.constexpr = False):  # fmt: skip
        if PDL:  # engine.layers.pdl; a constant: nothing at all when off
            prologue()
        # Token t's output: its top_k pair rows (t * top_k + j) summed in
        # float32, in the order of j.
        t = tl.program_id(0).to(tl.int64)
        h = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
        live = h < hidden
        acc = tl.zeros([BLOCK_H], dtype=tl.float32)
        for j in tl.static_range(TOP_K):
            row = per_pair + (t * TOP_K + j) * stride_p
            acc += tl.load(row + h, mask=live, other=0.0).to(tl.float32)
        tl.store(out + t * stride_o + h, acc.to(out.dtype.element_ty), mask=live)

    return {
        "combine": combine_kernel,
        "gemv_gate_up": gemv_gate_up_kernel,
        "gemv_down": gemv_down_kernel,
        "align": align_kernel,
        "grouped_gate_up": grouped_gate_up_kernel,
        "grouped_down": grouped_down_kernel,
    }


class Alignment(NamedTuple):
    sorted_pairs: torch.Tensor
    """Pair indices (``token * top_k + j``) grouped by expert, each segment
    padded to a multiple of the row block with ``pairs`` (no pair)."""
    block_expert: torch.Tensor
    """The expert of each row block; -1 past the last segment."""


def align(ids: torch.Tensor, experts: int, block_m: int, chunk: int = 256) -> Alignment:
    """Group the pairs of ``ids`` ``[n, top_k]`` by expert (see ``Alignment``).
    Sizes depend on the shape of ``ids`` only."""
    pairs = ids.numel()
    capacity = pairs + experts * (block_m - 1)
    blocks = (capacity + block_m - 1) // block_m
    sorted_pairs = torch.empty(blocks * block_m, dtype=torch.int32, device=ids.device)
    block_expert = torch.empty(blocks, dtype=torch.int32, device=ids.device)
    _kernels()["align"][(experts,)](
        ids,
        sorted_pairs,
        block_expert,
        pairs,
        blocks,
        BLOCK_M=block_m,
        BINS=pow2(experts + 1),
        CHUNK=chunk,
        **pdl.launch_options(ids.device),
    )
    return Alignment(sorted_pairs, block_expert)


def fused_experts(
    x: torch.Tensor,
    w13: torch.Tensor,
    w2: torch.Tensor,
    weights: torch.Tensor,
    ids: torch.Tensor,
    small_pairs: int = SMALL_PAIRS,
    tiles: GemmTiles | None = None,
    gemv: GemvTiles = GEMV_TILES,
) -> torch.Tensor:
    """As ``engine.layers.moe.experts_reference``: ``x`` ``[n, hidden]``,
    ``w13`` ``[experts, 2 * inter, hidden]``, ``w2`` ``[experts, hidden, inter]``,
    ``weights``/``ids`` ``[n, top_k]`` from ``route``."""
    n, hidden = x.shape
    experts, _, inter = w2.shape
    top_k = ids.shape[1]
    pairs = n * top_k
    x = x.contiguous()
    out = torch.empty_like(x)
    if n == 0:
        return out
    k = _kernels()
    launch = pdl.launch_options(x.device)
    act = torch.empty(pairs, inter, dtype=x.dtype, device=x.device)
    if pairs <= small_pairs:
        g = gemv
        up_k, down_k = min(g.up_k, pow2(hidden)), min(g.down_k, pow2(inter))
        k["gemv_gate_up"][(pairs, triton_cdiv(inter, g.up_n))](
            x,
            w13,
            ids,
            act,
            x.stride(0),
            w13.stride(0),
            w13.stride(1),
            act.stride(0),
            HIDDEN=hidden,
            INTER=inter,
            TOP_K=top_k,
            BLOCK_N=g.up_n,
            BLOCK_K=up_k,
            num_warps=g.up_warps,
            **launch,
        )
        k["gemv_down"][(n, triton_cdiv(hidden, g.down_n))](
            act,
            w2,
            ids,
            weights,
            out,
            act.stride(0),
            w2.stride(0),
            w2.stride(1),
            out.stride(0),
            HIDDEN=hidden,
            INTER=inter,
            TOP_K=top_k,
            BLOCK_N=g.down_n,
            BLOCK_K=down_k,
            num_warps=g.down_warps,
            **launch,
            **_down_prefetch(w2, pairs, g) if launch["PDL"] else {},
        )
        return out
    t = tiles or gemm_tiles(pairs, experts)
    sorted_pairs, block_expert = align(ids, experts, t.block_m)
    blocks = block_expert.numel()
    k["grouped_gate_up"][(blocks, triton_cdiv(inter, t.block_n))](
        x,
        w13,
        sorted_pairs,
        block_expert,
        act,
        pairs,
        hidden,
        inter,
        x.stride(0),
        w13.stride(0),
        w13.stride(1),
        act.stride(0),
        TOP_K=top_k,
        BLOCK_M=t.block_m,
        BLOCK_N=t.block_n,
        BLOCK_K=t.block_k,
        IEEE=x.dtype == torch.float32,
        num_warps=t.warps,
        num_stages=t.stages,
        **launch,
    )
    per_pair = torch.empty(pairs, hidden, dtype=x.dtype, device=x.device)
    k["grouped_down"][(blocks, triton_cdiv(hidden, t.block_n))](
        act,
        w2,
        sorted_pairs,
        block_expert,
        weights,
        per_pair,
        pairs,
        hidden,
        inter,
        act.stride(0),
        w2.stride(0),
        w2.stride(1),
        per_pair.stride(0),
        BLOCK_M=t.block_m,
        BLOCK_N=t.block_n,
        BLOCK_K=t.block_k,
        IEEE=x.dtype == torch.float32,
        num_warps=t.warps,
        num_stages=t.stages,
        **launch,
    )
    block_h = min(COMBINE_BLOCK, pow2(hidden))
    k["combine"][(n, triton_cdiv(hidden, block_h))](
        per_pair,
        out,
        n,
        hidden,
        per_pair.stride(0),
        out.stride(0),
        TOP_K=top_k,
        BLOCK_H=block_h,
        **launch,
    )
    return out


def _down_prefetch(w2: torch.Tensor, pairs: int, g: GemvTiles) -> dict[str, Any]:
    """The matrix-vector down kernel's L2 prefetch (with PDL): each pair's
    expert rows' first bytes, within ``pdl.PREFETCH_BYTES`` for all; none
    where a row block would pass the expert's last row."""
    hidden, inter = w2.shape[1], w2.shape[2]
    row_bytes = w2.stride(1) * w2.element_size()
    prefetch = pdl.prefetch_bytes(pairs * hidden, inter * w2.element_size())
    if hidden % g.down_n or not prefetch:
        return {}
    return {"PREFETCH": prefetch, "ROW_BYTES": row_bytes, "THREADS": 32 * g.down_warps}


def kernel_choice(n: int, experts: int, top_k: int) -> tuple[Any, ...]:
    """What decides which compiled kernels ``n`` tokens run: the routing's
    tiles, and the experts' path and tiles."""
    pairs = n * top_k
    return route_tiles(n), None if pairs <= SMALL_PAIRS else gemm_tiles(pairs, experts)


def warm_up(
    router: torch.Tensor,
    w13: torch.Tensor,
    w2: torch.Tensor,
    top_k: int,
    renormalize: bool,
    max_tokens: int,
) -> list[int]:
    """Compile every kernel variant a forward of up to ``max_tokens`` tokens
    can pick at these weights' shapes, so no request waits for Triton's
    compiler while serving; returns the token counts run (the smallest of
    each choice)."""
    experts, hidden, _ = w2.shape
    seen, ran = set(), []
    for n in range(1, max_tokens + 1):
        key = kernel_choice(n, experts, top_k)
        if key not in seen:
            seen.add(key)
            ran.append(n)
            x = torch.zeros(n, hidden, dtype=w2.dtype, device=w2.device)
            weights, ids = route_rows(x, router, top_k, renormalize)
            fused_experts(x, w13, w2, weights, ids)
    return ran
