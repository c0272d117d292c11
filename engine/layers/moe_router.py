"""The router of a few tokens in one kernel: product, softmax and top-k.

At decode batch sizes the router is two short kernels a sparse layer (the
``[experts, hidden]`` product, then ``moe_triton.route``), each mostly its
launch and its tail. Here the product runs as ``engine.layers.skinny``'s does
(operands swapped, the experts on the matrix units' wide side, split over K),
every program stores its float32 partial, and the last program of the whole
grid to arrive (counted with one atomic) adds the partials up and routes every
token: the logits rounded to the activations' dtype (as the product's output
is stored on the two-kernel path), softmax in float32, ``top_k`` rounds of
arg-max (the lowest index among equal maxima), renormalized when asked. So
the numbers are ``moe.route(F.linear(x, w))``'s up to the order of the sum.

Scratch and counter are ``engine.layers.skinny``'s (one stream of forwards per
device; the counter is left at zero). Used for 1 to ``MAX_TOKENS`` half
precision rows on CUDA; anything else takes the two kernels.
"""

from __future__ import annotations

from functools import cache
from typing import Any, NamedTuple

import torch

from engine.layers import pdl
from engine.layers.skinny import PARTIAL_BYTES, block_m, scratch_of

MAX_TOKENS = 64


class Tiles(NamedTuple):
    block_e: int
    """Experts per program."""
    block_k: int
    split_k: int
    warps: int


def tiles(m: int, experts: int, hidden: int) -> Tiles | None:
    """The tiles for ``m`` tokens against an ``[experts, hidden]`` router, or
    None where the kernel does not apply. Splits over K shrink as the row
    tile grows, so the last program's partials stay near 64 KB."""
    if not 1 <= m <= MAX_TOKENS:
        return None
    rows = block_m(m)
    split = {16: 8, 32: 4, 64: 2}[rows]
    while split > 1 and hidden % (split * 16):
        split //= 2
    k_len = hidden // split
    block_k = min(256, k_len & -k_len)  # a power of two dividing the split
    t = Tiles(16, block_k, split, 4 if rows < 64 else 8)
    return t if applies(t, m, experts, hidden) else None


def applies(t: Tiles, m: int, experts: int, hidden: int) -> bool:
    """Whether ``t`` tiles the product: whole k tiles in every split, and the
    partials within the device's scratch."""
    if hidden % (t.block_k * t.split_k) or t.block_k < 16:
        return False
    return t.split_k * padded(experts, t) * block_m(m) * 4 <= PARTIAL_BYTES


def padded(experts: int, t: Tiles) -> int:
    """The experts rounded up to a power of two of at least a program's
    (the width of a token's row of partials)."""
    return max(t.block_e, 1 << max(0, (experts - 1).bit_length()))


def _pow2(n: int) -> int:
    return 1 << max(0, (n - 1).bit_length())


@cache
def _kernel() -> Any:
    import triton
    import triton.language as tl

    prologue = pdl.prologue()

    @triton.jit(do_not_specialize=["m"])
    def router_kernel(x, w, part, count, weights, ids, m, stride_x,
                      HIDDEN: tl.constexpr, EXPERTS: tl.constexpr, E_POW2: tl.constexpr,
                      TOP_K: tl.constexpr, K_POW2: tl.constexpr, RENORMALIZE: tl.constexpr,
                      BLOCK_M: tl.constexpr, BLOCK_E: tl.constexpr, BLOCK_K: tl.constexpr,
                      SPLIT_K: tl.constexpr, PDL: tl.constexpr = False):  # fmt: skip
        if PDL:  # engine.layers.pdl; a constant: nothing at all when off
            prologue()
        pid_e = tl.program_id(0)
        pid_k = tl.program_id(1)
        e = pid_e * BLOCK_E + tl.arange(0, BLOCK_E)
        e_ok = e < EXPERTS
        ms = tl.arange(0, BLOCK_M)
        m_ok = ms < m
        kk = tl.arange(0, BLOCK_K)
        K_LEN: tl.constexpr = HIDDEN // SPLIT_K
        acc = tl.zeros((BLOCK_E, BLOCK_M), dtype=tl.float32)
        # Unrolled (the sizes are constants): every tile's loads in flight together.
        for k0 in tl.static_range(0, K_LEN, BLOCK_K):
            k = pid_k * K_LEN + k0 + kk
            wv = tl.load(w + e[:, None] * HIDDEN + k[None, :], mask=e_ok[:, None], other=0.0)
            xv = tl.load(x + ms[None, :] * stride_x + k[:, None], mask=m_ok[None, :], other=0.0)
            acc = tl.dot(wv, xv, acc)
        # Partials as [split, token, expert] (the last program reads a token's
        # experts along a row). The barrier orders every thread's stores before
        # the (release) count; the last arrival reads them from L2 (.cg).
        tl.store(part + pid_k * BLOCK_M * E_POW2 + ms[None, :] * E_POW2 + e[:, None], acc)
        tl.debug_barrier()
        arrived = tl.atomic_add(count, 1, sem="acq_rel")
        if arrived == tl.num_programs(0) * SPLIT_K - 1:
            ea = tl.arange(0, E_POW2)
            ok = ea < EXPERTS
            parts = part + ms[:, None] * E_POW2 + ea[None, :]
            logits = tl.zeros((BLOCK_M, E_POW2), dtype=tl.float32)
            for s in tl.static_range(SPLIT_K):
                logits += tl.load(
                    parts + s * BLOCK_M * E_POW2, mask=ok[None, :], other=0.0, cache_modifier=".cg"
                )
            # Rounded as the two-kernel path stores the product's output.
            logits = logits.to(x.dtype.element_ty).to(tl.float32)
            logits = tl.where(ok[None, :], logits, -float("inf"))
            p = tl.exp(logits - tl.max(logits, axis=1)[:, None])
            p = p / tl.sum(p, axis=1)[:, None]
            kj = tl.arange(0, K_POW2)
            vals = tl.zeros([BLOCK_M, K_POW2], dtype=tl.float32)
            args = tl.zeros([BLOCK_M, K_POW2], dtype=tl.int32)
            for j in tl.static_range(TOP_K):
                best = tl.max(p, axis=1)
                arg = tl.min(tl.where(p == best[:, None], ea[None, :], E_POW2), axis=1)
                vals = tl.where(kj[None, :] == j, best[:, None], vals)
                args = tl.where(kj[None, :] == j, arg[:, None], args)
                p = tl.where(ea[None, :] == arg[:, None], -1.0, p)
            if RENORMALIZE:
                vals = vals / tl.sum(vals, axis=1)[:, None]
            out = ms[:, None] * TOP_K + kj[None, :]
            keep = m_ok[:, None] & (kj[None, :] < TOP_K)
            tl.store(weights + out, vals, mask=keep)
            tl.store(ids + out, args, mask=keep)
            # Ready for the next launch: kernels on the stream run in order.
            tl.atomic_xchg(count, 0)

    return router_kernel


def fits(x: torch.Tensor, w: torch.Tensor) -> Tiles | None:
    """The tiles for routing ``x`` ``[M, hidden]`` with the router ``w``
    ``[experts, hidden]`` in one kernel, or None where it does not apply."""
    if x.dim() != 2 or x.stride(1) != 1 or x.dtype not in (torch.bfloat16, torch.float16):
        return None
    if w.dtype != x.dtype or not w.is_contiguous() or w.shape[1] != x.shape[1]:
        return None
    return tiles(x.shape[0], w.shape[0], w.shape[1])


def run(
    x: torch.Tensor, w: torch.Tensor, top_k: int, renormalize: bool, t: Tiles
) -> tuple[torch.Tensor, torch.Tensor]:
    """``moe.route(F.linear(x, w), top_k, renormalize)`` in one kernel (any
    device Triton runs on): ``(weights float32 [M, top_k], ids int32 [M, top_k])``."""
    m, hidden = x.shape
    experts = w.shape[0]
    if not applies(t, m, experts, hidden) or m > MAX_TOKENS or top_k > experts:
        raise ValueError(f"tiles {t} do not route {m} tokens over a [{experts}, {hidden}] router")
    weights = torch.empty(m, top_k, dtype=torch.float32, device=x.device)
    ids = torch.empty(m, top_k, dtype=torch.int32, device=x.device)
    if m == 0:
        return weights, ids
    parts, counts = scratch_of(x.device)
    _kernel()[(triton_cdiv(experts, t.block_e), t.split_k)](
        x, w, parts, counts, weights, ids, m, x.stride(0),
        HIDDEN=hidden, EXPERTS=experts, E_POW2=padded(experts, t), TOP_K=top_k, K_POW2=_pow2(top_k),
        RENORMALIZE=renormalize, BLOCK_M=block_m(m), BLOCK_E=t.block_e,
        BLOCK_K=t.block_k, SPLIT_K=t.split_k, num_warps=t.warps, **pdl.launch_options(x.device),
    )  # fmt: skip
    return weights, ids


def warm_up(w: torch.Tensor, top_k: int, renormalize: bool, max_tokens: int) -> list[int]:
    """Compile every variant routing up to ``max_tokens`` tokens can launch
    (one per row tile); returns the token counts run."""
    experts, hidden = w.shape
    seen, ran = set(), []
    for m in range(1, min(max_tokens, MAX_TOKENS) + 1):
        t = tiles(m, experts, hidden)
        if t is not None and (block_m(m), t) not in seen:
            seen.add((block_m(m), t))
            ran.append(m)
            run(torch.zeros(m, hidden, dtype=w.dtype, device=w.device), w, top_k, renormalize, t)
    return ran


def triton_cdiv(a: int, b: int) -> int:
    return (a + b - 1) // b
