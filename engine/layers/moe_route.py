"""Mixture-of-experts routing on CUDA (Triton): the router's logits
``[n, experts]`` to each token's top-k weights and expert ids, for the fused
experts (``engine.layers.moe_triton``).

``route`` takes the logits in one kernel per token block (softmax in
float32, k rounds of arg-max, optional renormalization);
``engine.layers.moe.route`` is the definition it is tested against. The
router's product runs before it, as any product of the model's
(``route_rows``): computing it in the routing kernel itself, by blocks of
experts with the last program to arrive routing, was slower on an H100 at
one to four tokens (docs/benchmarks.md, Mixture of experts).
"""

from __future__ import annotations

from functools import cache
from typing import Any, NamedTuple

import torch

from engine.layers import pdl
from engine.layers.gemv import linear


@cache
def _kernel() -> Any:
    # The token count is left unspecialized, so the kernel compiles once per
    # tile choice (``moe_triton.warm_up`` compiles every choice).
    import triton
    import triton.language as tl

    prologue = pdl.prologue()
    prefetch_one = pdl.l2_prefetch_one()

    @triton.jit(do_not_specialize=["n"])
    def route_kernel(
        logits,
        weights,
        ids,
        n,
        experts,
        stride_l,
        TOP_K: tl.constexpr,
        K_POW2: tl.constexpr,
        RENORMALIZE: tl.constexpr,
        BLOCK_T: tl.constexpr,
        BLOCK_E: tl.constexpr,
        w13=None,
        stride_we=0,
        up_offset=0,
        PREFETCH: tl.constexpr = 0,
        PDL: tl.constexpr = False,
    ):
        if PDL:  # engine.layers.pdl; a constant: nothing at all when off
            prologue()
        t = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
        e = tl.arange(0, BLOCK_E)
        kk = tl.arange(0, K_POW2)
        live = t < n
        mask = live[:, None] & (e[None, :] < experts)
        x = tl.load(logits + t[:, None] * stride_l + e[None, :], mask=mask, other=-float("inf"))
        x = x.to(tl.float32)
        x = tl.exp(x - tl.max(x, axis=1)[:, None])
        p = x / tl.sum(x, axis=1)[:, None]
        # The k largest, kept in registers and stored once.
        vals = tl.zeros([BLOCK_T, K_POW2], dtype=tl.float32)
        args = tl.zeros([BLOCK_T, K_POW2], dtype=tl.int32)
        for j in tl.static_range(TOP_K):
            best = tl.max(p, axis=1)
            # The lowest index among equal maxima, as torch.topk on CPU.
            arg = tl.min(tl.where(p == best[:, None], e[None, :], BLOCK_E), axis=1)
            vals = tl.where(kk[None, :] == j, best[:, None], vals)
            args = tl.where(kk[None, :] == j, arg[:, None], args)
            p = tl.where(e[None, :] == arg[:, None], -1.0, p)
        if RENORMALIZE:
            vals = vals / tl.sum(vals, axis=1)[:, None]
        out = t[:, None] * TOP_K + kk[None, :]
        keep = live[:, None] & (kk[None, :] < TOP_K)
        tl.store(weights + out, vals, mask=keep)
        tl.store(ids + out, args, mask=keep)
        if PREFETCH > 0:  # a constant (route's expert_rows, one token a program)
            # The chosen experts' first gate and up rows, asked of L2 for the
            # experts' product, whose first programs read them (its programs
            # take every pair's first rows first).
            for j in tl.static_range(TOP_K):
                expert = tl.sum(tl.where(kk[None, :] == j, args, 0)).to(tl.int64)
                gate = w13 + expert * stride_we
                prefetch_one(gate.to(tl.int64), PREFETCH)
                prefetch_one((gate + up_offset).to(tl.int64), PREFETCH)

    return route_kernel


def pow2(n: int) -> int:
    """The least power of two at least ``n``."""
    return 1 << max(0, (n - 1).bit_length())


class RouteTiles(NamedTuple):
    block_t: int
    warps: int


def route_tiles(n: int) -> RouteTiles:
    """One token per one-warp program for decode-sized batches (the top-k
    reductions stay within a warp), blocks of tokens for larger ones."""
    return RouteTiles(1, 1) if n <= 256 else RouteTiles(16, 4)


def route(
    logits: torch.Tensor,
    top_k: int,
    renormalize: bool,
    tiles: RouteTiles | None = None,
    w13: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """As ``engine.layers.moe.route``, in one kernel. ``w13``: the experts'
    gate/up weight ``[experts, 2 * inter, hidden]``, whose chosen experts'
    first rows the kernel then asks L2 for (``expert_rows``): where the
    experts' matrix-vector path follows."""
    n, experts = logits.shape
    weights = torch.empty(n, top_k, dtype=torch.float32, device=logits.device)
    ids = torch.empty(n, top_k, dtype=torch.int32, device=logits.device)
    if n == 0:
        return weights, ids
    t = tiles or route_tiles(n)
    launch = pdl.launch_options(logits.device)
    prefetch = {}
    if w13 is not None and pdl.PREFETCH_BYTES and launch["PDL"] and t.block_t == 1:
        prefetch = expert_rows(w13, n * top_k)
    _kernel()[(triton_cdiv(n, t.block_t),)](
        logits,
        weights,
        ids,
        n,
        experts,
        logits.stride(0),
        TOP_K=top_k,
        K_POW2=pow2(top_k),
        RENORMALIZE=renormalize,
        BLOCK_T=t.block_t,
        BLOCK_E=pow2(experts),
        num_warps=t.warps,
        **launch,
        **prefetch,
    )
    return weights, ids


def expert_rows(w13: torch.Tensor, pairs: int) -> dict[str, Any]:
    """The routing kernel's prefetch of the chosen experts' gate/up rows
    (with programmatic dependent launch): each pair's first gate rows and
    first up rows, two spans within ``pdl.PREFETCH_BYTES`` for all; none
    where that is under a line. (For the experts' matrix-vector path, whose
    programs read every pair's first rows first: its callers pass ``w13``
    there alone.)"""
    if not w13.is_contiguous():
        return {}
    half = w13.shape[1] // 2 * w13.stride(1)  # elements from a gate row to its up row
    prefetch = pdl.prefetch_bytes(2 * pairs, half * w13.element_size())
    if not prefetch:
        return {}
    return {"w13": w13, "stride_we": w13.stride(0), "up_offset": half, "PREFETCH": prefetch}


def route_rows(
    rows: torch.Tensor,
    router: torch.Tensor,
    top_k: int,
    renormalize: bool,
    w13: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The top-k weights and expert ids of ``rows`` under the ``router``
    matrix: its product (``engine.layers.gemv.linear``), then ``route``
    (prefetching ``w13``'s chosen rows, where given)."""
    return route(linear(rows, router), top_k, renormalize, w13=w13)


def triton_cdiv(a: int, b: int) -> int:
    return (a + b - 1) // b
