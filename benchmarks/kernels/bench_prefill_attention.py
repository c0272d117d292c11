"""Prefill attention of fresh prompts: FlashInfer's paged prefill as the engine
plans and runs it, against the plan-free Triton kernel
(``engine.attention.fresh_prefill``) at its tiles.

For each set of prompt lengths (``--prompts 1024``: one prompt; ``4x256``:
four of 256), ``--layers`` attention calls (one per layer, each over its
own layer's K/V) are captured in a CUDA graph and the replay is timed on
the device; FlashInfer's pages are written first, as the engine's KV write
does. Also reported: the host's time of FlashInfer's ``plan()`` for the
forward (median of ``--reps``), which the Triton kernel does not need, and
the rate in TFLOP/s of the causal products (4 x heads x head_dim per pair of
query and key a prompt holds). Outputs are checked against each other::

    python -m benchmarks.kernels.bench_prefill_attention --prompts 1024 2048 4x256 \\
        --variants flashinfer triton triton-128x32 triton-128x128 triton-64x64
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
import traceback
from typing import Any

import torch

from benchmarks.common import machine, write_record
from benchmarks.kernels.bench_attention import time_graph
from engine.attention.fresh_prefill import FreshTiles, fresh_prefill

TILES = {
    "triton": FreshTiles(),  # the kernel's own tiles
    "triton-128x64": FreshTiles(128, 64, 8, 2),
    "triton-128x64-s3": FreshTiles(128, 64, 8, 3),
    "triton-128x128": FreshTiles(128, 128, 8, 2),
    "triton-128x32": FreshTiles(128, 32, 8, 2),
    "triton-64x64": FreshTiles(64, 64, 4, 2),
    "triton-64x64-s3": FreshTiles(64, 64, 4, 3),
    "triton-64x128": FreshTiles(64, 128, 4, 2),
    "triton-64x32": FreshTiles(64, 32, 4, 2),
    "triton-64x64-w8": FreshTiles(64, 64, 8, 2),
}
VARIANTS = ("flashinfer", *TILES)
DTYPE = torch.bfloat16


def prompt_lengths(spec: str) -> list[int]:
    """``"1024"`` -> [1024]; ``"4x256"`` -> [256, 256, 256, 256]."""
    count, _, length = spec.rpartition("x")
    return [int(length)] * (int(count) if count else 1)


def causal_flops(lengths: list[int], heads: int, head_dim: int) -> int:
    return sum(4 * heads * head_dim * n * (n + 1) // 2 for n in lengths)


class Case:
    """One forward's prompts: the QKV outputs of every layer, their positions,
    and a page table holding each layer's K/V (as the engine's pool)."""

    def __init__(self, lengths: list[int], args: argparse.Namespace, device: torch.device):
        self.lengths, self.n = lengths, sum(lengths)
        h, kv, d, ps = args.num_heads, args.num_kv_heads, args.head_dim, args.page_size
        gen = torch.Generator(device).manual_seed(self.n)
        self.qkv = [
            torch.randn(self.n, h + 2 * kv, d, generator=gen, device=device, dtype=DTYPE)
            for _ in range(args.layers)
        ]
        self.positions = torch.cat([torch.arange(n) for n in lengths]).to(device)
        pages = [-(-n // ps) for n in lengths]
        self.indptr = torch.tensor([0, *torch.tensor(pages).cumsum(0).tolist()], dtype=torch.int32)
        self.last_len = torch.tensor(
            [n - (p - 1) * ps for n, p in zip(lengths, pages, strict=True)], dtype=torch.int32
        )
        total = sum(pages)
        order = torch.randperm(total, generator=torch.Generator().manual_seed(total))
        self.indices = (order + 1).to(torch.int32).to(device)
        # Each row's page and slot, as the engine's KV write finds them.
        prompt = torch.repeat_interleave(torch.arange(len(lengths)), torch.tensor(lengths))
        pos = self.positions.cpu()
        page = self.indices.cpu()[self.indptr[prompt].long() + pos // ps].long().to(device)
        slot = (pos % ps).to(device)
        self.kv = torch.zeros(args.layers, 2, total + 1, ps, kv, d, dtype=DTYPE, device=device)
        for layer, qkv in enumerate(self.qkv):
            self.kv[layer, 0, page, slot] = qkv[:, h : h + kv]
            self.kv[layer, 1, page, slot] = qkv[:, h + kv :]
        self.out = torch.empty(self.n, h, d, dtype=DTYPE, device=device)

    def split(self, layer: int, heads: int, kv_heads: int) -> tuple[torch.Tensor, ...]:
        qkv = self.qkv[layer]
        return qkv[:, :heads], qkv[:, heads : heads + kv_heads], qkv[:, heads + kv_heads :]


def flashinfer_step(case: Case, args: argparse.Namespace, plans: list[float]) -> Any:
    """FlashInfer's paged prefill as ``engine.attention.flashinfer`` plans it
    (pinned host page table, device indices); the plan's host time is
    appended to ``plans`` each time it is made."""
    import flashinfer

    device = case.out.device
    workspace = torch.zeros(256 << 20, dtype=torch.uint8, device=device)
    wrapper = flashinfer.BatchPrefillWithPagedKVCacheWrapper(workspace, "NHD")
    qo = torch.tensor([0, *torch.tensor(case.lengths).cumsum(0).tolist()], dtype=torch.int32)
    seq_lens = torch.tensor(case.lengths, dtype=torch.int32)

    def plan() -> None:
        torch.cuda.synchronize(device)
        t0 = time.perf_counter()
        wrapper.plan(
            qo.pin_memory(), case.indptr.pin_memory(), case.indices, case.last_len.pin_memory(),
            args.num_heads, args.num_kv_heads, args.head_dim, args.page_size, causal=True,
            q_data_type=DTYPE, kv_data_type=DTYPE, sm_scale=args.head_dim**-0.5,
            seq_lens=seq_lens.pin_memory(),
        )  # fmt: skip
        plans.append((time.perf_counter() - t0) * 1e3)

    for _ in range(args.reps):
        plan()

    def step() -> None:
        for layer in range(args.layers):
            q = case.split(layer, args.num_heads, args.num_kv_heads)[0]
            wrapper.run(q, (case.kv[layer, 0], case.kv[layer, 1]), out=case.out)

    return step


def triton_step(case: Case, args: argparse.Namespace, t: FreshTiles | None) -> Any:
    def step() -> None:
        for layer in range(args.layers):
            q, k, v = case.split(layer, args.num_heads, args.num_kv_heads)
            fresh_prefill(q, k, v, case.positions, case.out, args.head_dim**-0.5, fresh_tiles=t)

    return step


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--device", default="cuda:0")
    p.add_argument("--prompts", nargs="+", default=["1024", "2048", "4x256"])
    p.add_argument("--variants", nargs="+", default=list(VARIANTS), choices=VARIANTS)
    p.add_argument("--layers", type=int, default=32, help="calls per step (default: 32)")
    p.add_argument("--num-heads", type=int, default=32)
    p.add_argument("--num-kv-heads", type=int, default=8)
    p.add_argument("--head-dim", type=int, default=128)
    p.add_argument("--page-size", type=int, default=16)
    p.add_argument("--reps", type=int, default=20, help="timed replays (default: 20)")
    p.add_argument("--output-file", default=None, help="JSON record (default: results dir)")
    return p


def main(argv: list[str] | None = None) -> None:
    args = build_parser().parse_args(argv)
    device = torch.device(args.device)
    torch.cuda.set_device(device)
    rows = []
    print(f"{'prompts':>8} {'variant':>18} {'ms':>8} {'TFLOP/s':>8} {'plan ms':>8} {'max diff':>9}")
    for spec in args.prompts:
        case = Case(prompt_lengths(spec), args, device)
        flops = causal_flops(case.lengths, args.num_heads, args.head_dim) * args.layers
        reference: torch.Tensor | None = None
        for variant in args.variants:
            row: dict[str, Any] = {"prompts": spec, "variant": variant}
            plans: list[float] = []
            try:
                if variant == "flashinfer":
                    step = flashinfer_step(case, args, plans)
                else:
                    t = TILES[variant]
                    row["tiles"] = t._asdict()
                    step = triton_step(case, args, t)
                ms = time_graph(step, args.reps, device)[0]
            except Exception as e:  # a variant the build lacks: say so, go on
                traceback.print_exc()
                row["error"] = f"{type(e).__name__}: {e}"
                print(f"{spec:>8} {variant:>18} failed: {row['error'][:80]}")
                rows.append(row)
                continue
            out = case.out.float()  # the last layer's attention
            reference = out.clone() if reference is None else reference
            row.update(ms=ms, tflop_s=flops / (ms * 1e-3) / 1e12)
            row["max_abs_diff"] = (out - reference).abs().max().item()
            if plans:
                row["plan_host_ms"] = statistics.median(plans)
            plan = f"{row['plan_host_ms']:>8.3f}" if plans else f"{'':>8}"
            print(
                f"{spec:>8} {variant:>18} {ms:>8.3f} {row['tflop_s']:>8.1f} {plan} "
                f"{row['max_abs_diff']:>9.2e}"
            )
            rows.append(row)
            sys.stdout.flush()
    write_record(
        "benchmarks.kernels.bench_prefill_attention",
        argv if argv is not None else sys.argv[1:],
        {"shape": vars(args), "rows": rows},
        args.output_file,
        "attention-prefill",
        machine(args.device),
    )


if __name__ == "__main__":
    main()
