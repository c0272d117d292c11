"""The FP8 few-row kernel (``engine.layers.fp8_skinny``) under Triton's
interpreter (no GPU needed) against float64 products of the operands it
quantizes, and against ``engine.layers.fp8.linear``'s numbers; the
quantization kernels (alone, and fused with the norm or SiLU-and-mul before
it) against ``fp8.quantize_rows``.

The interpreter must be chosen before triton is first imported, so these run
in a child process started with ``TRITON_INTERPRET=1``
(``test_kernel_under_the_interpreter``)."""

from __future__ import annotations

import itertools
import json
import subprocess
import sys

import pytest
import torch
from triton_interp import interpreted, parent_only, run_interpreted
from workers import REPO

from engine.layers import fp8


@parent_only
def test_kernel_under_the_interpreter() -> None:
    run_interpreted(__file__, timeout_s=600)


def _exact_rows(rows: int, k: int, g: torch.Generator) -> torch.Tensor:
    """fp16 rows whose quantization is exact: e4m3 values, each row's largest
    magnitude 448 (negative in every other row), times a power of two. (The interpreter's float-to-e4m3 conversion
    mis-rounds some values that round up to a power of two, e.g. 125.4 to 64;
    the GPU's conversion instruction does not, so these tests keep rounding
    out and check everything else.)"""
    xq = (torch.randn(rows, k, generator=g) * 100).clamp(-440, 440).to(fp8.E4M3).float()
    xq[:, 0] = 448.0 * (-1.0) ** torch.arange(rows)  # the largest magnitude: + or -
    scale = 2.0 ** (torch.arange(rows, dtype=torch.float32) % 5 * 3 - 6)  # 2^-6 to 2^6
    return (xq * scale[:, None]).to(torch.float16)


@interpreted
@pytest.mark.parametrize("rows_in", ["unrolled", "looped", "quantized"])
@pytest.mark.parametrize(
    ("rows", "bias", "split_k"), [(1, False, 1), (3, True, 2), (4, False, 4), (40, True, 2)]
)
def test_rows_match_float64_of_the_quantized_operands(
    rows: int, bias: bool, split_k: int, rows_in: str
) -> None:
    """Against float64 products, unsplit and split over K (the last arrival
    adds the partials), the scale pass unrolled or looped, or the rows handed
    over quantized (``Quantized``: no scale pass)."""
    from engine.layers import fp8_skinny
    from engine.layers.fp8_quant import Quantized

    g = torch.Generator().manual_seed(rows)
    n, k = 64, 512
    x = _exact_rows(rows, k, g)  # rows of different magnitudes, each scaled on its own
    q, s = fp8.quantize_rows(torch.randn(n, k, generator=g) * 0.05)
    b = torch.randn(n, generator=g).to(torch.float16) if bias else None
    # 8 / split_k k tiles a split; the scale pass unrolled or looped over them.
    t = fp8_skinny.Tiles(32, 64, split_k, 4, 1, unroll_scale=rows_in == "unrolled")
    xq, sx = fp8.quantize_rows(x)
    given = Quantized(xq, sx, x.dtype) if rows_in == "quantized" else x
    got = fp8_skinny.run(given, q, s, b, t)
    assert torch.equal(fp8.dequantize_rows(xq, sx), x.float())  # exact, as intended
    ref = x.double() @ fp8.dequantize_rows(q, s).double().t()
    if b is not None:
        ref = ref + b.double()
    assert got.shape == (rows, n) and got.dtype == x.dtype
    # fp16 output rounding (2^-11 of each value; the bias add once more).
    atol = 1e-3 * ref.abs().amax(dim=1, keepdim=True)
    assert ((got.double() - ref).abs() <= 2e-3 * ref.abs() + atol).all()
    # The same numbers as the general path (quantize, then the product).
    general = fp8.linear(x.float(), q, s, None if b is None else b.float())
    assert ((got.float() - general).abs() <= 2e-3 * general.abs() + atol.float()).all()


@interpreted
def test_rows_of_zeros_and_the_saturating_element() -> None:
    from engine.layers import fp8_skinny

    x = torch.zeros(2, 128, dtype=torch.float16)
    x[1, 5] = 300.0  # the row's amax: maps to 448 exactly
    q, s = fp8.quantize_rows(torch.ones(32, 128))
    got = fp8_skinny.run(x, q, s, None, fp8_skinny.Tiles(32, 64, 1, 4, 1))
    assert torch.equal(got[0], torch.zeros(32, dtype=torch.float16))
    torch.testing.assert_close(got[1].float(), torch.full((32,), 300.0), rtol=1e-3, atol=0)


def test_what_takes_the_kernel() -> None:
    from engine.layers import fp8_skinny
    from engine.layers.fp8_quant import Quantized

    q = torch.zeros(4096, 4096, dtype=fp8.E4M3)
    x = torch.zeros(16, 4096, dtype=torch.bfloat16)
    assert fp8_skinny.fits(x[:1], q) == fp8_skinny.Tiles(64, 512, 1, 4, 4)
    assert fp8_skinny.fits(x, q) == fp8_skinny.Tiles(64, 512, 1, 4, 4)  # 16 rows: the same
    rows = Quantized(x.to(fp8.E4M3), torch.ones(16), torch.bfloat16)
    assert fp8_skinny.fits(rows, q) == fp8_skinny.Tiles(64, 512, 1, 4, 4)  # already quantized
    assert fp8_skinny.fits(rows._replace(dtype=torch.float32), q) is None  # float32 output
    # Row tiles: 16 up to 16 rows, then the next power of two up to 64.
    assert [fp8_skinny.block_m(m) for m in (1, 16, 17, 33, 64)] == [16, 16, 32, 64, 64]
    with pytest.raises(ValueError, match="do not take 65 rows"):
        fp8_skinny.run(torch.zeros(65, 4096, dtype=torch.bfloat16), q, torch.ones(4096), None,
                       fp8_skinny.Tiles(64, 512, 2, 4, 4))  # fmt: skip
    assert fp8_skinny.fits(torch.zeros(65, 4096, dtype=torch.bfloat16), q) is None  # too many
    # Past 16 rows: shorter k tiles, three stages; K split where the weight is not wide.
    for m, weight, want in (
        (17, q, fp8_skinny.Tiles(64, 256, 4, 4, 3)),
        (64, torch.zeros(4096, 14336, dtype=fp8.E4M3), fp8_skinny.Tiles(64, 256, 4, 4, 3)),
        (32, torch.zeros(6144, 4096, dtype=fp8.E4M3), fp8_skinny.Tiles(64, 256, 2, 4, 3)),
        (64, torch.zeros(28672, 4096, dtype=fp8.E4M3), fp8_skinny.Tiles(64, 256, 1, 4, 3)),
    ):
        t = fp8_skinny.fits(torch.zeros(m, weight.shape[1], dtype=torch.bfloat16), weight)
        assert t == want, (m, weight.shape)
        assert fp8_skinny.applies(t, *weight.shape, fp8_skinny.block_m(m))
    assert fp8_skinny.fits(x.float(), q) is None  # float32 input: the general path
    assert fp8_skinny.fits(x, q.float()) is None  # not an FP8 weight
    assert fp8_skinny.fits(x[:, :2048], q) is None  # K differs
    wide = torch.zeros(28672, 4096, dtype=fp8.E4M3)
    assert fp8_skinny.fits(x, wide) == fp8_skinny.Tiles(64, 256, 1, 4, 4)  # shorter k tiles
    # Past PRECISE_K, at one row tile, K is split in two and each k tile's
    # sum kept in float32 (not the tensor cores' own accumulation); split
    # into sums of at most PRECISE_K at more.
    long_k = torch.zeros(4096, 14336, dtype=fp8.E4M3)
    rows = torch.zeros(1, 14336, dtype=torch.bfloat16)
    assert fp8_skinny.fits(rows, long_k) == fp8_skinny.Tiles(64, 512, 2, 4, 4, precise=True)
    # A K no tile divides twice: the k tile halves until one does, else none.
    assert fp8_skinny.fits(x[:, :384], q[:, :384].contiguous()) == fp8_skinny.Tiles(
        64, 128, 1, 4, 4
    )
    assert fp8_skinny.fits(x[:, :200], q[:, :200].contiguous()) is None


def test_no_program_sums_a_long_k_in_the_tensor_cores_alone() -> None:
    """At every dense preset's products and row tile, the engine's tiles
    split K into sums of at most ``PRECISE_K``, or keep each k tile's sum in
    float32 (``precise``): on sm_90 the e4m3 tensor cores accumulate in fewer
    bits, and an unsplit K of 14336 came out over ``tests/test_fp8_gpu.py``'s
    bound."""
    from engine.layers import fp8_skinny
    from engine.model_config import ModelConfig
    from engine.presets import PRESETS

    seen = 0
    for preset in PRESETS:
        c = ModelConfig.from_dict(PRESETS[preset])
        q, kv = c.num_heads * c.head_dim, c.num_kv_heads * c.head_dim
        shapes = [(q + 2 * kv, c.hidden_size), (c.hidden_size, q)]
        if c.moe is None:
            shapes += [
                (2 * c.intermediate_size, c.hidden_size),
                (c.hidden_size, c.intermediate_size),
            ]
        for (n, k), rows_tile in itertools.product(shapes, (16, 32, 64)):
            t = fp8_skinny.tiles(n, k, rows_tile)
            if t is None:
                continue
            seen += 1
            assert k // t.split_k <= fp8_skinny.PRECISE_K or t.precise, (preset, n, k, t)
            assert fp8_skinny.applies(t, n, k, rows_tile)
    assert seen >= 30
    # Qwen2.5-7B's down product (K 18944): split in two with precise sums at
    # one row tile (k tiles of 256: 512 do not divide a half), four sums of
    # 4736 at two.
    assert fp8_skinny.tiles(3584, 18944) == fp8_skinny.Tiles(64, 256, 2, 4, 4, precise=True)
    assert fp8_skinny.tiles(3584, 18944, 32) == fp8_skinny.Tiles(64, 128, 4, 4, 3)


@interpreted
@pytest.mark.parametrize(
    ("rows", "k", "block_k"),
    [(3, 256, 64), (2, 200, 64), (1, 96, 1024), (3, 256, None), (2, 200, None)],
)
def test_the_quantization_kernel_gives_torchs_numbers(
    rows: int, k: int, block_k: int | None
) -> None:
    """Scales and e4m3 values equal ``fp8.quantize_rows``'s, from rows read in
    tiles (``block_k``) or held whole (None); K not a multiple of the tile
    (200) masks the last one; an all-zero row gets zeros."""
    from engine.layers import fp8_quant

    x = _exact_rows(rows, k, torch.Generator().manual_seed(k))
    x[-1] = 0 if rows > 1 else x[-1]
    q, s = fp8_quant.quantize_rows(x, block_k)
    want_q, want_s = fp8.quantize_rows(x)
    assert q.dtype == fp8.E4M3 and torch.equal(s, want_s)
    assert torch.equal(q.float(), want_q.float())


def _within_a_step(got: torch.Tensor, want: torch.Tensor) -> None:
    """e4m3 values equal, or one step apart (the activation rounded from sums
    in another order), or, the interpreter's known mis-rounding, half a
    power of two the reference rounded up to; most of them equal."""
    got, want = got.float(), want.float()
    mag = torch.maximum(got.abs(), want.abs()).clamp_min(2.0**-6)
    step = 2.0 ** (torch.floor(torch.log2(mag)) - 3)
    near = (got - want).abs() <= step
    halved = (got * 2 == want) & (torch.log2(want.abs()) % 1 == 0)
    assert (near | halved).all(), (got[~(near | halved)], want[~(near | halved)])
    assert (got == want).float().mean().item() > 0.9


@interpreted
@pytest.mark.parametrize("with_residual", [True, False])
@pytest.mark.parametrize(("rows", "k"), [(5, 96), (2, 200)])
def test_norm_and_quantization_in_one_kernel(rows: int, k: int, with_residual: bool) -> None:
    """``fp8_quant.norm_quantize``: the residual sum rounded once (exact), and
    the norm of the unrounded sum as FlashInfer's fused kernel writes it, quantized as
    ``fp8.quantize_rows`` does; no residual: the input comes back as it."""
    from engine.layers import fp8_quant

    g = torch.Generator().manual_seed(rows + k)
    x = torch.randn(rows, k, generator=g).to(torch.float16)
    r = torch.randn(rows, k, generator=g).to(torch.float16)
    w = (torch.rand(k, generator=g) + 0.5).to(torch.float16)
    res = r.clone() if with_residual else None
    got, h = fp8_quant.norm_quantize(x, res, w, 1e-6)
    want_h = (x.float() + r.float()).to(torch.float16) if with_residual else x
    assert torch.equal(h, want_h) and (h is res if with_residual else h is x)
    hf = x.float() + r.float() if with_residual else x.float()  # normalized unrounded
    y = (hf * torch.rsqrt(hf.pow(2).mean(-1, keepdim=True) + 1e-6) * w.float()).to(torch.float16)
    want_q, want_s = fp8.quantize_rows(y)
    assert got.dtype == torch.float16 and got.shape == (rows, k)
    assert ((got.scale - want_s).abs() <= want_s * 2.0**-10).all()  # one fp16 step of the amax
    _within_a_step(got.q, want_q)


@interpreted
def test_silu_mul_and_quantization_in_one_kernel() -> None:
    from engine.layers import fp8_quant

    g = torch.Generator().manual_seed(3)
    gate_up = (torch.randn(4, 2 * 80, generator=g) * 2).to(torch.float16)
    got = fp8_quant.silu_mul_quantize(gate_up)
    gate, up = gate_up.float().chunk(2, dim=-1)
    want_q, want_s = fp8.quantize_rows((torch.nn.functional.silu(gate) * up).to(torch.float16))
    assert got.shape == (4, 80) and got.dtype == torch.float16
    assert ((got.scale - want_s).abs() <= want_s * 2.0**-10).all()
    _within_a_step(got.q, want_q)


@interpreted
@pytest.mark.parametrize("rows", [1, 3])
def test_gated_mlp_gives_the_separate_kernels_numbers(rows: int) -> None:
    """``fp8_skinny.gated`` (gate/up with SiLU-and-mul in its epilogue) then
    the down product on its ``Deferred`` rows: the SiLU product equal to
    what the gate/up product and ``silu_mul_quantize`` make, its quantized
    rows and so the MLP's output equal to those of the three kernels; and
    against float64 of the quantized operands."""
    from engine.layers import fp8_quant, fp8_skinny
    from engine.layers.fp8_quant import Deferred, Quantized

    g = torch.Generator().manual_seed(rows)
    hidden, inter = 128, 192  # 3 gate tiles of 64: maxima over 3 programs a row
    x = Quantized(*fp8.quantize_rows(torch.randn(rows, hidden, generator=g)), torch.float16)
    w13, s13 = fp8.quantize_rows(torch.randn(2 * inter, hidden, generator=g) * 0.2)
    w2, s2 = fp8.quantize_rows(torch.randn(hidden, inter, generator=g) * 0.1)
    t = fp8_skinny.Tiles(64, 64, 1, 4, 2)

    h = fp8_skinny.gated(x, w13, s13, t)
    assert isinstance(h, Deferred) and h.shape == (rows, inter) and h.maxes.shape == (rows, 3)
    gate_up = fp8_skinny.run(x, w13, s13, None, t)  # the separate kernels
    gate, up = gate_up.float().chunk(2, dim=-1)
    want_h = (gate / (1.0 + torch.exp(-gate)) * up).to(torch.float16)
    assert torch.equal(h.rows, want_h)
    assert torch.equal(h.maxes.amax(dim=1), want_h.float().abs().amax(dim=1))
    separate = fp8_quant.silu_mul_quantize(gate_up)

    down = fp8_skinny.Tiles(64, 64, 1, 4, 2)
    got = fp8_skinny.run(h, w2, s2, None, down)
    want = fp8_skinny.run(separate, w2, s2, None, down)
    assert got.dtype == torch.float16 and torch.equal(got, want)
    ref = fp8.dequantize_rows(separate.q, separate.scale).double() @ (
        fp8.dequantize_rows(w2, s2).double().t()
    )
    atol = 1e-3 * ref.abs().amax(dim=1, keepdim=True)
    assert ((got.double() - ref).abs() <= 2e-3 * ref.abs() + atol).all()
    # Split over K: the deferred rows quantized alike in every split.
    split = fp8_skinny.run(h, w2, s2, None, down._replace(split_k=3))
    assert ((split.double() - ref).abs() <= 2e-3 * ref.abs() + atol).all()
    # A row's numbers do not depend on the rows beside it (one row alone takes
    # the kernel's one-row path).
    alone = fp8_skinny.run(Deferred(h.rows[:1], h.maxes[:1]), w2, s2, None, down)
    assert torch.equal(alone[0], got[0])


def test_what_takes_the_gated_mlp() -> None:
    from engine.layers import fp8_skinny
    from engine.layers.fp8_quant import Deferred, Quantized

    w13 = torch.zeros(28672, 4096, dtype=fp8.E4M3)
    w2 = torch.zeros(4096, 14336, dtype=fp8.E4M3)
    for m in (1, fp8_skinny.DEFERRED_ROWS):
        x = Quantized(torch.zeros(m, 4096, dtype=fp8.E4M3), torch.ones(m), torch.bfloat16)
        t = fp8_skinny.gated_fits(x, w13)
        assert t is not None and t.split_k == 1 and 14336 % t.block_n == 0
        h = Deferred(torch.zeros(m, 14336, dtype=torch.bfloat16), torch.zeros(m, 14336 // 64))
        # At every row count: split in two (the loop that quantizes as it
        # loads is issue-bound), each k tile's sum kept in float32.
        want = fp8_skinny.Tiles(64, 512, 2, 4, 4, precise=True)
        assert fp8_skinny.fits(h, w2) == want
    m = fp8_skinny.DEFERRED_ROWS + 1
    x = Quantized(torch.zeros(m, 4096, dtype=fp8.E4M3), torch.ones(m), torch.bfloat16)
    assert fp8_skinny.gated_fits(x, w13) is None  # too many rows to quantize as loaded
    h = Deferred(torch.zeros(m, 14336, dtype=torch.bfloat16), torch.zeros(m, 224))
    assert fp8_skinny.fits(h, w2) is None
    with pytest.raises(ValueError, match="deferred rows"):
        fp8_skinny.run(h, w2, torch.ones(4096), None, fp8_skinny.Tiles(64, 256, 1, 4, 4))
    one = Quantized(x.q[:1], x.scale[:1], x.dtype)
    assert fp8_skinny.gated_fits(one, w13[:-1]) is None  # an odd number of weight rows


def test_the_sweeps_hold_the_engines_tiles() -> None:
    """``bench_fp8 --sweep`` and ``--sweep narrow`` (their grids printed, no
    GPU needed) try the tiles the engine takes for Llama-3.1-8B's products at
    one row and at 64, so a sweep can confirm or beat them; the narrow grid
    is part of the whole one."""
    from engine.layers import fp8_skinny

    def grid(*sweep: str) -> dict[int, set[fp8_skinny.Tiles]]:
        cmd = [sys.executable, "-m", "benchmarks.kernels.bench_fp8", "--rows", "1", "64",
               "--print-sweep", "--sweep", *sweep]  # fmt: skip
        done = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=120)
        assert done.returncode == 0, done.stderr[-2000:]
        out = json.loads(done.stdout)
        return {int(m): {fp8_skinny.Tiles(**t) for t in ts} for m, ts in out.items()}

    whole, narrow = grid(), grid("narrow")
    assert set(whole) == set(narrow) == {1, 64}
    shapes = {
        "qkv": (6144, 4096),
        "o": (4096, 4096),
        "gate_up": (28672, 4096),
        "down": (4096, 14336),
    }
    for m in (1, 64):
        assert narrow[m] < whole[m]
        for name, (n, k) in shapes.items():
            t = fp8_skinny.tiles(n, k, fp8_skinny.block_m(m))
            assert t in narrow[m], (name, m, t)
