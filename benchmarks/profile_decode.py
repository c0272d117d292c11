"""Where a decode step's time goes: kernels per step, GPU time per kind of
kernel, CUDA-graph replay time, sampling time and host time.

    python benchmarks/profile_decode.py --model llama-3.1-8b --device cuda:0 \
        --batch-sizes 1 64 256 --context-len 1024 --cuda-graph-max-bs 256

For each batch size (every request at ``--context-len`` tokens of random KV):
- eager forward under torch.profiler: CUDA kernels launched and their GPU time
  by category (gemm, attention, norm/rope/act/kv-append, other);
- the step as the runner runs it (CUDA graph when the size is captured):
  GPU time of the forward and of sampling (CUDA events), host time to queue the
  step (build the batch, plan, launch) and the step's wall time with a sync;
- the engine's overlap loop with that many decoding requests: wall time per
  step and the fraction of it the device was busy.

Writes a JSON record to ``--output-file`` (default ``benchmarks/results/``).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from collections import defaultdict
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.common import git_commit, host_info  # noqa: E402
from engine.config import EngineConfig  # noqa: E402
from engine.engine import Engine  # noqa: E402
from engine.forward_batch import ExtendSpec, build_forward_batch  # noqa: E402
from engine.runner import ModelRunner  # noqa: E402
from engine.sampling import SamplingBatch, sample  # noqa: E402
from protocol.sampling import SamplingParams  # noqa: E402

CATEGORIES = {
    "gemm": ("gemm", "gemv", "nvjet", "cutlass", "sm90_xmma", "cublas", "splitk"),
    "attention": ("batchdecode", "batchprefill", "attention", "mergestate", "variablelength"),
    "norm/rope/act/kv": ("norm", "rope", "rotary", "silu", "act_and_mul", "append", "paged_kv"),
}
"""Category -> lower-case fragments of kernel names; anything else is "other"."""


def category(kernel: str) -> str:
    name = kernel.lower()
    for cat, fragments in CATEGORIES.items():
        if any(f in name for f in fragments):
            return cat
    return "other"


def decode_batch(runner: ModelRunner, batch_size: int, context_len: int) -> tuple[Any, list]:
    ps = runner.pool.page_size
    tables = []
    for _ in range(batch_size):
        pages = runner.pool.allocator.alloc(-(-(context_len + 1) // ps))
        if pages is None:
            raise SystemExit(
                f"KV pool too small for batch {batch_size}; raise --kv-cache-memory-gb"
            )
        tables.append(pages)
    vocab = runner.model_config.vocab_size
    specs = [ExtendSpec([(7 * i + 3) % vocab], context_len, t) for i, t in enumerate(tables)]
    return specs, tables


def profile_eager(runner: ModelRunner, specs: list) -> dict[str, Any]:
    """Kernels and GPU time by category of one eager forward (no CUDA graph)."""
    from torch.profiler import ProfilerActivity, profile

    def eager() -> torch.Tensor:
        batch = build_forward_batch(specs, runner.pool.page_size, runner.device)
        runner.attn.begin_forward(batch)
        hidden = runner.model(batch.input_ids, batch.positions, runner.attn)
        return runner.model.compute_logits(hidden[batch.logits_indices])

    with torch.inference_mode():
        eager()
        torch.cuda.synchronize(runner.device)
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            eager()
            torch.cuda.synchronize(runner.device)
    by_cat: dict[str, float] = defaultdict(float)
    kernels = 0
    for e in prof.events():
        if e.device_type != torch.autograd.DeviceType.CUDA:
            continue
        name = e.name.lower()
        if name.startswith(("memcpy", "memset")):
            continue
        kernels += 1
        by_cat[category(e.name)] += e.device_time_total / 1e3
    return {"kernels": kernels, "gpu_ms_by_category": dict(by_cat)}


def time_steps(runner: ModelRunner, specs: list, steps: int) -> dict[str, float]:
    """The step as the engine runs it: forward (graph if captured) then sampling."""
    vocab = runner.model_config.vocab_size
    params = [
        SamplingParams(temperature=0.8, top_k=50, top_p=0.9, seed=i) for i in range(len(specs))
    ]
    fwd_ms, sample_ms, host_ms, wall_ms = [], [], [], []
    dev = runner.device
    with torch.inference_mode():
        for step in range(steps + 3):
            torch.cuda.synchronize(dev)
            e0, e1, e2 = (torch.cuda.Event(enable_timing=True) for _ in range(3))
            t0 = time.perf_counter()
            batch = build_forward_batch(specs, runner.pool.page_size, dev)
            sampling = SamplingBatch.build(
                params, list(range(len(specs))), [step] * len(specs), vocab, dev
            )
            e0.record()
            logits = runner.forward_logits(batch)
            e1.record()
            out = sample(logits, sampling)
            e2.record()
            t1 = time.perf_counter()
            out.token_ids.tolist()
            t2 = time.perf_counter()
            if step >= 3:
                fwd_ms.append(e0.elapsed_time(e1))
                sample_ms.append(e1.elapsed_time(e2))
                host_ms.append((t1 - t0) * 1e3)
                wall_ms.append((t2 - t0) * 1e3)
    med = statistics.median
    return {
        "forward_gpu_ms": med(fwd_ms),
        "sampling_gpu_ms": med(sample_ms),
        "host_enqueue_ms": med(host_ms),
        "step_wall_ms": med(wall_ms),
    }


SAMPLING_CASES = {
    "greedy": SamplingParams(temperature=0.0),
    "temperature": SamplingParams(temperature=0.8),
    "top_p": SamplingParams(temperature=0.8, top_p=0.9),
    "top_k_top_p": SamplingParams(temperature=0.8, top_k=50, top_p=0.9),
    "flat_top_p": SamplingParams(temperature=3.0, top_p=0.95),
}
"""Sampling parameter sets timed on their own (every row of the batch alike)."""


def time_sampling(runner: ModelRunner, batch_size: int, reps: int = 20) -> dict[str, float]:
    """GPU ms of ``sample`` on logits shaped like the model's, per parameter set."""
    vocab = runner.model_config.vocab_size
    dev = runner.device
    gen = torch.Generator(device=dev).manual_seed(batch_size)
    # Peaked like a language model's: a few large logits over a long tail.
    logits = torch.randn(batch_size, vocab, device=dev, generator=gen) * 3.0
    out: dict[str, float] = {}
    for name, p in SAMPLING_CASES.items():
        times = []
        for step in range(reps + 3):
            sampling = SamplingBatch.build(
                [p] * batch_size, list(range(batch_size)), [step] * batch_size, vocab, dev
            )
            torch.cuda.synchronize(dev)
            e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            # Keep the device busy while the host queues the sampling kernels, so
            # the events time the device's work, not the host's launches.
            torch.cuda._sleep(5_000_000)
            e0.record()
            sample(logits, sampling)
            e1.record()
            torch.cuda.synchronize(dev)
            if step >= 3:
                times.append(e0.elapsed_time(e1))
        out[name] = statistics.median(times)
    return out


def serving_loop(engine: Engine, batch_size: int, context_len: int, steps: int) -> dict[str, float]:
    """The engine's own overlap loop on ``batch_size`` decoding requests: wall
    time per step and the fraction of it the device was busy (kernels running)."""
    from torch.profiler import ProfilerActivity, profile

    vocab = engine.model_config.vocab_size
    gen = torch.Generator().manual_seed(batch_size)
    warm = 8
    # Long enough that no request finishes before the timed steps end (the first
    # ones decode while the last ones are still prefilling); aborted after.
    max_tokens = engine.context_length - context_len - 1
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    rids = [f"loop-{batch_size}-{i}" for i in range(batch_size)]
    for rid in rids:
        prompt = torch.randint(3, vocab, (context_len,), generator=gen).tolist()
        engine.add_request(rid, prompt, params)
    produced: dict[str, int] = defaultdict(int)
    inflight = None
    # Until every request is past its prefill and a few decode steps.
    while min((produced[rid] for rid in rids), default=0) < warm:
        inflight, results = engine.overlap_step(inflight)
        for r in results:
            produced[r.rid] += 1
    dev = engine.runner.device
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        t0 = time.perf_counter()
        for _ in range(steps):
            inflight, _ = engine.overlap_step(inflight)
        wall = time.perf_counter() - t0
        torch.cuda.synchronize(dev)
    if inflight is not None:
        engine.finish(inflight)
    for rid in rids:
        engine.abort(rid)
    spans = sorted(
        (e.time_range.start, e.time_range.end)
        for e in prof.events()
        if e.device_type == torch.autograd.DeviceType.CUDA
    )
    busy, cur_start, cur_end = 0.0, None, None
    for start, end in spans:
        if cur_end is None or start > cur_end:
            if cur_end is not None:
                busy += cur_end - cur_start
            cur_start, cur_end = start, end
        else:
            cur_end = max(cur_end, end)
    if cur_end is not None:
        busy += cur_end - cur_start
    window = (spans[-1][1] - spans[0][0]) if spans else 0.0
    return {
        "loop_step_ms": wall / steps * 1e3,
        "loop_gpu_busy_fraction": busy / window if window else 0.0,
    }


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument(
        "--model",
        default="llama-3.1-8b",
        help="preset (dummy weights) or checkpoint dir (default: %(default)s)",
    )
    ap.add_argument("--device", default="cuda:0", help="CUDA device (default: %(default)s)")
    ap.add_argument("--dtype", default="bfloat16", help="model dtype (default: %(default)s)")
    ap.add_argument(
        "--batch-sizes",
        type=int,
        nargs="+",
        default=[1, 64],
        help="decode batch sizes (default: 1 64)",
    )
    ap.add_argument(
        "--context-len",
        type=int,
        default=1024,
        help="KV length of every request (default: %(default)s)",
    )
    ap.add_argument(
        "--steps", type=int, default=20, help="timed steps per batch size (default: %(default)s)"
    )
    ap.add_argument(
        "--page-size", type=int, default=16, help="tokens per KV page (default: %(default)s)"
    )
    ap.add_argument(
        "--kv-cache-memory-gb", type=float, default=40.0, help="KV pool (default: %(default)s)"
    )
    ap.add_argument(
        "--cuda-graph-max-bs",
        type=int,
        default=None,
        help="largest graph-captured batch (default: engine's auto)",
    )
    ap.add_argument(
        "--max-running-requests",
        type=int,
        default=256,
        help="engine setting (bounds auto graph sizes; default: %(default)s)",
    )
    ap.add_argument(
        "--attention-backend",
        default="auto",
        help="auto, flashinfer or torch_native (default: %(default)s)",
    )
    ap.add_argument(
        "--output-file",
        default=None,
        help="JSON record (default: benchmarks/results/profile-decode-...json)",
    )
    return ap


def main(argv: list[str] | None = None) -> None:
    args = build_parser().parse_args(argv)
    load_format = "auto" if Path(args.model).exists() else "dummy"
    cfg = EngineConfig(
        model=args.model,
        load_format=load_format,
        dtype=args.dtype,
        device=args.device,
        page_size=args.page_size,
        kv_cache_memory_gb=args.kv_cache_memory_gb,
        cuda_graph_max_bs=args.cuda_graph_max_bs,
        max_running_requests=args.max_running_requests,
        attention_backend=args.attention_backend,
    )
    engine = Engine(cfg)
    cfg, runner = engine.config, engine.runner
    # Random KV: timing on zeros can flatter the kernels.
    runner.pool.kv.normal_()
    rows = []
    for b in args.batch_sizes:
        specs, tables = decode_batch(runner, b, args.context_len)
        row = {"batch_size": b, "context_len": args.context_len}
        row.update(profile_eager(runner, specs))
        row.update(time_steps(runner, specs, args.steps))
        row["sampling_ms_by_params"] = time_sampling(runner, b)
        for t in tables:
            runner.pool.allocator.free(t)
        row.update(serving_loop(engine, b, args.context_len, args.steps))
        row["graph"] = runner.graphs is not None and runner.graphs.can_run(
            build_forward_batch(specs, runner.pool.page_size, runner.device)
        )
        rows.append(row)
        print(f"batch {b}: sampling ms by params {row['sampling_ms_by_params']}")
    print(
        f"model={args.model} attention={cfg.attention_backend} graphs<= {cfg.cuda_graph_max_bs} "
        f"context={args.context_len}"
    )
    cats = list(CATEGORIES) + ["other"]
    head = f"{'batch':>5} {'kernels':>7} " + " ".join(f"{c:>16}" for c in cats)
    head += f" {'fwd GPU ms':>10} {'sample ms':>9} {'host ms':>8} {'wall ms':>8} graph"
    head += f" {'loop ms':>8} {'GPU busy':>8}"
    print(head)
    for r in rows:
        cat_ms = " ".join(f"{r['gpu_ms_by_category'].get(c, 0.0):>16.3f}" for c in cats)
        print(
            f"{r['batch_size']:>5} {r['kernels']:>7} {cat_ms} {r['forward_gpu_ms']:>10.3f} "
            f"{r['sampling_gpu_ms']:>9.3f} {r['host_enqueue_ms']:>8.3f} {r['step_wall_ms']:>8.3f} "
            f"{r['graph']!s:>5} {r['loop_step_ms']:>8.3f} {r['loop_gpu_busy_fraction']:>8.1%}"
        )
    now = datetime.now(UTC)
    record = {
        "benchmark": "profile_decode",
        "date": now.isoformat(timespec="seconds"),
        "command": " ".join(["profile_decode.py", *(argv if argv is not None else sys.argv[1:])]),
        "git_commit": git_commit(),
        "machine": {
            **host_info(),
            "torch": torch.__version__,
            "gpu": torch.cuda.get_device_name(runner.device),
        },
        "model": args.model,
        "attention_backend": cfg.attention_backend,
        "cuda_graph_max_bs": cfg.cuda_graph_max_bs,
        "results": rows,
    }
    out = args.output_file or str(
        Path(__file__).parent
        / "results"
        / f"profile-decode-{Path(args.model).name}-{now:%Y%m%d-%H%M%S}.json"
    )
    Path(out).parent.mkdir(parents=True, exist_ok=True)
    Path(out).write_text(json.dumps(record, indent=2) + "\n")
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
