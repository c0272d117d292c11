"""The one-row GEMV kernels (``engine.layers.gemv``) and the few-row kernel
(``engine.layers.skinny``) against ``F.linear``: under Triton's interpreter on
the CPU, and on a GPU for the model's shapes."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest
import torch
from torch.nn import functional as F

from engine.layers import gemv, skinny


def test_tiles_fit_the_shapes_or_refuse() -> None:
    assert gemv.tiles(6144, 4096) == gemv.Tiles(1, 2048, 8, 4)
    assert gemv.tiles(28672, 4096) == gemv.Tiles(4, 1024, 4, 4)
    assert gemv.tiles(128256, 4096) == gemv.Tiles(16, 256, 4, 4)
    assert gemv.tiles(4096, 14336).block_k == 1024
    assert gemv.tiles(64, 192) is None  # no K tile of >= 128 divides 192
    assert gemv.tiles(30001, 8192) is None  # rows not a multiple of the row tile


def _interpreted(code: str) -> None:
    """Run ``code`` in a child process under Triton's interpreter; it prints "ok"."""
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    out = subprocess.run(
        [sys.executable, "-c", code],
        env={**os.environ, "TRITON_INTERPRET": "1"},
        cwd=root,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert out.returncode == 0 and out.stdout.strip() == "ok", out.stderr[-3000:]


def test_cpu_inputs_keep_f_linear() -> None:
    x, w, b = torch.randn(1, 256), torch.randn(8, 256), torch.randn(8)
    assert torch.equal(gemv.linear(x, w, b), F.linear(x, w, b))
    gu = torch.randn(1, 512)

    def act(t: torch.Tensor) -> torch.Tensor:
        g, u = t.chunk(2, -1)
        return F.silu(g) * u

    assert torch.equal(gemv.silu_mul_linear(gu, w, act), F.linear(act(gu), w))


@pytest.mark.skipif(torch.cuda.is_available(), reason="checked on the device itself")
def test_kernels_under_the_interpreter() -> None:
    pytest.importorskip("triton")
    code = textwrap.dedent(
        """
        import torch
        from torch.nn import functional as F
        from engine.layers import gemv
        torch.manual_seed(0)
        t = gemv.Tiles(4, 128, 4, 1)
        x = torch.randn(1, 512, dtype=torch.float16)
        w = torch.randn(24, 512, dtype=torch.float16) * 0.05
        b = torch.randn(24, dtype=torch.float16)
        ref = F.linear(x.float(), w.float(), b.float())
        got = gemv.run_gemv(x, w, b, t).float()
        assert (got - ref).abs().max() < 2e-2, (got - ref).abs().max()
        ref = F.linear(x.float(), w.float())
        assert (gemv.run_gemv(x, w, None, t).float() - ref).abs().max() < 2e-2
        gu = torch.randn(1, 1024, dtype=torch.float16)
        g, u = gu.float().chunk(2, -1)
        act = (F.silu(g) * u).half().float()
        ref = F.linear(act, w.float())
        got = gemv.run_silu_gemv(gu, w, t).float()
        assert (got - ref).abs().max() < 2e-2, (got - ref).abs().max()
        print("ok")
        """
    )
    _interpreted(code)


def test_skinny_tiles_cover_the_few_row_range() -> None:
    assert skinny.tiles(1, 4096, 4096) is None  # one row: the GEMV kernel's
    assert skinny.tiles(65, 4096, 4096) is None  # beyond the few-row range: cuBLAS
    wide = skinny.tiles(64, 28672, 4096)
    assert wide is not None and wide.split_k == 1
    narrow = skinny.tiles(64, 4096, 14336)  # 64 row tiles: split over the long K
    assert narrow is not None and narrow.split_k > 1
    assert 14336 % (narrow.block_k * narrow.split_k) == 0
    assert skinny.tiles(64, 6144, 4096) is None  # cuBLAS keeps QKV at 64 rows
    assert skinny.tiles(8, 4000, 4096) is None  # rows not a multiple of the row tile
    assert [skinny.block_m(m) for m in (2, 16, 17, 33, 64)] == [16, 16, 32, 64, 64]


@pytest.mark.skipif(torch.cuda.is_available(), reason="checked on the device itself")
def test_skinny_kernel_under_the_interpreter() -> None:
    pytest.importorskip("triton")
    code = textwrap.dedent(
        """
        import torch
        from torch.nn import functional as F
        from engine.layers import skinny
        torch.manual_seed(0)
        for m, split, bias in [(3, 1, True), (16, 4, False), (33, 2, True)]:
            t = skinny.Tiles(64, 32, split, 4, 1)
            x = torch.randn(m, 256, dtype=torch.float16)
            w = torch.randn(128, 256, dtype=torch.float16) * 0.05
            b = torch.randn(128, dtype=torch.float16) if bias else None
            ref = F.linear(x.float(), w.float(), None if b is None else b.float())
            for _ in range(2):  # the second call finds the counters reset
                got = skinny.run_skinny(x, w, b, t).float()
                assert (got - ref).abs().max() < 2e-2, (m, split, (got - ref).abs().max())
        print("ok")
        """
    )
    _interpreted(code)


SHAPES = [(6144, 4096), (4096, 4096), (28672, 4096), (4096, 14336), (128256, 4096), (1536, 896)]


@pytest.mark.gpu
@pytest.mark.parametrize("n,k", SHAPES)
def test_gemv_matches_f_linear_on_cuda(n: int, k: int) -> None:
    gen = torch.Generator(device="cuda").manual_seed(n + k)
    x = torch.randn(1, k, device="cuda", dtype=torch.bfloat16, generator=gen)
    w = torch.randn(n, k, device="cuda", dtype=torch.bfloat16, generator=gen) * 0.02
    b = torch.randn(n, device="cuda", dtype=torch.bfloat16, generator=gen)
    ref = F.linear(x.double(), w.double(), b.double())
    got = gemv.linear(x, w, b)
    assert gemv.tiles(n, k) is not None or k % 128, "shape expected to take the kernel"
    rel = (got.double() - ref).norm() / ref.norm()
    assert rel < 1e-2, rel
    gu = torch.randn(1, 2 * k, device="cuda", dtype=torch.bfloat16, generator=gen)
    g, u = gu.double().chunk(2, -1)
    ref = F.linear((F.silu(g) * u).bfloat16().double(), w.double())
    got = gemv.silu_mul_linear(gu, w, lambda t: None)  # the fused path never calls it
    rel = (got.double() - ref).norm() / ref.norm()
    assert rel < 1e-2, rel


@pytest.mark.gpu
@pytest.mark.parametrize("n,k", SHAPES[:4])
@pytest.mark.parametrize("m", [2, 3, 8, 17, 64])
def test_few_rows_match_f_linear_on_cuda(m: int, n: int, k: int) -> None:
    gen = torch.Generator(device="cuda").manual_seed(n + k + m)
    w = torch.randn(n, k, device="cuda", dtype=torch.bfloat16, generator=gen) * 0.02
    b = torch.randn(n, device="cuda", dtype=torch.bfloat16, generator=gen)
    if m <= 32:  # at 64 rows cuBLAS keeps the smaller matrices
        assert skinny.fits(torch.empty(m, k, device="cuda", dtype=torch.bfloat16), w) is not None
    for bias in (b, None):
        for _ in range(2):  # fresh inputs; the second call finds the counters reset
            x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16, generator=gen)
            ref = F.linear(x.double(), w.double(), None if bias is None else bias.double())
            got = gemv.linear(x, w, bias)
            assert got.shape == (m, n)
            rel = (got.double() - ref).norm() / ref.norm()
            assert rel < 1e-2, rel


@pytest.mark.gpu
def test_few_rows_replay_in_a_graph() -> None:
    """Split products inside a captured graph: each replay's result is the
    product of the inputs copied in before it."""
    gen = torch.Generator(device="cuda").manual_seed(7)
    w = torch.randn(4096, 14336, device="cuda", dtype=torch.bfloat16, generator=gen) * 0.02
    x = torch.randn(32, 14336, device="cuda", dtype=torch.bfloat16, generator=gen)
    assert skinny.tiles(32, 4096, 14336).split_k > 1
    gemv.linear(x, w)  # compile outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = gemv.linear(x, w)
    for _ in range(3):
        x.copy_(torch.randn(x.shape, device="cuda", dtype=x.dtype, generator=gen))
        graph.replay()
        ref = F.linear(x.double(), w.double())
        assert (out.double() - ref).norm() / ref.norm() < 1e-2
