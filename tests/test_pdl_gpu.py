"""On CUDA, compute capability 9.0+: the engine's Triton kernels launched with
programmatic dependent launch (``engine.layers.pdl``) give the bits ordinary
launches give, in chains where every kernel reads what the one before it
wrote (a kernel that read before its wait would read stale or half-written
rows), eagerly and replayed from a CUDA graph."""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch

from engine.layers import fp8, fp8_quant, fp8_skinny, gemv, moe_route, moe_triton, norm_triton, pdl

pytestmark = pytest.mark.gpu

HIDDEN = 4096
LINKS = 24


def _needs_pdl() -> None:
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA device")
    if not pdl.enabled(torch.device("cuda", torch.cuda.current_device())):
        pytest.skip("programmatic dependent launch needs compute capability 9.0+")


def _weights(n: int, k: int, count: int, seed: int) -> list[torch.Tensor]:
    g = torch.Generator(device="cuda").manual_seed(seed)
    return [
        (torch.randn(n, k, generator=g, device="cuda") / k**0.5).to(torch.bfloat16)
        for _ in range(count)
    ]


def _bf16_chain(x: torch.Tensor, ws: list[torch.Tensor]) -> torch.Tensor:
    """One-row and (three rows) few-row products, each on the last output."""
    for w in ws:
        x = gemv.linear(x, w)
    return x


def _norm_chain(x: torch.Tensor, ws: list[torch.Tensor]) -> torch.Tensor:
    """The residual add and RMSNorm in place, then a product of the norm,
    again and again (each norm reads the product before it and writes the
    rows the next product reads)."""
    norm_w = torch.ones(x.shape[1], dtype=x.dtype, device=x.device)
    residual = torch.zeros_like(x)
    h = x.clone()  # add_rms_norm overwrites its input
    for w in ws:
        h, residual = norm_triton.add_rms_norm(h, residual, norm_w, 1e-5)
        h = gemv.linear(h, w)
    return norm_triton.rms_norm(h, norm_w, 1e-5)


def _fp8_chain(x: torch.Tensor, ws: list[tuple[torch.Tensor, torch.Tensor]]) -> torch.Tensor:
    """Norm and quantization in one kernel, then the FP8 one-row product on
    the quantized rows, again and again."""
    norm_w = torch.ones(x.shape[1], dtype=x.dtype, device=x.device)
    residual = torch.zeros_like(x)
    for q, scale in ws:
        rows, residual = fp8_quant.norm_quantize(x, residual, norm_w, 1e-5)
        t = fp8_skinny.fits(rows, q)
        assert t is not None
        x = fp8_skinny.run(rows, q, scale, None, t)
    return x


def _moe_chain(
    x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, router: torch.Tensor
) -> torch.Tensor:
    """Routing and the experts of a few layers, each on the last output."""
    for _ in range(6):
        weights, ids = moe_route.route(gemv.linear(x, router), 8, True, w13=w13)
        x = moe_triton.fused_experts(x, w13, w2, weights, ids)
    return x


def _both_ways(monkeypatch: pytest.MonkeyPatch, run: Callable[[], torch.Tensor]) -> None:
    """``run`` with ordinary launches, then with programmatic ones eagerly and
    from a graph (three replays): the same bits every time."""
    monkeypatch.setattr(pdl, "enabled", lambda device: False)
    ref = run().clone()
    monkeypatch.setattr(pdl, "enabled", lambda device: True)
    eager = run()
    assert torch.equal(eager, ref)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        run()  # compiled outside the capture
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = run()
    for _ in range(3):
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(out, ref)


PREFETCH = [0, 16 << 20]
"""``pdl.PREFETCH_BYTES``: none, and whole weights' worth (each kernel's
weight prefetched into L2 before its wait)."""


@pytest.mark.parametrize("prefetch", PREFETCH)
@pytest.mark.parametrize("rows", [1, 3])
def test_bf16_products_chained(rows: int, prefetch: int, monkeypatch: pytest.MonkeyPatch) -> None:
    _needs_pdl()
    monkeypatch.setattr(pdl, "PREFETCH_BYTES", prefetch)
    ws = _weights(HIDDEN, HIDDEN, LINKS, rows)
    x = torch.randn(rows, HIDDEN, device="cuda").to(torch.bfloat16)
    _both_ways(monkeypatch, lambda: _bf16_chain(x, ws))


@pytest.mark.parametrize("prefetch", PREFETCH)
@pytest.mark.parametrize("rows", [1, 3])
def test_norms_and_products_chained(
    rows: int, prefetch: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The Triton norms (``engine.layers.norm_triton``) before products that
    prefetch their weight."""
    _needs_pdl()
    monkeypatch.setattr(pdl, "PREFETCH_BYTES", prefetch)
    ws = _weights(HIDDEN, HIDDEN, LINKS, 20 + rows)
    x = torch.randn(rows, HIDDEN, device="cuda").to(torch.bfloat16)
    _both_ways(monkeypatch, lambda: _norm_chain(x, ws))


@pytest.mark.parametrize("prefetch", PREFETCH)
def test_fp8_products_chained(prefetch: int, monkeypatch: pytest.MonkeyPatch) -> None:
    _needs_pdl()
    monkeypatch.setattr(pdl, "PREFETCH_BYTES", prefetch)
    ws = [fp8.quantize_rows(w) for w in _weights(HIDDEN, HIDDEN, LINKS, 7)]
    x = torch.randn(1, HIDDEN, device="cuda").to(torch.bfloat16)
    _both_ways(monkeypatch, lambda: _fp8_chain(x, ws))


@pytest.mark.parametrize("prefetch", PREFETCH)
@pytest.mark.parametrize("tokens", [1, 16])
def test_moe_layers_chained(tokens: int, prefetch: int, monkeypatch: pytest.MonkeyPatch) -> None:
    """One token: the matrix-vector experts (the down kernel's experts
    prefetched, with ``prefetch``); 16: align and the grouped GEMMs."""
    _needs_pdl()
    monkeypatch.setattr(pdl, "PREFETCH_BYTES", prefetch)
    experts, hidden, inter = 32, 1024, 256
    w13 = _weights(2 * inter, hidden, experts, 11)
    w2 = _weights(hidden, inter, experts, 12)
    router = _weights(experts, hidden, 1, 13)[0] * 8
    stacked13, stacked2 = torch.stack(w13), torch.stack(w2)
    x = torch.randn(tokens, hidden, device="cuda").to(torch.bfloat16)
    _both_ways(monkeypatch, lambda: _moe_chain(x, stacked13, stacked2, router))
