"""One mixture-of-experts layer's experts on CUDA: the fused kernels
(``engine.layers.moe_triton``) at a model's shapes, against their floors.

    python -m benchmarks.kernels.bench_moe --model qwen3-30b-a3b --tokens 1 4 8 64 256 1024 8192
    python -m benchmarks.kernels.bench_moe --model qwen3-30b-a3b --sweep   # tiles and paths

For each token count, random bf16 tokens are routed (the fused router kernel,
random logits) to the experts of enough copies of the layer's weights that L2
holds none of them (as in a forward, where every layer's weights are new), and
the experts run inside a CUDA graph, timed with CUDA events. Floors: the bytes
of the experts the tokens touch at the memory's rate, and the FLOPs at the
tensor cores' dense bf16 rate; the larger is the floor. ``--sweep`` also times
both paths (matrix-vector, grouped GEMM) and a grid of GEMM tiles for each
count. Each configuration's output is checked against the torch reference.
Writes a JSON record to ``--output-file``.
"""

from __future__ import annotations

import argparse
from typing import Any

import torch

from benchmarks.common import machine, write_record
from benchmarks.kernels.bench_gemv import graph_us
from engine.layers import moe, moe_route, moe_triton
from engine.model_config import ModelConfig

HBM_BYTES_PER_S = 4.8e12
"""H200's memory rate as specified (4.8 TB/s; about 4.3 TB/s is reached)."""
BF16_FLOPS = 989e12
"""H100/H200 SXM dense bf16 tensor-core rate as specified."""
L2_BYTES = 60e6
SWEEP_TILES = (
    (64, 128, 4, 4),
    (64, 64, 4, 3),
    (128, 64, 4, 4),
    (128, 64, 8, 3),
    (128, 128, 8, 3),
    (128, 128, 4, 4),
    (256, 64, 8, 3),
)
"""(block_n, block_k, warps, stages) tried at every row block by ``--sweep``."""
SWEEP_GEMV = (
    moe_triton.GEMV_TILES,
    moe_triton.GemvTiles(1, 2048, 4, 1, 1024, 2),
    moe_triton.GemvTiles(1, 2048, 8, 1, 1024, 4),
    moe_triton.GemvTiles(1, 512, 1, 1, 256, 1),
    moe_triton.GemvTiles(2, 1024, 4, 2, 256, 2),
    moe_triton.GemvTiles(2, 1024, 4, 1, 1024, 8),
    moe_triton.GemvTiles(2, 2048, 8, 2, 1024, 4),
    moe_triton.GemvTiles(4, 512, 4, 4, 256, 4),
    moe_triton.GemvTiles(4, 1024, 8, 2, 512, 4),
    moe_triton.GemvTiles(4, 256, 2, 4, 128, 2),
    moe_triton.GemvTiles(8, 256, 4, 8, 256, 4),
)
"""Matrix-vector tiles tried by ``--sweep`` where the pairs are few."""
ROUTE_CALLS = 32
"""Router launches per timed graph replay."""
MIN_CALLS = 16
"""Expert launches per timed graph replay, at least: a replay's own fixed cost
(about 10 us) spread over them, not charged to one."""
SWEEP_ROUTE = (
    moe_route.RouteTiles(1, 1),
    moe_route.RouteTiles(2, 1),
    moe_route.RouteTiles(4, 2),
    moe_route.RouteTiles(16, 4),
)


def touched_experts(ids: torch.Tensor) -> int:
    return int(torch.unique(ids).numel())


def bench_tokens(n: int, args: argparse.Namespace, mc: ModelConfig) -> dict[str, Any]:
    assert mc.moe is not None
    e, k, hidden, inter = mc.moe.num_experts, mc.moe.top_k, mc.hidden_size, mc.moe.intermediate_size
    dev, bf16 = "cuda", torch.bfloat16
    gen = torch.Generator(device=dev).manual_seed(n)
    layer_bytes = 3 * e * inter * hidden * 2
    # At least two copies, so no replay finds the last one's experts in L2.
    copies = max(2, int(3 * L2_BYTES // layer_bytes) + 1)
    w13s = [torch.randn(e, 2 * inter, hidden, device=dev, dtype=bf16) * 0.02 for _ in range(copies)]
    w2s = [torch.randn(e, hidden, inter, device=dev, dtype=bf16) * 0.02 for _ in range(copies)]
    x = torch.randn(n, hidden, device=dev, generator=gen).to(bf16)
    logits = torch.randn(n, e, device=dev, generator=gen).to(bf16)
    weights, ids = moe_route.route(logits, k, mc.moe.norm_topk_prob)
    used = touched_experts(ids)
    bytes_read = used * 3 * inter * hidden * 2
    flops = 2 * n * k * 3 * inter * hidden
    floor_us = max(bytes_read / HBM_BYTES_PER_S, flops / BF16_FLOPS) * 1e6
    ref = moe.experts_reference(
        x.double(), w13s[0].double(), w2s[0].double(), weights.double(), ids
    )
    scale = ref.abs().max().item()

    def time_config(
        small_pairs: int,
        tiles: moe_triton.GemmTiles | None,
        gemv: moe_triton.GemvTiles = moe_triton.GEMV_TILES,
    ) -> dict[str, Any]:
        def run(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
            return moe_triton.fused_experts(x, a, b, weights, ids, small_pairs, tiles, gemv)

        err = (run(w13s[0], w2s[0]).double() - ref).abs().max().item() / scale
        calls = [lambda a=a, b=b: run(a, b) for a, b in zip(w13s, w2s)]
        calls *= max(1, MIN_CALLS // len(calls))  # the copies in turn, again and again
        return {"us": graph_us(calls, args.reps), "rel_err": err}

    def route_us(tiles: moe_route.RouteTiles | None) -> float:
        # Many launches per replay: one alone would time mostly the replay's
        # own fixed cost (about 10 us), not the kernel.
        calls = [lambda: moe_route.route(logits, k, mc.moe.norm_topk_prob, tiles)] * ROUTE_CALLS
        return graph_us(calls, args.reps)

    row: dict[str, Any] = {
        "tokens": n,
        "experts_touched": used,
        "bytes_read": bytes_read,
        "flops": flops,
        "floor_us": floor_us,
        "route_us": route_us(None),
        "default": time_config(moe_triton.SMALL_PAIRS, None),
    }
    row["default"]["of_floor"] = floor_us / row["default"]["us"]
    if args.sweep:
        sweep = []
        if n * k <= 256 and "gemv" in args.sweep_paths:
            for g in SWEEP_GEMV:
                sweep.append({"path": "gemv", "gemv": g._asdict(), **time_config(n * k, None, g)})
        for bm in (16, 32, 64, 128) if "grouped" in args.sweep_paths else ():
            for bn, bk, warps, stages in SWEEP_TILES:
                t = moe_triton.GemmTiles(bm, bn, bk, warps, stages)
                try:
                    r = time_config(0, t)
                except Exception as exc:  # out of shared memory, say
                    r = {"error": type(exc).__name__}
                sweep.append({"path": "grouped", "tiles": t._asdict(), **r})
        ok = [s for s in sweep if "us" in s]
        row["sweep"] = sweep
        if ok:
            row["sweep_best"] = min(ok, key=lambda s: s["us"])
        row["route_sweep"] = [{**t._asdict(), "us": route_us(t)} for t in SWEEP_ROUTE]
    return row


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m benchmarks.kernels.bench_moe",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--model", default="qwen3-30b-a3b", help="a MoE preset or checkpoint dir")
    p.add_argument("--tokens", type=int, nargs="+", default=[1, 4, 8, 64, 256, 1024, 8192])
    p.add_argument("--sweep", action="store_true", help="also time both paths and a tile grid")
    p.add_argument(
        "--sweep-paths",
        nargs="+",
        choices=["gemv", "grouped"],
        default=["gemv", "grouped"],
        help="paths whose tiles --sweep tries (default: both)",
    )
    p.add_argument("--reps", type=int, default=10, help="timed graph replays per case (default 10)")
    p.add_argument("--output-file", default=None)
    return p


def main(argv: list[str] | None = None) -> None:
    args = build_parser().parse_args(argv)
    if not torch.cuda.is_available():
        raise SystemExit("bench_moe needs a CUDA device")
    mc = ModelConfig.load(args.model, torch.bfloat16)
    if mc.moe is None:
        raise SystemExit(f"{args.model} is not a mixture-of-experts model")
    rows = [bench_tokens(n, args, mc) for n in args.tokens]
    print(
        f"{'tokens':>7} {'experts':>8} {'route us':>9} {'experts us':>11} {'floor us':>9} "
        f"{'of floor':>9} {'rel err':>8}"
    )
    for r in rows:
        d = r["default"]
        print(
            f"{r['tokens']:>7} {r['experts_touched']:>8} {r['route_us']:>9.1f} {d['us']:>11.1f} "
            f"{r['floor_us']:>9.1f} {d['of_floor']:>9.2f} {d['rel_err']:>8.1e}"
            + (
                f"  best {r['sweep_best']['us']:.1f} us "
                f"{r['sweep_best'].get('tiles') or r['sweep_best'].get('gemv')}"
                f"  route {[round(t['us'], 1) for t in r['route_sweep']]}"
                if "sweep_best" in r
                else ""
            )
        )
    write_record(
        "benchmarks.kernels.bench_moe",
        argv,
        {"model": args.model, "rows": rows},
        args.output_file,
        f"moe-{args.model}",
        machine(),
    )


if __name__ == "__main__":
    main()
