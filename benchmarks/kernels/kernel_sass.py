"""What a kernel costs the SM, read from its sm_90 binary without a GPU:
registers and spills a thread, shared memory a block, blocks an SM holds, and
(decode attention) the instructions a warp issues per K/V tile of its main
loop, or (``--kernel fp8-products``) how many programs the FP8 few-row
product runs and how many of the GPU's SMs they can keep busy at once, or
(``--kernel fp8-activations``) what the kernels quantizing those products'
inputs issue on their SM.

    python -m benchmarks.kernels.kernel_sass --model llama-3.1-8b --kv-dtype fp8_e4m3 \\
        --batch-sizes 1 64 256 --variants triton-plan-bytes triton-plan-wv triton-ev-b8-w4
    python -m benchmarks.kernels.kernel_sass --kernel fp8-products --batch-sizes 1 16 64
    python -m benchmarks.kernels.kernel_sass --kernel fp8-activations --batch-sizes 1

Each variant is one of ``bench_attention``'s Triton variants (its tiles, or the
engine's own plan, with V widened or read byte-wise) at the batch's split; the kernel is
compiled the way Triton would for that launch on an H100/H200
(``harness.sm90``), by the Triton installed here (the GPU machine's may
differ: the record names it). ``tokens a tile`` is the K/V tile's length, so
``instructions a token`` (loop instructions x warps / tile tokens) compares
tilings. A measurement of time it is not: ``bench_attention`` is, on the GPU.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from benchmarks.common import machine, write_record
from benchmarks.kernels.bench_attention import KV_DTYPES, TRITON, Variant, triton_plan
from benchmarks.kernels.bench_gemv import shapes
from engine.attention.paged_decode import H200_SMS
from engine.model_config import ModelConfig
from engine.presets import PRESETS


def measure(preset: str, kv_dtype: str, batch: int, variant: Variant, workdir: Path) -> dict:
    from engine.attention import paged_decode as pd
    from engine.kvcache.pool import KVPool, KVPoolConfig
    from harness import sm90

    c = ModelConfig.from_dict(PRESETS[preset], dtype=torch.bfloat16)
    d, dtype = c.head_dim, KV_DTYPES[kv_dtype]
    e4m3 = dtype == pd.E4M3
    plan = triton_plan(
        variant, batch, c.num_kv_heads, H200_SMS, e4m3, c.num_heads // c.num_kv_heads
    )
    pool = KVPool(KVPoolConfig(4, 16, c.num_layers, c.num_kv_heads, d, dtype=dtype))
    q = torch.empty(batch, c.num_heads + 2 * c.num_kv_heads, d, dtype=torch.bfloat16)
    out = torch.empty(batch, c.num_heads, d, dtype=torch.bfloat16)
    ints = torch.zeros(batch + 1, dtype=torch.int32)
    real_widens = pd.widens
    pd.widens = lambda device: True  # as on an H100/H200: the launch is caught, not run
    try:
        with sm90.caught_launches() as caught:
            pd.paged_decode(q[:, : c.num_heads], pool.k_layer(0), pool.v_layer(0), ints, ints,
                            ints[:batch], out, d**-0.5, plan)  # fmt: skip
    finally:
        pd.widens = real_widens
    attend = next(launch for launch in caught if launch[0].fn.__name__ == "split_attend")
    compiled = sm90.compile_launch(attend, plan.registers)
    s = sm90.sass(compiled.asm["cubin"], workdir)
    tile_tokens = plan.block_pages * pool.page_size
    return {
        "model": preset,
        "kv_dtype": kv_dtype,
        "batch_size": batch,
        "variant": variant.kernel,
        "plan": plan._asdict(),
        "registers": s.registers,
        "stack_bytes": s.stack,
        "shared_bytes": compiled.metadata.shared,
        "blocks_per_sm": s.blocks_per_sm(plan.warps, compiled.metadata.shared),
        "warps_per_sm": s.blocks_per_sm(plan.warps, compiled.metadata.shared) * plan.warps,
        "tile_tokens": tile_tokens,
        "loop_instructions": s.loop_instructions,
        "instructions_per_token": s.loop_instructions * plan.warps / tile_tokens,
        "loop": dict(s.loop.most_common()),
    }


def measure_fp8(preset: str, rows: int, workdir: Path) -> list[dict]:
    """The FP8 few-row product at each of the model's dense projections, at
    the tiles the engine picks for ``rows`` rows: programs, blocks an SM
    holds, the SMs with a program (the block scheduler spreads them over
    the SMs first; of an H100/H200's 132) and the waves (programs over what
    all SMs hold at once). Up to ``fp8_skinny.DEFERRED_ROWS`` rows also the
    MLP's two kernels: ``gated`` (gate/up with SiLU-and-mul) and
    ``down-def`` (down on the ``Deferred`` rows)."""
    from engine.layers import fp8, fp8_skinny
    from engine.layers.fp8_quant import Deferred, Quantized
    from harness import sm90

    out = []
    # bench_fp8's products: every one-row product but the LM head (bf16);
    # where the MLP is two kernels, its gated gate/up and its deferred down too.
    products = [(name, n, k) for name, (n, k) in shapes(preset).items() if name != "lm_head"]
    if rows <= fp8_skinny.DEFERRED_ROWS and any(p[0] == "down" for p in products):
        products += [("gated", *shapes(preset)["gate_up"]), ("down-def", *shapes(preset)["down"])]
    for name, n, k in products:
        weight = torch.empty(n, k, dtype=fp8.E4M3)
        x = Quantized(torch.empty(rows, k, dtype=fp8.E4M3), torch.empty(rows), torch.bfloat16)
        if name == "down-def":  # a maximum per program of the gated product before it
            gate = fp8_skinny.gated_tiles(k, n)
            parts = k // gate.block_n if gate else 1
            x = Deferred(torch.empty(rows, k, dtype=torch.bfloat16), torch.empty(rows, parts))
        t = fp8_skinny.gated_fits(x, weight) if name == "gated" else fp8_skinny.fits(x, weight)
        if t is None:
            out.append({"model": preset, "rows": rows, "product": name, "n": n, "k": k})
            continue
        with sm90.caught_launches() as caught:
            if name == "gated":
                fp8_skinny.gated(x, weight, torch.empty(n), t)
            else:
                fp8_skinny.run(x, weight, torch.empty(n), None, t)
        compiled = sm90.compile_launch(caught[0])
        s = sm90.sass(compiled.asm["cubin"], workdir)
        programs = (n // (2 if name == "gated" else 1) // t.block_n) * t.split_k
        per_sm = s.blocks_per_sm(t.warps, compiled.metadata.shared)
        out.append({
            "model": preset, "rows": rows, "product": name, "n": n, "k": k,
            "tiles": t._asdict(), "programs": programs, "registers": s.registers,
            "stack_bytes": s.stack, "shared_bytes": compiled.metadata.shared,
            "loop_instructions": s.loop_instructions,
            "blocks_per_sm": per_sm, "sms_busy": min(H200_SMS, programs),
            "waves": programs / (per_sm * H200_SMS),
        })  # fmt: skip
    return out


SCHEDULERS_PER_SM = 4
"""Warp schedulers of an sm_90 SM: each issues one instruction a cycle."""


def measure_fp8_activations(preset: str, rows: int, workdir: Path) -> list[dict]:
    """The kernels that quantize FP8 products' inputs where they are made (the
    residual add and RMSNorm; SiLU-and-mul), at the model's widths: one
    program a row, holding the row in registers. ``issue_cycles`` is what one
    program's warps issue on its SM at one instruction a scheduler a cycle:
    a floor on the kernel's time where the rows are fewer than the SMs."""
    from engine.layers import fp8_quant
    from harness import sm90

    c = ModelConfig.from_dict(PRESETS[preset], dtype=torch.bfloat16)
    hidden, inter = c.hidden_size, c.intermediate_size
    x = torch.empty(rows, hidden, dtype=torch.bfloat16)
    with sm90.caught_launches() as caught:
        fp8_quant.norm_quantize(x, torch.empty_like(x), torch.empty(hidden), 1e-5)
        fp8_quant.silu_mul_quantize(torch.empty(rows, 2 * inter, dtype=torch.bfloat16))
    out = []
    for launch, width in zip(caught, (hidden, inter), strict=True):
        compiled = sm90.compile_launch(launch)
        s = sm90.sass(compiled.asm["cubin"], workdir)
        warps = launch[2]["num_warps"]
        out.append({
            "model": preset, "rows": rows, "kernel": launch[0].fn.__name__, "width": width,
            "warps": warps, "programs": rows, "registers": s.registers, "stack_bytes": s.stack,
            "instructions": s.instructions,
            "issue_cycles": s.instructions * warps / SCHEDULERS_PER_SM,
        })  # fmt: skip
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        prog="python -m benchmarks.kernels.kernel_sass",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument(
        "--kernel",
        default="decode-attention",
        choices=["decode-attention", "fp8-products", "fp8-activations"],
    )
    p.add_argument("--model", default="llama-3.1-8b", choices=sorted(PRESETS))
    p.add_argument("--kv-dtype", default="fp8_e4m3", choices=sorted(KV_DTYPES))
    p.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 64, 256])
    p.add_argument(
        "--variants", nargs="+", default=["triton-plan-bytes", "triton-plan-wv"], choices=TRITON
    )
    p.add_argument("--output-file", default=None, help="JSON record (default: results dir)")
    args = p.parse_args(argv)

    from harness import sm90

    why = sm90.supported()
    if why:
        print(why, file=sys.stderr)
        return 1
    if args.kernel == "fp8-products":
        header = (
            f"{'rows':>4} {'product':<8} {'tiles (n, k, split, warps, stages)':<36} "
            f"{'programs':>8} {'regs':>4} {'shared':>7} {'blocks/SM':>9} {'SMs busy':>8} "
            f"{'waves':>5}"
        )
        return _table(args, argv, header, measure_fp8, _fp8_line, f"fp8-products-{args.model}")
    if args.kernel == "fp8-activations":
        header = (
            f"{'rows':>4} {'kernel':<26} {'width':>6} {'warps':>5} {'regs':>4} {'stack':>5} "
            f"{'instructions':>12} {'issue cycles':>12}"
        )
        return _table(
            args, argv, header, measure_fp8_activations, _activation_line,
            f"fp8-activations-{args.model}",
        )  # fmt: skip
    header = (
        f"{'batch':>5} {'variant':<16} {'tile':>4} {'warps':>5} {'regs':>4} {'stack':>5} "
        f"{'shared':>7} {'warps/SM':>8} {'loop':>5} {'/token':>6}  byte loads, ldmatrix; "
        "page indices: waited, copied ahead"
    )

    def attention(preset: str, batch: int, workdir: Path) -> list[dict]:
        return [
            measure(preset, args.kv_dtype, batch, Variant(name, "auto", "NHD"), workdir)
            for name in args.variants
        ]

    stem = f"{args.model}-{args.kv_dtype}"
    return _table(args, argv, header, attention, _attention_line, stem)


def _table(
    args: argparse.Namespace,
    argv: list[str] | None,
    header: str,
    measure_rows: Callable[[str, int, Path], list[dict]],
    line: Callable[[dict], str],
    stem: str,
) -> int:
    """Measure at each batch size, print a line a result under ``header``,
    and write the record (``kernel-sass-<stem>``)."""
    import triton

    rows: list[dict[str, Any]] = []
    print(header)
    with tempfile.TemporaryDirectory() as tmp:
        for batch in args.batch_sizes:
            for r in measure_rows(args.model, batch, Path(tmp)):
                rows.append(r)
                print(line(r))
    body = {"triton": triton.__version__, "target": "sm_90", "kernel": args.kernel, "results": rows}
    write_record(
        "benchmarks.kernels.kernel_sass",
        argv,
        body,
        args.output_file,
        f"kernel-sass-{stem}",
        machine=machine("cpu"),
    )
    return 0


def _attention_line(r: dict) -> str:
    loop = r["loop"]
    byte_loads = sum(v for k, v in loop.items() if k in ("LDS.U8", "LDS.S8"))
    ldsm = sum(v for k, v in loop.items() if k.startswith("LDSM"))
    # The loop's only plain global loads are the page table's; copied
    # ahead (asynchronously, 4 bytes) where the pipeline gives them a stage
    # of their own, while K and V take 16-byte asynchronous copies.
    waited = loop.get("LDG.E", 0)
    ahead = loop.get("LDGSTS.E", 0)
    return (
        f"{r['batch_size']:>5} {r['variant']:<16} {r['tile_tokens']:>4} {r['plan']['warps']:>5} "
        f"{r['registers']:>4} {r['stack_bytes']:>5} {r['shared_bytes']:>7} "
        f"{r['warps_per_sm']:>8} {r['loop_instructions']:>5} "
        f"{r['instructions_per_token']:>6.1f}  {byte_loads}, {ldsm}; {waited}, {ahead}"
    )


def _fp8_line(r: dict) -> str:
    if "tiles" not in r:
        return f"{r['rows']:>4} {r['product']:<8} (not this kernel's)"
    t = r["tiles"]
    tiles = f"{t['block_n']}, {t['block_k']}, {t['split_k']}, {t['warps']}, {t['stages']}"
    return (
        f"{r['rows']:>4} {r['product']:<8} {tiles:<36} {r['programs']:>8} "
        f"{r['registers']:>4} {r['shared_bytes']:>7} {r['blocks_per_sm']:>9} "
        f"{r['sms_busy']:>8} {r['waves']:>5.2f}"
    )


def _activation_line(r: dict) -> str:
    return (
        f"{r['rows']:>4} {r['kernel']:<26} {r['width']:>6} {r['warps']:>5} "
        f"{r['registers']:>4} {r['stack_bytes']:>5} {r['instructions']:>12} "
        f"{r['issue_cycles']:>12.0f}"
    )


if __name__ == "__main__":
    sys.exit(main())
