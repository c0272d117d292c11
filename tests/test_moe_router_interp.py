"""The one-kernel router of decode-sized batches (``engine.layers.moe_router``)
under Triton's interpreter (no GPU needed), in float16, against the float64
product of the same weights routed by ``engine.layers.moe.route``.

The interpreter must be chosen before triton is first imported, so the kernel
tests run in a child process started with ``TRITON_INTERPRET=1``
(``test_kernels_under_the_interpreter``)."""

from __future__ import annotations

import pytest
import torch
from triton_interp import interpreted, parent_only, run_interpreted

from engine.layers import moe_router
from engine.layers.moe import route
from engine.model_config import ModelConfig
from engine.presets import PRESETS


@parent_only
def test_kernels_under_the_interpreter() -> None:
    run_interpreted(__file__, timeout_s=600)


def _check(x: torch.Tensor, w: torch.Tensor, top_k: int, renormalize: bool) -> None:
    t = moe_router.fits(x, w)
    assert t is not None
    weights, ids = moe_router.run(x, w, top_k, renormalize, t)
    m, experts = x.shape[0], w.shape[0]
    assert weights.shape == ids.shape == (m, top_k) and ids.dtype == torch.int32
    # The logits as the two-kernel path stores them: the float64 product
    # rounded to the activations' dtype.
    ref = (x.double() @ w.double().T).to(x.dtype).double()
    tol = 2e-3 * (ref.abs().max().item() + 1.0)  # two float16 ulps of the largest
    probs = torch.softmax(ref, dim=-1)
    for i in range(m):
        chosen = ids[i].long()
        assert len(set(chosen.tolist())) == top_k and chosen.min() >= 0 and chosen.max() < experts
        rest = torch.ones(experts, dtype=torch.bool)
        rest[chosen] = False
        if rest.any():  # a top-k of the logits, up to rounding
            assert ref[i, chosen].min() >= ref[i, rest].max() - tol, f"token {i}"
        assert (weights[i][:-1] >= weights[i][1:]).all(), f"token {i}: not in decreasing order"
        want = probs[i, chosen]
        if renormalize:
            want = want / want.sum()
        torch.testing.assert_close(weights[i].double(), want, rtol=5e-3, atol=1e-4)
        # Where the top k + 1 are clear of each other, exactly the reference's.
        top = ref[i].sort(descending=True).values[: top_k + 1]
        if experts > top_k and (top[:-1] - top[1:]).min() > tol:
            _, rids = route(ref[i : i + 1].float(), top_k, renormalize)
            assert ids[i].tolist() == rids[0].tolist(), f"token {i}"
    # The arrival counter is left at zero for the next launch.
    assert moe_router.scratch_of(x.device)[1][0].item() == 0


@interpreted
@pytest.mark.parametrize("renormalize", [False, True])
@pytest.mark.parametrize(
    ("m", "experts", "top_k", "hidden"),
    [
        (1, 128, 8, 256),  # Qwen3-MoE's experts, one decode row
        (5, 128, 8, 256),
        (17, 60, 4, 96),  # Qwen1.5-MoE's 60 experts: a partial last program; K split 2
        (40, 8, 2, 64),  # Mixtral's 8: fewer experts than a program's 16
        (64, 32, 4, 128),
    ],
)
def test_router_matches_float64(
    m: int, experts: int, top_k: int, hidden: int, renormalize: bool
) -> None:
    g = torch.Generator().manual_seed(m * 1000 + experts)
    x = torch.randn(m, hidden, generator=g).to(torch.float16)
    w = (torch.randn(experts, hidden, generator=g) * 2 / hidden**0.5).to(torch.float16)
    _check(x, w, top_k, renormalize)
    _check(x, w, top_k, renormalize)  # again: the counter was reset


@interpreted
def test_router_reads_rows_with_a_stride() -> None:
    """Rows of a wider tensor (a stride beyond the hidden size)."""
    g = torch.Generator().manual_seed(3)
    wide = torch.randn(3, 192, generator=g).to(torch.float16)
    w = (torch.randn(16, 128, generator=g) / 8).to(torch.float16)
    _check(wide[:, 32:160], w, 4, True)


def test_tiles_at_the_presets() -> None:
    """Every preset with experts gets tiles at 1 to 64 rows, whole k tiles in
    each split; more rows, other dtypes or shapes take the two kernels."""
    for name, raw in PRESETS.items():
        c = ModelConfig.from_dict(raw, dtype=torch.bfloat16)
        if c.moe is None:
            continue
        e, h = c.moe.num_experts, c.hidden_size
        for m in (1, 16, 17, 33, 64):
            t = moe_router.tiles(m, e, h)
            assert t is not None and moe_router.applies(t, m, e, h), (name, m)
            assert h % (t.split_k * t.block_k) == 0 and t.block_k & (t.block_k - 1) == 0
        assert moe_router.tiles(65, e, h) is None
    w = torch.empty(128, 2048, dtype=torch.bfloat16)
    assert moe_router.fits(torch.empty(4, 2048, dtype=torch.bfloat16), w) is not None
    assert moe_router.fits(torch.empty(65, 2048, dtype=torch.bfloat16), w) is None
    assert moe_router.fits(torch.empty(4, 2048, dtype=torch.float32), w) is None
    assert moe_router.fits(torch.empty(4, 1024, dtype=torch.bfloat16), w) is None
    assert moe_router.fits(torch.empty(4, 2048, dtype=torch.bfloat16), w.T.contiguous().T) is None
