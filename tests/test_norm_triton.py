"""The RMSNorm kernel (``engine.layers.norm_triton``): under Triton's
interpreter against float64 of its definition (the residual sum rounded once
and stored, the norm of the unrounded sum), and on CUDA against FlashInfer's
kernels, which it replaces for a forward's rows where the products prefetch
their weights.

The interpreter must be chosen before triton is first imported, so those run
in a child process started with ``TRITON_INTERPRET=1``
(``test_kernel_under_the_interpreter``)."""

from __future__ import annotations

import pytest
import torch
from triton_interp import interpreted, parent_only, run_interpreted

from engine.layers import norm_triton


@parent_only
def test_kernel_under_the_interpreter() -> None:
    run_interpreted(__file__, timeout_s=300)


def _definition(
    x: torch.Tensor, r: torch.Tensor | None, w: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(norm, sum)`` in float64: the sum of the inputs rounded once to their
    dtype, the norm of the unrounded sum rounded once."""
    h = x.double() + (r.double() if r is not None else 0.0)
    y = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps) * w.double()
    return y.to(x.dtype), h.to(x.dtype)


def _within_an_ulp(got: torch.Tensor, want: torch.Tensor) -> None:
    """Equal, or one step of the dtype apart (float32 sums against float64's
    may round the other way at a boundary), and equal for most elements."""
    step = torch.finfo(want.dtype).eps * want.float().abs().clamp_min(1e-3)
    assert ((got.float() - want.float()).abs() <= step).all()
    assert (got == want).float().mean().item() > 0.9


@interpreted
@pytest.mark.parametrize(("rows", "k"), [(5, 96), (2, 200), (1, 64)])
def test_add_and_norm_match_float64(rows: int, k: int) -> None:
    """In place: the sum into ``residual`` exactly (one rounding), the norm
    into ``x``; a width that is not a power of two masks its tail. (fp16:
    the interpreter rounds float32 to bf16 toward zero, the GPU to nearest;
    bf16 is checked on the GPU.)"""
    dtype = torch.float16
    g = torch.Generator().manual_seed(rows * k)
    x = (torch.randn(rows, k, generator=g) * 3).to(dtype)
    r = torch.randn(rows, k, generator=g).to(dtype)
    w = (torch.rand(k, generator=g) + 0.5).to(dtype)
    want_y, want_h = _definition(x, r, w, 1e-6)
    xi, ri = x.clone(), r.clone()
    y, h = norm_triton.add_rms_norm(xi, ri, w, 1e-6)
    assert y is xi and h is ri
    assert torch.equal(h, want_h)
    _within_an_ulp(y, want_y)
    alone = norm_triton.rms_norm(x, w, 1e-6)
    assert torch.equal(x, x.clone()) and alone.shape == x.shape
    _within_an_ulp(alone, _definition(x, None, w, 1e-6)[0])


@interpreted
def test_rows_with_a_stride_and_empty_rows() -> None:
    """Rows of a wider tensor (a row stride past the width), and no rows."""
    g = torch.Generator().manual_seed(4)
    base = torch.randn(3, 160, generator=g).half()
    x = base[:, :128]
    w = torch.ones(128, dtype=torch.float16)
    _within_an_ulp(norm_triton.rms_norm(x, w, 1e-5), _definition(x, None, w, 1e-5)[0])
    assert norm_triton.rms_norm(x[:0], w, 1e-5).shape == (0, 128)


def test_what_the_kernel_refuses() -> None:
    w = torch.ones(8)
    assert not norm_triton.fits(torch.zeros(2, 8))  # float32
    assert not norm_triton.fits(torch.zeros(2, 3, 8, dtype=torch.bfloat16))  # per-head rows
    assert not norm_triton.fits(torch.zeros(8, 2, dtype=torch.bfloat16).t())  # strided columns
    assert not norm_triton.fits(torch.zeros(1, norm_triton.MAX_K + 1, dtype=torch.bfloat16))
    assert norm_triton.fits(torch.zeros(2, 8, dtype=torch.bfloat16))
    with pytest.raises(ValueError, match="do not fit"):
        norm_triton.rms_norm(torch.zeros(2, 8), w, 1e-5)
    with pytest.raises(ValueError, match="do not fit"):
        norm_triton.add_rms_norm(
            torch.zeros(2, 8, dtype=torch.bfloat16),
            torch.zeros(3, 8, dtype=torch.bfloat16),
            w,
            1e-5,
        )


@pytest.mark.gpu
@pytest.mark.parametrize("rows", [1, 7, 300])
@pytest.mark.parametrize("hidden", [2048, 4096])
def test_the_kernels_numbers_are_flashinfers(rows: int, hidden: int) -> None:
    """On CUDA: the same sums and norms as FlashInfer's fused add + RMSNorm
    and RMSNorm, within a bf16 step, at the presets' widths."""
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA device")
    import flashinfer.norm

    g = torch.Generator(device="cuda").manual_seed(rows + hidden)
    x = (torch.randn(rows, hidden, device="cuda", generator=g) * 3).bfloat16()
    r = torch.randn(rows, hidden, device="cuda", generator=g).bfloat16()
    w = (torch.rand(hidden, device="cuda", generator=g) + 0.5).bfloat16()
    fx, fr = x.clone(), r.clone()
    flashinfer.norm.fused_add_rmsnorm(fx, fr, w, 1e-6)
    tx, tr = norm_triton.add_rms_norm(x.clone(), r.clone(), w, 1e-6)
    assert torch.equal(tr, fr)
    _within_an_ulp(tx, fx)
    _within_an_ulp(tx, _definition(x, r, w, 1e-6)[0])
    _within_an_ulp(norm_triton.rms_norm(x, w, 1e-6), flashinfer.norm.rmsnorm(x, w, 1e-6))
