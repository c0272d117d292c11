"""FP8 products (``engine.layers.fp8``) against bf16 at a model's shapes, on CUDA.

    python -m benchmarks.kernels.bench_fp8 --model llama-3.1-8b --rows 1 8 64 256 1024 8192

For each projection of the model's decoder layer (QKV, o, gate/up, down) and
each row count M, an ``[M, K]`` bf16 input is multiplied by enough copies of a
random ``[N, K]`` weight that L2 holds none of them, inside a CUDA graph, timed
with CUDA events:

- ``bf16``: ``engine.layers.gemv.linear`` (the GEMV and few-row kernels where
  they apply, cuBLAS otherwise), the product a bf16 model runs;
- ``fp8``: ``engine.layers.linear.any_linear`` on bf16 rows, the product an
  FP8 model runs after attention: the rows quantized per token
  (``fp8_quant.quantize_rows``), then up to ``fp8_skinny.MAX_ROWS`` rows the
  Triton kernel that feeds the e4m3 weight to the tensor cores
  (``engine.layers.fp8_skinny``), more rows ``torch._scaled_mm`` with
  row-wise scales;
- ``fp8_given``: the same on rows quantized already (``Quantized``), the
  product after a norm or SiLU-and-mul, which quantize their output
  themselves (what the quantization kernel costs is the difference);
- ``fp8_mm``: ``torch._scaled_mm`` alone on an already quantized input.

Floors: bytes moved (the weight, 2 or 1 byte per element, plus input and
output) at 4.3 TB/s and the FLOPs at the dense tensor-core rate (989 TFLOP/s
bf16, 1979 FP8); the larger of the two. Each FP8 result is checked against a
float64 product of the quantized operands. ``--sweep`` also times the few-row
kernel on quantized rows over a grid of tiles at every row count it takes (up
to ``fp8_skinny.MAX_ROWS``), and records the best; ``--sweep narrow`` over the
part of that grid one GPU call times for all four products (4 warps, 32- and
64-row tiles).

``--mlp`` times the whole FP8 MLP instead, at each row count up to
``fp8_skinny.DEFERRED_ROWS``, on a quantized input: ``separate`` (the gate/up
product, ``fp8_quant.silu_mul_quantize``, the down product: three kernels)
against ``gated`` (``fp8_skinny.gated``, then the down product on its
``Deferred`` rows), the engine's gated tiles and a grid of others, every
output checked against the separate kernels'; at the engine's tiles also
each of the two kernels alone, and the down product on the deferred rows
at splits of K of 1, 2 and 4 (time, and error from float64).
Writes a JSON record to ``--output-file``.
"""

from __future__ import annotations

import argparse
import json
from typing import Any

import torch

from benchmarks.common import machine, write_record
from benchmarks.kernels.bench_gemv import L2_BYTES, graph_us, rel_err, shapes
from engine.layers import fp8, fp8_quant, fp8_skinny, gemv
from engine.layers.fp8_quant import Deferred, Quantized
from engine.layers.linear import any_linear
from engine.presets import PRESETS

HBM_BYTES_PER_S = 4.3e12
"""What the H200's memory reaches (4.8 TB/s specified)."""
TENSOR_FLOPS = {"bf16": 989e12, "fp8": 1979e12}
"""H100/H200 SXM dense tensor-core rates as specified."""


def floor_us(m: int, n: int, k: int, weight_bytes_per: int, kind: str) -> float:
    moved = n * k * weight_bytes_per + m * k * 2 + m * n * 2
    return max(moved / HBM_BYTES_PER_S, 2 * m * n * k / TENSOR_FLOPS[kind]) * 1e6


def bench_case(
    name: str, n: int, k: int, m: int, reps: int, sweep: str | None = None
) -> dict[str, Any]:
    gen = torch.Generator(device="cuda").manual_seed(n + k + m)
    copies = max(2, int(L2_BYTES // (n * k * 2)))
    ws = [
        torch.randn(n, k, device="cuda", dtype=torch.bfloat16, generator=gen) * 0.02
        for _ in range(copies)
    ]
    qs = [fp8.quantize_rows(w) for w in ws]
    x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16, generator=gen)
    xq, sx = fp8.quantize_rows(x)
    w0 = fp8.dequantize_rows(*qs[0]).double()
    ref = fp8.dequantize_rows(xq, sx).double() @ w0.t()
    row: dict[str, Any] = {"name": name, "rows": m, "n": n, "k": k}
    row["bf16_us"] = graph_us([lambda w=w: gemv.linear(x, w) for w in ws], reps)
    row["bf16_floor_us"] = floor_us(m, n, k, 2, "bf16")
    row["fp8_fits_scaled_mm"] = fp8.scaled_mm_fits(xq, qs[0][0], x.dtype)
    row["fp8_us"] = graph_us([lambda q=q, s=s: any_linear(x, q, None, s) for q, s in qs], reps)
    row["fp8_rel_err"] = rel_err(any_linear(x, qs[0][0], None, qs[0][1]), ref)
    given = Quantized(xq, sx, x.dtype)
    row["fp8_given_us"] = graph_us(
        [lambda q=q, s=s: any_linear(given, q, None, s) for q, s in qs], reps
    )
    row["fp8_given_rel_err"] = rel_err(any_linear(given, qs[0][0], None, qs[0][1]), ref)
    if row["fp8_fits_scaled_mm"]:
        sa = sx[:, None].contiguous()
        rowwise = [(q, s[None, :].contiguous()) for q, s in qs]

        def mm(q: torch.Tensor, sb: torch.Tensor) -> torch.Tensor:
            return torch._scaled_mm(xq, q.t(), scale_a=sa, scale_b=sb, out_dtype=x.dtype)

        row["fp8_mm_us"] = graph_us([lambda q=q, sb=sb: mm(q, sb) for q, sb in rowwise], reps)
    row["fp8_floor_us"] = floor_us(m, n, k, 1, "fp8")
    row["fp8_speedup"] = row["bf16_us"] / row["fp8_us"]
    if sweep and m <= fp8_skinny.MAX_ROWS:
        row["skinny_sweep"] = sweep_skinny(given, qs, reps, ref, sweep == "narrow")
        row["skinny_best"] = min(
            (r for r in row["skinny_sweep"] if "us" in r), key=lambda r: r["us"]
        )
    return row


def bench_mlp(hidden: int, inter: int, m: int, reps: int) -> dict[str, Any]:
    """The FP8 MLP of ``m`` rows, three kernels against two (``--mlp``)."""
    gen = torch.Generator(device="cuda").manual_seed(hidden + inter + m)
    copies = max(2, int(L2_BYTES // (3 * hidden * inter)))

    def weight(n: int, k: int) -> tuple[torch.Tensor, torch.Tensor]:
        w = torch.randn(n, k, device="cuda", dtype=torch.bfloat16, generator=gen) * 0.02
        return fp8.quantize_rows(w)

    layers = [(weight(2 * inter, hidden), weight(hidden, inter)) for _ in range(copies)]
    x = torch.randn(m, hidden, device="cuda", dtype=torch.bfloat16, generator=gen)
    given = Quantized(*fp8.quantize_rows(x), x.dtype)

    def separate(w13: tuple, w2: tuple) -> torch.Tensor:
        h = fp8_quant.silu_mul_quantize(any_linear(given, w13[0], None, w13[1]))
        return any_linear(h, w2[0], None, w2[1])

    def gated(w13: tuple, w2: tuple, t: fp8_skinny.Tiles) -> torch.Tensor:
        return any_linear(fp8_skinny.gated(given, *w13, t), w2[0], None, w2[1])

    want = separate(*layers[0])
    row: dict[str, Any] = {"rows": m, "hidden": hidden, "intermediate": inter}
    row["separate_us"] = graph_us([lambda w=w: separate(*w) for w in layers], reps)
    row["floor_us"] = 3 * hidden * inter / HBM_BYTES_PER_S * 1e6
    engine = fp8_skinny.gated_fits(given, layers[0][0][0])
    row["gated_tiles"] = engine._asdict() if engine else None
    sweep = []
    grid = [fp8_skinny.Tiles(64, bk, 1, 4, st) for bk in (64, 128, 256) for st in (2, 3, 4)]
    for t in ([engine] if engine else []) + [t for t in grid if t != engine]:
        if not fp8_skinny.applies(t, inter, hidden):
            continue
        try:
            got = gated(*layers[0], t)
        except Exception as e:  # a tile the compiler refuses (shared memory)
            sweep.append({**t._asdict(), "error": repr(e)[:200]})
            continue
        us = graph_us([lambda w=w, t=t: gated(*w, t) for w in layers], reps)
        sweep.append({**t._asdict(), "us": us, "equal": bool(torch.equal(got, want))})
    row["gated_sweep"] = sweep
    timed = [r for r in sweep if "us" in r]
    row["gated_us"] = timed[0]["us"] if engine and timed else None
    row["gated_best"] = min(timed, key=lambda r: r["us"]) if timed else None
    if engine and timed:
        # Each of the two kernels alone at the engine's tiles, where the time goes.
        hs = [fp8_skinny.gated(given, *w13, engine) for w13, _ in layers]
        row["gated_alone_us"] = graph_us(
            [lambda w=w: fp8_skinny.gated(given, *w[0], engine) for w in layers], reps
        )
        row["down_deferred_us"] = graph_us(
            [lambda h=h, w=w: any_linear(h, w[1][0], None, w[1][1]) for h, w in zip(hs, layers)],
            reps,
        )
        row["down_deferred_sweep"] = sweep_deferred(hs, [w2 for _, w2 in layers], m, reps)
    return row


def sweep_deferred(
    hs: list[Deferred], w2s: list[tuple[torch.Tensor, torch.Tensor]], m: int, reps: int
) -> list[dict[str, Any]]:
    """The down product on ``m`` deferred rows at splits of K of 1, 2 and 4,
    with and without precise sums (always precise where a split's sum is
    longer than ``PRECISE_K``; the engine's tiles are
    ``fp8_skinny.tiles``), each against float64 of the rows as
    ``silu_mul_quantize`` quantizes them and the weight."""
    q, s = w2s[0]
    n, k = q.shape
    engine = fp8_skinny.tiles(n, k)
    quantized = fp8.dequantize_rows(*fp8.quantize_rows(hs[0].rows)).double()
    ref = quantized @ fp8.dequantize_rows(q, s).double().t()
    out = []
    for split in (1, 2, 4):
        for precise in (True, False):
            if not precise and k // split > fp8_skinny.PRECISE_K:
                continue
            t = engine._replace(split_k=split, precise=precise)
            if not fp8_skinny.applies(t, n, k):
                continue
            err = rel_err(fp8_skinny.run(hs[0], q, s, None, t), ref)
            us = graph_us(
                [lambda h=h, w=w, t=t: fp8_skinny.run(h, *w, None, t) for h, w in zip(hs, w2s)],
                reps,
            )
            out.append({**t._asdict(), "us": us, "rel_err": err, "engine": t == engine})
    return out


def sweep_skinny(
    x: Quantized,
    qs: list[tuple[torch.Tensor, torch.Tensor]],
    reps: int,
    ref: torch.Tensor,
    narrow: bool = False,
) -> list[dict[str, Any]]:
    """``fp8_skinny.run`` on rows quantized already (as the engine hands them)
    over ``sweep_tiles`` (those that apply to the shape), each result
    checked."""
    n, k = qs[0][0].shape
    rows_tile = fp8_skinny.block_m(x.q.shape[0])
    out = []
    for t in sweep_tiles(rows_tile, narrow):
        if not fp8_skinny.applies(t, n, k, rows_tile):
            continue
        try:
            err = rel_err(fp8_skinny.run(x, qs[0][0], qs[0][1], None, t), ref)
        except Exception as e:  # a tile the compiler refuses (registers, shared memory)
            out.append({**t._asdict(), "error": repr(e)[:200]})
            continue
        us = graph_us([lambda q=q, s=s, t=t: fp8_skinny.run(x, q, s, None, t) for q, s in qs], reps)
        out.append({**t._asdict(), "us": us, "rel_err": err})
    return out


def sweep_tiles(rows_tile: int, narrow: bool = False) -> list[fp8_skinny.Tiles]:
    """Tiles of the few-row FP8 kernel tried by ``--sweep`` at an input-row
    tile of ``rows_tile`` (32 weight rows a program take the warp-level
    matrix instructions, 64 and 128 Hopper's warpgroup ones). Past 16 rows
    the input's tile grows with them, so fewer stages and shorter k tiles fit
    in shared memory; those over it are refused at launch and recorded. At
    one row tile two and three stages are tried too: with less shared memory
    a program, two fit an SM, so more programs (a split over K, narrower
    tiles) still run in one wave. Unsplit tiles and splits in two are tried
    with ``precise`` sums too (each k tile's added in float32), the other way
    to keep a long K's error down than a split. ``narrow``: 4 warps on 32- and 64-row
    tiles, the two longest k tiles, splits of 1, 2 and 4."""
    wide = rows_tile > fp8_skinny.BLOCK_M
    k_tiles = (128, 256) if wide else (128, 256, 512)
    grid = [
        fp8_skinny.Tiles(bn, bk, sk, warps, stages)
        for bn in (32, 64, 128)
        for bk in k_tiles
        for sk in (1, 2, 4, 8)
        for warps in ((4, 8) if bn == 128 else (4,))
        for stages in ((2, 3) if wide else (2, 3, 4))
    ]
    # Unsplit tiles and splits in two also with their sums promoted to float32
    # every k tile.
    grid += [t._replace(precise=True) for t in grid if t.split_k <= 2]
    if narrow:
        longest = k_tiles[-2:]
        return [t for t in grid if t.block_n <= 64 and t.block_k in longest and t.split_k <= 4]
    return grid


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m benchmarks.kernels.bench_fp8",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--model", choices=sorted(PRESETS), default="llama-3.1-8b")
    p.add_argument("--rows", type=int, nargs="+", default=[1, 8, 64, 256, 1024, 8192])
    p.add_argument("--reps", type=int, default=20, help="timed graph replays per case")
    p.add_argument(
        "--sweep",
        nargs="?",
        const="all",
        choices=("all", "narrow"),
        default=None,
        help="also sweep the few-row kernel's tiles (narrow: 4 warps, 32- and 64-row tiles)",
    )
    p.add_argument(
        "--projections",
        nargs="+",
        choices=("qkv", "o", "gate_up", "down"),
        default=None,
        help="only these products (default: all four)",
    )
    p.add_argument(
        "--mlp",
        action="store_true",
        help="time the whole FP8 MLP, three kernels against the gated two, at rows <= "
        f"{fp8_skinny.DEFERRED_ROWS}",
    )
    p.add_argument(
        "--print-sweep",
        action="store_true",
        help="print the tiles --sweep would try at each row count, as JSON, and exit (no GPU)",
    )
    p.add_argument("--output-file", default=None)
    return p


def main(argv: list[str] | None = None) -> None:
    args = build_parser().parse_args(argv)
    if args.print_sweep:
        grids = {
            m: [t._asdict() for t in sweep_tiles(fp8_skinny.block_m(m), args.sweep == "narrow")]
            for m in args.rows
            if m <= fp8_skinny.MAX_ROWS
        }
        print(json.dumps(grids))
        return
    if not torch.cuda.is_available():
        raise SystemExit("bench_fp8 needs a CUDA device")
    if args.mlp:
        return mlp_main(args, argv)
    wanted = args.projections or ("qkv", "o", "gate_up", "down")
    layer = {k: v for k, v in shapes(args.model).items() if k in wanted}
    rows = [
        bench_case(name, n, k, m, args.reps, args.sweep)
        for m in args.rows
        for name, (n, k) in layer.items()
    ]
    print(
        f"{'proj':>8} {'rows':>5} {'bf16 us':>8} {'floor':>7} {'fp8 us':>8} {'given':>7} "
        f"{'mm us':>7} {'floor':>7} {'x':>5} {'rel err':>8}"
    )
    for r in rows:
        mm = f"{r['fp8_mm_us']:>7.1f}" if "fp8_mm_us" in r else f"{'-':>7}"
        print(
            f"{r['name']:>8} {r['rows']:>5} {r['bf16_us']:>8.1f} {r['bf16_floor_us']:>7.1f} "
            f"{r['fp8_us']:>8.1f} {r['fp8_given_us']:>7.1f} {mm} {r['fp8_floor_us']:>7.1f} "
            f"{r['fp8_speedup']:>5.2f} "
            f"{r['fp8_rel_err']:>8.1e}"
        )
        if "skinny_best" in r:
            b = r["skinny_best"]
            print(
                f"{'':>14} best few-row tiles {tuple(b[f] for f in fp8_skinny.Tiles._fields)}: "
                f"{b['us']:.1f} us"
            )
    write_record(
        "benchmarks.kernels.bench_fp8",
        argv,
        {"model": args.model, "rows": rows},
        args.output_file,
        f"fp8-{args.model}",
        machine(),
    )


def mlp_main(args: argparse.Namespace, argv: list[str] | None) -> None:
    layer = shapes(args.model)
    if "down" not in layer:
        raise SystemExit(f"{args.model}: no dense MLP")
    hidden, inter = layer["down"]
    rows = [
        bench_mlp(hidden, inter, m, args.reps) for m in args.rows if m <= fp8_skinny.DEFERRED_ROWS
    ]
    print(
        f"{'rows':>5} {'separate us':>12} {'gated us':>9} {'= gated':>8} {'+ down':>7} "
        f"{'best gated':>11} {'floor':>7}  best tiles"
    )
    for r in rows:
        b, g = r["gated_best"], r["gated_us"]
        print(
            f"{r['rows']:>5} {r['separate_us']:>12.1f} {g if g is None else f'{g:.1f}':>9} "
            f"{r.get('gated_alone_us', float('nan')):>8.1f} "
            f"{r.get('down_deferred_us', float('nan')):>7.1f} "
            f"{b['us'] if b else float('nan'):>11.1f} {r['floor_us']:>7.1f}  "
            f"{tuple(b[f] for f in fp8_skinny.Tiles._fields) if b else '-'} "
            f"equal to separate: {all(x.get('equal', True) for x in r['gated_sweep'])}"
        )
        for d in r.get("down_deferred_sweep", []):
            print(
                f"      down on deferred rows, K split {d['split_k']}, precise {d['precise']}: "
                f"{d['us']:.1f} us, {d['rel_err']:.2e} from float64"
                + (" (engine)" if d["engine"] else "")
            )
    write_record(
        "benchmarks.kernels.bench_fp8",
        argv,
        {"model": args.model, "mlp": rows},
        args.output_file,
        f"fp8-mlp-{args.model}",
        machine(),
    )


if __name__ == "__main__":
    main()
