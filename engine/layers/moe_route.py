"""Mixture-of-experts routing on CUDA (Triton): the router's logits
``[n, experts]`` to each token's top-k weights and expert ids, for the fused
experts (``engine.layers.moe_triton``).

``route`` takes the logits in one kernel per token block (softmax in
float32, k rounds of arg-max, optional renormalization). Up to
``ROUTER_ROWS`` tokens (decode at small batch) ``route_from`` computes the
logits in the same kernel: each program the router's product for a block of
experts, and the last program to arrive routes the tokens (one launch a
layer, not two). ``engine.layers.moe.route`` is the definition both are
tested against.
"""

from __future__ import annotations

from functools import cache
from typing import Any, NamedTuple

import torch

from engine.layers import pdl, skinny
from engine.layers.gemv import linear

ROUTER_ROWS = 4
"""Up to this many tokens, the router's product runs in the routing kernel
(``route_from``)."""
ROUTER_EXPERTS = 4
"""Experts per program of ``route_from``'s product (the router's rows)."""
ROUTER_K = 512
"""k per tile of ``route_from``'s product."""


@cache
def _kernel() -> Any:
    # The token count is left unspecialized, so the kernel compiles once per
    # tile choice (``moe_triton.warm_up`` compiles every choice).
    import triton
    import triton.language as tl

    prologue = pdl.prologue()

    @triton.jit(do_not_specialize=["n"])
    def route_kernel(
        logits,
        weights,
        ids,
        n,
        experts,
        stride_l,
        rows,
        router,
        count,
        stride_r,
        stride_w,
        TOP_K: tl.constexpr,
        K_POW2: tl.constexpr,
        RENORMALIZE: tl.constexpr,
        BLOCK_T: tl.constexpr,
        BLOCK_E: tl.constexpr,
        FROM_ROWS: tl.constexpr = False,
        HIDDEN: tl.constexpr = 1,
        ROUTER_E: tl.constexpr = 1,
        ROUTER_BLOCK_K: tl.constexpr = 1,
        PDL: tl.constexpr = False,
    ):
        if PDL:  # engine.layers.pdl; a constant: nothing at all when off
            prologue()
        if FROM_ROWS:
            # The router's product first (route_from): this program's block
            # of experts for every token, in float32 and stored in the
            # logits' dtype as a product's output is. Then the last program
            # to arrive routes all n tokens (BLOCK_T >= n) and leaves the
            # counter at zero (engine.layers.skinny's protocol: the stores,
            # the barrier, the release count; the last arrival reads them
            # from L2).
            re = tl.program_id(0) * ROUTER_E + tl.arange(0, ROUTER_E)
            re_ok = re < experts
            for r in range(n):
                acc = tl.zeros([ROUTER_E, ROUTER_BLOCK_K], dtype=tl.float32)
                for k0 in tl.static_range(0, HIDDEN, ROUTER_BLOCK_K):
                    k = k0 + tl.arange(0, ROUTER_BLOCK_K)
                    k_ok = k < HIDDEN
                    a = tl.load(rows + r * stride_r + k, mask=k_ok, other=0.0).to(tl.float32)
                    m = re_ok[:, None] & k_ok[None, :]
                    b = tl.load(router + re[:, None] * stride_w + k[None, :], mask=m, other=0.0)
                    acc += b.to(tl.float32) * a[None, :]
                y = tl.sum(acc, axis=1).to(logits.dtype.element_ty)
                tl.store(logits + r * stride_l + re, y, mask=re_ok)
            tl.debug_barrier()
            last = tl.atomic_add(count, 1, sem="acq_rel") == tl.num_programs(0) - 1
            t = tl.arange(0, BLOCK_T)
        else:
            last = True
            t = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
        if last:
            e = tl.arange(0, BLOCK_E)
            kk = tl.arange(0, K_POW2)
            live = t < n
            mask = live[:, None] & (e[None, :] < experts)
            x = tl.load(logits + t[:, None] * stride_l + e[None, :], mask=mask,
                        other=-float("inf"), cache_modifier=".cg")  # fmt: skip
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
            if FROM_ROWS:
                tl.atomic_xchg(count, 0)

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
    logits: torch.Tensor, top_k: int, renormalize: bool, tiles: RouteTiles | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """As ``engine.layers.moe.route``, in one kernel."""
    n, experts = logits.shape
    weights = torch.empty(n, top_k, dtype=torch.float32, device=logits.device)
    ids = torch.empty(n, top_k, dtype=torch.int32, device=logits.device)
    if n == 0:
        return weights, ids
    t = tiles or route_tiles(n)
    _kernel()[(triton_cdiv(n, t.block_t),)](
        logits,
        weights,
        ids,
        n,
        experts,
        logits.stride(0),
        logits,  # no rows, router or counter: the logits are given
        logits,
        ids,
        0,
        0,
        TOP_K=top_k,
        K_POW2=pow2(top_k),
        RENORMALIZE=renormalize,
        BLOCK_T=t.block_t,
        BLOCK_E=pow2(experts),
        num_warps=t.warps,
        **pdl.launch_options(logits.device),
    )
    return weights, ids


def route_rows(
    rows: torch.Tensor, router: torch.Tensor, top_k: int, renormalize: bool
) -> tuple[torch.Tensor, torch.Tensor]:
    """The top-k weights and expert ids of ``rows`` under the ``router``
    matrix: its product in the routing kernel up to ``ROUTER_ROWS`` rows
    (``route_from``), else the product's logits routed (``route``)."""
    if takes_rows(rows, router):
        return route_from(rows, router, top_k, renormalize)
    return route_two_kernels(rows, router, top_k, renormalize)


def route_two_kernels(
    rows: torch.Tensor, router: torch.Tensor, top_k: int, renormalize: bool
) -> tuple[torch.Tensor, torch.Tensor]:
    """The router's product, then its logits routed: what ``route_from``
    does in one kernel (``bench_moe`` times both)."""
    return route(linear(rows, router), top_k, renormalize)


def takes_rows(rows: torch.Tensor, router: torch.Tensor) -> bool:
    """Whether ``route_from`` takes ``rows`` ``[n, hidden]`` and ``router``
    ``[experts, hidden]``: 1 to ``ROUTER_ROWS`` rows of unit stride, a
    contiguous router of their width."""
    return (
        1 <= rows.shape[0] <= ROUTER_ROWS
        and rows.stride(1) == 1
        and router.is_contiguous()
        and router.shape[1] == rows.shape[1]
    )


def route_from(
    rows: torch.Tensor, router: torch.Tensor, top_k: int, renormalize: bool
) -> tuple[torch.Tensor, torch.Tensor]:
    """``route(linear(rows, router))`` for up to ``ROUTER_ROWS`` tokens in one
    kernel: ``rows`` ``[n, hidden]``, ``router`` ``[experts, hidden]``. The
    logits are rounded to the rows' dtype, as the product's output is."""
    if not takes_rows(rows, router):
        raise ValueError(
            f"route_from takes 1 to {ROUTER_ROWS} rows of unit stride and a contiguous "
            f"router of their width, got rows {tuple(rows.shape)}, router {tuple(router.shape)}"
        )
    n, hidden = rows.shape
    experts = router.shape[0]
    logits = torch.empty(n, experts, dtype=rows.dtype, device=rows.device)
    weights = torch.empty(n, top_k, dtype=torch.float32, device=rows.device)
    ids = torch.empty(n, top_k, dtype=torch.int32, device=rows.device)
    # One counter of the device's, which every kernel leaves at zero (the
    # engine's forwards run on one stream: engine.layers.skinny.scratch_of).
    count = skinny.scratch_of(rows.device)[1]
    _kernel()[(triton_cdiv(experts, ROUTER_EXPERTS),)](
        logits,
        weights,
        ids,
        n,
        experts,
        logits.stride(0),
        rows,
        router,
        count,
        rows.stride(0),
        router.stride(0),
        TOP_K=top_k,
        K_POW2=pow2(top_k),
        RENORMALIZE=renormalize,
        BLOCK_T=ROUTER_ROWS,
        BLOCK_E=pow2(experts),
        FROM_ROWS=True,
        HIDDEN=hidden,
        ROUTER_E=ROUTER_EXPERTS,
        ROUTER_BLOCK_K=min(ROUTER_K, pow2(hidden)),
        num_warps=4,
        **pdl.launch_options(rows.device),
    )
    return weights, ids


def kernel_choice(n: int) -> Any:
    """What decides the routing kernel ``route_rows`` runs for ``n`` tokens:
    the router's product in it, or the tiles of the logits' routing."""
    return "from rows" if n <= ROUTER_ROWS else route_tiles(n)


def triton_cdiv(a: int, b: int) -> int:
    return (a + b - 1) // b
