"""The fused mixture-of-experts kernels under Triton's interpreter (no GPU
needed) against the torch definitions of ``engine.layers.moe``: routing, the
expert grouping, and both expert paths, in float16 (the interpreter computes
with numpy, which has no bfloat16) and float32.

The interpreter must be chosen before triton is first imported, so these run
in a child process started with ``TRITON_INTERPRET=1``
(``test_kernels_under_the_interpreter``)."""

from __future__ import annotations

import pytest
import torch
from triton_interp import interpreted, parent_only, run_interpreted

from engine.layers.moe import experts_reference, route


@parent_only
def test_kernels_under_the_interpreter() -> None:
    run_interpreted(__file__, timeout_s=900)


def _case(n: int, experts: int, top_k: int, hidden: int, inter: int, dtype: torch.dtype, seed: int):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, hidden, generator=g).to(dtype)
    w13 = (torch.randn(experts, 2 * inter, hidden, generator=g) / hidden**0.5).to(dtype)
    w2 = (torch.randn(experts, hidden, inter, generator=g) / inter**0.5).to(dtype)
    logits = torch.randn(n, experts, generator=g) * 2
    return x, w13, w2, logits


@interpreted
@pytest.mark.parametrize("tiles", [(1, 1), (16, 4)])
@pytest.mark.parametrize("renormalize", [False, True])
@pytest.mark.parametrize(("experts", "top_k"), [(8, 2), (16, 4), (6, 1), (128, 8)])
def test_route_matches_torch(
    experts: int, top_k: int, renormalize: bool, tiles: tuple[int, int]
) -> None:
    from engine.layers import moe_route

    # 37 tokens: the last block of 16 is partly past the end.
    logits = torch.randn(37, experts, generator=torch.Generator().manual_seed(experts))
    w, ids = moe_route.route(logits, top_k, renormalize, moe_route.RouteTiles(*tiles))
    rw, rids = route(logits, top_k, renormalize)
    assert ids.dtype == torch.int32 and ids.tolist() == rids.tolist()
    torch.testing.assert_close(w, rw)


@interpreted
@pytest.mark.parametrize(("block_m", "chunk"), [(4, 16), (16, 256)])
def test_align_groups_every_pair_once(block_m: int, chunk: int) -> None:
    from engine.layers import moe_triton

    experts, n, top_k = 10, 23, 3
    g = torch.Generator().manual_seed(block_m)
    # Some experts get no pair at all.
    ids = torch.stack([torch.randperm(experts - 3, generator=g)[:top_k] for _ in range(n)])
    ids = ids.to(torch.int32)
    # A chunk shorter than the pairs: the scan carries counts across chunks.
    sorted_pairs, block_expert = moe_triton.align(ids, experts, block_m, chunk)
    pairs = n * top_k
    flat = ids.reshape(-1).tolist()
    seen = []
    used = (block_expert >= 0).sum().item()
    assert (block_expert[used:] == -1).all()
    for b in range(used):
        e = block_expert[b].item()
        chunk = sorted_pairs[b * block_m : (b + 1) * block_m].tolist()
        real = [p for p in chunk if p < pairs]
        assert all(flat[p] == e for p in real)
        assert all(p == pairs for p in chunk[len(real) :]), "padding ends a segment"
        seen += real
    assert sorted(seen) == list(range(pairs))
    # Segments in expert order, pairs in their order within one.
    order = [flat[p] for p in seen]
    assert order == sorted(order)
    assert block_expert[:used].tolist() == sorted(block_expert[:used].tolist())


@interpreted
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize(
    ("n", "experts", "top_k", "small", "gemv"),
    [
        (1, 8, 2, True, "default"),
        (3, 16, 4, True, "default"),
        (3, 16, 4, True, "short-tiles"),
        (40, 8, 2, False, "default"),
        (9, 16, 4, False, "default"),
        (5, 4, 1, False, "default"),
    ],
)
def test_experts_match_reference(
    n: int, experts: int, top_k: int, small: bool, dtype: torch.dtype, gemv: str
) -> None:
    from engine.layers import moe_triton

    hidden, inter = 48, 40  # not multiples of the tiles: the masks are exercised
    x, w13, w2, logits = _case(n, experts, top_k, hidden, inter, dtype, seed=n + experts)
    weights, ids = route(logits, top_k, True)
    small_pairs = n * top_k if small else 0
    tiles = moe_triton.GemmTiles(16, 16, 16, 4, 1)
    # Short k tiles loop over k several times; row blocks past the rows are masked.
    gemv_tiles = (
        moe_triton.GEMV_TILES if gemv == "default" else moe_triton.GemvTiles(16, 16, 4, 32, 16, 2)
    )
    ours = moe_triton.fused_experts(x, w13, w2, weights, ids, small_pairs, tiles, gemv_tiles)
    ref = experts_reference(x.double(), w13.double(), w2.double(), weights.double(), ids)
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(ours.double(), ref, atol=tol, rtol=tol)


@interpreted
@pytest.mark.parametrize(("experts", "top_k"), [(8, 2), (16, 1)])
def test_warm_up_runs_every_kernel_choice(experts: int, top_k: int) -> None:
    from engine.layers import moe_triton

    max_tokens = 300  # past the router's and every GEMM tile threshold at 8 experts
    choices = {moe_triton.kernel_choice(n, experts, top_k) for n in range(1, max_tokens + 1)}
    assert len(choices) >= 4
    _, w13, w2, _ = _case(1, experts, top_k, 48, 40, torch.float16, seed=1)
    router = torch.randn(experts, 48, generator=torch.Generator().manual_seed(2)).half()
    ran = moe_triton.warm_up(router, w13, w2, top_k, True, max_tokens)
    assert {moe_triton.kernel_choice(n, experts, top_k) for n in ran} == choices
    assert len(ran) == len(choices)
