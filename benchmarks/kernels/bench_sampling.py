"""Sampling cost per parameter set: the CUDA sampler against the torch one.

For each batch size and parameter set, float32 logits ``[B, vocab]`` (what the
runner's ``compute_logits`` hands the sampler) are sampled ``--iters`` times
back to back after a warm-up, timed with CUDA events (ms per call: the device
time, or the host's launch time where that is longer), and once more under
``torch.profiler`` to count the kernels of one call and sum their device time.
The two samplers' token ids are compared on the same logits (they should be
equal)::

    python -m benchmarks.kernels.bench_sampling --batch-sizes 1 64 256 --vocab 128256
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable
from typing import Any

import torch

from benchmarks.common import machine, write_record
from engine.sampling import SampleOutput, SamplingBatch, sample, sample_torch
from protocol.sampling import SamplingParams

CASES: dict[str, list[SamplingParams]] = {
    "greedy": [SamplingParams(temperature=0.0)],
    "temperature": [SamplingParams(temperature=0.8)],
    "top_k50": [SamplingParams(temperature=0.8, top_k=50)],
    "top_p0.9": [SamplingParams(temperature=0.8, top_p=0.9)],
    "top_k50_top_p0.9": [SamplingParams(temperature=0.8, top_k=50, top_p=0.9)],
    "min_p0.05": [SamplingParams(temperature=0.8, min_p=0.05)],
    # Rows cycle through these: one batch that needs every path at once.
    "mixed": [
        SamplingParams(temperature=0.0),
        SamplingParams(temperature=0.8),
        SamplingParams(temperature=0.8, top_k=50),
        SamplingParams(temperature=0.8, top_p=0.9),
        SamplingParams(temperature=0.7, top_k=40, top_p=0.95),
        SamplingParams(temperature=1.0, min_p=0.05),
    ],
}

Sampler = Callable[[torch.Tensor, SamplingBatch], SampleOutput]


def make_batch(case: str, rows: int, vocab: int, device: torch.device) -> SamplingBatch:
    cycle = CASES[case]
    params = [cycle[i % len(cycle)] for i in range(rows)]
    return SamplingBatch.build(params, list(range(rows)), [7] * rows, vocab, device)


def time_calls(fn: Sampler, logits: torch.Tensor, batch: SamplingBatch, args: Any) -> float:
    """ms per call over ``args.iters`` back-to-back calls, after a warm-up."""
    for _ in range(args.warmup):
        fn(logits, batch)
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(args.iters):
        fn(logits, batch)
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / args.iters


def profile_call(fn: Sampler, logits: torch.Tensor, batch: SamplingBatch) -> dict[str, Any]:
    """Kernels one call launches (copies and fills counted apart) and their device ms."""
    from torch.profiler import ProfilerActivity, profile

    fn(logits, batch)
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        fn(logits, batch)
        torch.cuda.synchronize()
    kernels = copies = 0
    device_us = 0.0
    names: dict[str, int] = {}
    for evt in prof.events():
        if evt.device_type != torch.autograd.DeviceType.CUDA:
            continue
        device_us += evt.device_time
        if evt.name.startswith(("Memcpy", "Memset")):
            copies += 1
        else:
            kernels += 1
            names[evt.name[:60]] = names.get(evt.name[:60], 0) + 1
    return {"kernels": kernels, "copies": copies, "device_ms": device_us / 1000, "names": names}


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(
        prog="python -m benchmarks.kernels.bench_sampling",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    ap.add_argument("--device", default="cuda:0", help="CUDA device (default: %(default)s)")
    ap.add_argument(
        "--batch-sizes", type=int, nargs="+", default=[1, 64, 256], help="rows per call"
    )
    ap.add_argument("--vocab", type=int, default=128256, help="vocabulary (Llama 3: 128256)")
    ap.add_argument(
        "--cases", nargs="+", default=list(CASES), choices=list(CASES), help="parameter sets"
    )
    ap.add_argument(
        "--samplers",
        nargs="+",
        default=["cuda", "torch"],
        choices=["cuda", "torch"],
        help="cuda: engine.sampling.sample on CUDA logits; torch: sample_torch",
    )
    ap.add_argument("--logit-scale", type=float, default=3.0, help="logits are randn * this")
    ap.add_argument("--iters", type=int, default=200, help="timed calls (default: 200)")
    ap.add_argument("--warmup", type=int, default=20, help="untimed calls first (default: 20)")
    ap.add_argument("--no-profile", action="store_true", help="skip the kernel count")
    ap.add_argument("--output-file", default=None, help="JSON record (default: results dir)")
    return ap


def main(argv: list[str] | None = None) -> None:
    args = build_parser().parse_args(argv)
    device = torch.device(args.device)
    torch.cuda.set_device(device)
    samplers: dict[str, Sampler] = {"cuda": sample, "torch": sample_torch}
    gen = torch.Generator(device=device).manual_seed(0)
    rows_out: list[dict[str, Any]] = []
    print(f"{'batch':>6} {'case':>17} {'sampler':>7} {'ms/call':>8} {'kernels':>7} {'dev ms':>7}")
    for b in args.batch_sizes:
        logits = torch.randn(b, args.vocab, device=device, generator=gen) * args.logit_scale
        for case in args.cases:
            batch = make_batch(case, b, args.vocab, device)
            ids: dict[str, torch.Tensor] = {}
            for name in args.samplers:
                fn = samplers[name]
                ids[name] = fn(logits, batch).token_ids.clone()
                ms = time_calls(fn, logits, batch, args)
                row: dict[str, Any] = {"batch_size": b, "case": case, "sampler": name, "ms": ms}
                if not args.no_profile:
                    row.update(profile_call(fn, logits, batch))
                rows_out.append(row)
                print(
                    f"{b:>6} {case:>17} {name:>7} {ms:>8.3f} {row.get('kernels', '-'):>7} "
                    f"{row.get('device_ms', float('nan')):>7.3f}",
                    flush=True,
                )
            if len(ids) == 2:
                same = (ids["cuda"] == ids["torch"]).float().mean().item()
                rows_out.append({"batch_size": b, "case": case, "same_token_fraction": same})
                if same < 1.0:
                    print(f"{b:>6} {case:>17} token ids agree on {same:.1%} of rows")
    write_record(
        "benchmarks.kernels.bench_sampling",
        argv if argv is not None else sys.argv[1:],
        {"shape": vars(args), "rows": rows_out},
        args.output_file,
        "sampling",
        machine(args.device),
    )


if __name__ == "__main__":
    main()
