"""One-row and few-row products (small-batch decode) on CUDA: cuBLAS against
the GEMV kernels and the few-row kernel.

    python -m benchmarks.kernels.bench_gemv --model llama-3.1-8b
    python -m benchmarks.kernels.bench_gemv --model llama-3.1-8b --sweep     # search the tiles
    python -m benchmarks.kernels.bench_gemv --model llama-3.1-8b --rows 2 8 16 32 64 \
        --rows-sweep 8 32 64                          # few rows, tiles searched at 8/32/64

For each weight of the model's decoder layer (QKV, o, gate/up, down) and its
LM head, a ``[1, K]`` bf16 input is multiplied by enough copies of a random
``[N, K]`` weight that L2 holds none of them (as in a forward, where every
layer's weights are new), inside a CUDA graph, timed with CUDA events:
``F.linear`` (cuBLAS), ``engine.layers.gemv.linear`` with the tiles it picks,
and for the down projection ``silu_mul_linear`` (SiLU-and-mul read inside the
product) against the two steps. ``--sweep`` also times every tile of a grid and
reports the fastest. ``--rows`` times ``[M, K]`` inputs the same way on cuBLAS
and ``engine.layers.skinny`` (the tiles it picks; ``--rows-sweep`` searches its
grid for the given M). Each kernel's result is checked against a float64
product. Writes a JSON record to ``--output-file``.
"""

from __future__ import annotations

import argparse
import itertools
import statistics
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from torch.nn import functional as F

from benchmarks.common import machine, write_record
from engine.layers import gemv, skinny
from engine.model_config import ModelConfig
from engine.presets import PRESETS

L2_BYTES = 400e6
"""Weights rotated per timed call: more than the H200's 50 MB L2, many times over."""


def shapes(model: str) -> dict[str, tuple[int, int]]:
    """(N, K) of each one-row product of ``model``'s decode step (for a mixture of
    experts: its dense products and the router)."""
    mc = ModelConfig.from_dict(PRESETS[model])
    q, kv = mc.num_heads * mc.head_dim, mc.num_kv_heads * mc.head_dim
    attention = {"qkv": (q + 2 * kv, mc.hidden_size), "o": (mc.hidden_size, q)}
    if mc.moe is not None:  # the experts are bench_moe's
        return {**attention, "router": (mc.moe.num_experts, mc.hidden_size),
                "lm_head": (mc.vocab_size, mc.hidden_size)}  # fmt: skip
    return {
        **attention,
        "gate_up": (2 * mc.intermediate_size, mc.hidden_size),
        "down": (mc.hidden_size, mc.intermediate_size),
        "lm_head": (mc.vocab_size, mc.hidden_size),
    }


def graph_us(calls: list[Callable[[], Any]], reps: int) -> float:
    """Median GPU microseconds of one call, the calls replayed from a graph."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for call in calls:  # compiles and warms up outside the graph
            call()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for call in calls:
            call()
    graph.replay()
    torch.cuda.synchronize()
    times = []
    for _ in range(reps):
        e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        e0.record()
        graph.replay()
        e1.record()
        torch.cuda.synchronize()
        times.append(e0.elapsed_time(e1) * 1e3 / len(calls))
    return statistics.median(times)


def rel_err(got: torch.Tensor, ref: torch.Tensor) -> float:
    return float((got.double() - ref).norm() / ref.norm())


def operands(
    n: int, k: int, m: int, seed: int
) -> tuple[torch.Generator, list[torch.Tensor], torch.Tensor, torch.Tensor]:
    """(the generator, enough ``[n, k]`` weights that L2 holds none of them, an
    ``[m, k]`` input, its float64 product with the first weight)."""
    gen = torch.Generator(device="cuda").manual_seed(seed)
    copies = max(2, int(L2_BYTES // (n * k * 2)))
    ws = [
        torch.randn(n, k, device="cuda", dtype=torch.bfloat16, generator=gen) * 0.02
        for _ in range(copies)
    ]
    x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16, generator=gen)
    return gen, ws, x, F.linear(x.double(), ws[0].double())


def add_rates(row: dict[str, Any]) -> None:
    """A TB/s entry beside each ``*_us`` timing of ``row`` (its weight's bytes)."""
    for key in [k_ for k_ in row if k_.endswith("_us")]:
        row[key.removesuffix("_us") + "_tbps"] = row["weight_bytes"] / row[key] / 1e6


def bench_shape(name: str, n: int, k: int, args: argparse.Namespace) -> dict[str, Any]:
    gen, ws, x, ref = operands(n, k, 1, n + k)
    row: dict[str, Any] = {"name": name, "n": n, "k": k, "weight_bytes": n * k * 2}
    row["cublas_us"] = graph_us([lambda w=w: F.linear(x, w) for w in ws], args.reps)
    tiles = gemv.tiles(n, k)
    row["tiles"] = None if tiles is None else tiles._asdict()
    if tiles is not None:
        row["gemv_us"] = graph_us([lambda w=w: gemv.linear(x, w) for w in ws], args.reps)
        row["gemv_rel_err"] = rel_err(gemv.linear(x, ws[0]), ref)
    if name == "down":
        gu = torch.randn(1, 2 * k, device="cuda", dtype=torch.bfloat16, generator=gen)

        def act(t: torch.Tensor) -> torch.Tensor:
            g, u = t.chunk(2, -1)
            return F.silu(g) * u

        row["silu_then_cublas_us"] = graph_us(
            [lambda w=w: F.linear(act(gu), w) for w in ws], args.reps
        )
        if tiles is not None:
            fused = [lambda w=w: gemv.silu_mul_linear(gu, w, act) for w in ws]
            row["silu_gemv_us"] = graph_us(fused, args.reps)
            row["silu_gemv_rel_err"] = rel_err(
                gemv.silu_mul_linear(gu, ws[0], act), F.linear(act(gu).double(), ws[0].double())
            )
    if args.sweep:
        best = None
        for bn, bk, warps, stages in itertools.product(
            args.block_n, args.block_k, args.warps, args.stages
        ):
            if n % bn or k % bk or bn * bk > 16384:
                continue
            t = gemv.Tiles(bn, bk, warps, stages)
            us = graph_us([lambda w=w, t=t: gemv.run_gemv(x, w, None, t) for w in ws], args.reps)
            if best is None or us < best[0]:
                best = (us, t, rel_err(gemv.run_gemv(x, ws[0], None, t), ref))
        if best is not None:
            row["sweep_best"] = {"us": best[0], "tiles": best[1]._asdict(), "rel_err": best[2]}
    add_rates(row)
    return row


def bench_rows(name: str, n: int, k: int, m: int, args: argparse.Namespace) -> dict[str, Any]:
    """``m`` rows against the ``[n, k]`` weight: cuBLAS, the few-row kernel with
    the tiles it picks and, if ``m`` is in ``--rows-sweep``, the fastest tiles of
    the grid."""
    _, ws, x, ref = operands(n, k, m, n + k + m)
    row: dict[str, Any] = {"name": name, "rows": m, "n": n, "k": k, "weight_bytes": n * k * 2}
    row["cublas_us"] = graph_us([lambda w=w: F.linear(x, w) for w in ws], args.reps)
    chosen = skinny.tiles(m, n, k)
    row["tiles"] = None if chosen is None else chosen._asdict()
    if chosen is not None:
        row["skinny_us"] = graph_us(
            [lambda w=w: skinny.run_skinny(x, w, None, chosen) for w in ws], args.reps
        )
        row["skinny_rel_err"] = rel_err(skinny.run_skinny(x, ws[0], None, chosen), ref)
    if m in args.rows_sweep:
        best = None
        for bn, bk, split, warps, stages in itertools.product(
            args.rows_block_n, args.rows_block_k, args.rows_split, args.rows_warps, args.rows_stages
        ):
            t = skinny.Tiles(bn, bk, split, warps, stages)
            if not skinny.applies(t, m, n, k):
                continue
            try:
                err = rel_err(skinny.run_skinny(x, ws[0], None, t), ref)
                us = graph_us(
                    [lambda w=w, t=t: skinny.run_skinny(x, w, None, t) for w in ws], args.reps
                )
            except Exception as e:  # tiles beyond the SM's shared memory
                print(f"  {name} m={m} {t}: {type(e).__name__}", file=sys.stderr)
                continue
            if err > 1e-2:
                raise AssertionError(f"{name} m={m} {t}: relative error {err}")
            if best is None or us < best[0]:
                best = (us, t, err)
        if best is not None:
            row["sweep_best"] = {"us": best[0], "tiles": best[1]._asdict(), "rel_err": best[2]}
    add_rates(row)
    return row


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m benchmarks.kernels.bench_gemv",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument(
        "--model",
        choices=sorted(PRESETS),
        default="llama-3.1-8b",
        help="preset whose shapes are timed",
    )
    p.add_argument("--reps", type=int, default=10, help="timed graph replays per case (default 10)")
    p.add_argument("--sweep", action="store_true", help="also time every tile of the grid below")
    p.add_argument(
        "--block-n",
        type=int,
        nargs="+",
        default=[1, 2, 4, 8, 16],
        help="sweep: weight rows per program",
    )
    p.add_argument(
        "--block-k", type=int, nargs="+", default=[256, 512, 1024, 2048], help="sweep: K tile"
    )
    p.add_argument("--warps", type=int, nargs="+", default=[4, 8], help="sweep: warps per program")
    p.add_argument("--stages", type=int, nargs="+", default=[3, 4], help="sweep: pipeline stages")
    p.add_argument(
        "--rows",
        type=int,
        nargs="+",
        default=[],
        help="also time these input row counts (2..64) on cuBLAS and the few-row kernel",
    )
    p.add_argument(
        "--rows-sweep",
        type=int,
        nargs="+",
        default=[],
        help="row counts of --rows whose few-row tiles are searched over the grid below",
    )
    p.add_argument(
        "--rows-block-n", type=int, nargs="+", default=[32, 64, 128], help="sweep: few-row N tile"
    )
    p.add_argument(
        "--rows-block-k", type=int, nargs="+", default=[64, 128, 256], help="sweep: few-row K tile"
    )
    p.add_argument(
        "--rows-split", type=int, nargs="+", default=[1, 2, 4], help="sweep: few-row K splits"
    )
    p.add_argument("--rows-warps", type=int, nargs="+", default=[4], help="sweep: few-row warps")
    p.add_argument(
        "--rows-stages", type=int, nargs="+", default=[4], help="sweep: few-row pipeline stages"
    )
    p.add_argument("--output-file", type=Path, help="JSON record (default: results dir)")
    return p


def main(argv: list[str] | None = None) -> None:
    args = build_parser().parse_args(argv)
    if not torch.cuda.is_available():
        raise SystemExit("bench_gemv needs a CUDA device")
    rows = [bench_shape(name, n, k, args) for name, (n, k) in shapes(args.model).items()]
    many = [
        bench_rows(name, n, k, m, args)
        for m in args.rows
        for name, (n, k) in shapes(args.model).items()
    ]
    print(
        f"{'weight':<8} {'N':>7} {'K':>6} {'cuBLAS us':>10} {'GEMV us':>9} {'TB/s':>6} {'err':>8}"
    )
    for r in rows:
        g = r.get("gemv_us")
        print(
            f"{r['name']:<8} {r['n']:>7} {r['k']:>6} {r['cublas_us']:>10.1f} "
            f"{'-' if g is None else f'{g:9.1f}':>9} {r.get('gemv_tbps', 0):>6.2f} "
            f"{r.get('gemv_rel_err', float('nan')):>8.1e}"
            + (
                f"  sweep best {r['sweep_best']['us']:.1f} us {r['sweep_best']['tiles']}"
                if "sweep_best" in r
                else ""
            )
        )
        if "silu_gemv_us" in r:
            print(
                f"{'':<8} SiLU-and-mul then cuBLAS {r['silu_then_cublas_us']:.1f} us, fused {r['silu_gemv_us']:.1f} us"
            )
    if many:
        print(
            f"{'weight':<8} {'rows':>5} {'cuBLAS us':>10} {'kernel us':>10} {'TB/s':>6} {'err':>8}"
        )
    for r in many:
        g = r.get("skinny_us")
        print(
            f"{r['name']:<8} {r['rows']:>5} {r['cublas_us']:>10.1f} "
            f"{'-' if g is None else f'{g:10.1f}':>10} {r.get('skinny_tbps', 0):>6.2f} "
            f"{r.get('skinny_rel_err', float('nan')):>8.1e}"
            + (
                f"  sweep best {r['sweep_best']['us']:.1f} us {r['sweep_best']['tiles']}"
                if "sweep_best" in r
                else ""
            )
        )
    write_record(
        "benchmarks.kernels.bench_gemv",
        argv,
        {"model": args.model, "rows": rows, "few_rows": many},
        args.output_file,
        f"gemv-{args.model}",
        machine(),
    )


if __name__ == "__main__":
    main()
