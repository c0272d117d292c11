"""Where the engine's overlap loop loses the device: host profile, GPU gaps and
the graph replay on its own.

For each batch size, ``b`` greedy requests with ``--context-len``-token prompts
are prefilled, then the engine's own overlap loop (``Engine.overlap_step``)
runs decode steps and the script reports:

- the loop's wall time per step;
- from a torch.profiler trace of a few steps: the fraction of the time the
  device was busy, the idle gaps per step and the largest gaps with the
  kernels on either side (what the device waited for);
- the graph replay alone, timed on the device with the host far ahead of it
  (no host time in it), its kernel count and its heaviest kernels;
- a cProfile of the host side of the loop (``--trace-dir``: text files, and
  chrome traces of the first two batch sizes).

    python benchmarks/profile_loop.py --model llama-3.1-8b --device cuda:0 \\
        --batch-sizes 1 64 256 --context-len 1024
"""

from __future__ import annotations

import argparse
import cProfile
import io
import json
import pstats
import statistics
import sys
import time
from collections import defaultdict
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.common import host_info, write_record  # noqa: E402
from engine.config import EngineConfig  # noqa: E402
from engine.engine import Engine, InFlight  # noqa: E402
from protocol.sampling import SamplingParams  # noqa: E402

CUDA = torch.autograd.DeviceType.CUDA


def run_steps(engine: Engine, inflight: InFlight | None, n: int) -> InFlight | None:
    for _ in range(n):
        inflight, _ = engine.overlap_step(inflight)
    return inflight


def gaps_of(prof: Any, steps: int) -> dict[str, Any]:
    """Busy fraction and idle gaps (µs, with neighbouring kernels) of a trace."""
    kernels = sorted(
        (e.time_range.start, e.time_range.end, e.name)
        for e in prof.events()
        if e.device_type == CUDA
    )
    gaps: list[tuple[float, str, str]] = []
    busy = 0.0
    cur_start, cur_end, prev = kernels[0]
    for start, end, name in kernels[1:]:
        if start > cur_end:
            busy += cur_end - cur_start
            gaps.append((start - cur_end, prev[:60], name[:60]))
            cur_start = start
        cur_end = max(cur_end, end)
        prev = name
    busy += cur_end - cur_start
    window = kernels[-1][1] - kernels[0][0]
    gaps.sort(reverse=True)
    return {
        "trace_busy_frac": busy / window,
        "trace_window_ms_per_step": window / steps / 1e3,
        "gap_sum_ms_per_step": sum(g[0] for g in gaps) / steps / 1e3,
        "num_gaps_gt10us": sum(1 for g in gaps if g[0] > 10),
        "top_gaps": [g for g in gaps if g[0] > 10][:15],
    }


def replay_alone(engine: Engine, batch_size: int) -> dict[str, Any]:
    """GPU time of one graph replay of the size that serves ``batch_size``."""
    from torch.profiler import ProfilerActivity, profile

    graphs = engine.runner.graphs
    assert graphs is not None, "needs CUDA graphs"
    size = next(s for s in graphs.sizes if s >= batch_size)
    graph = graphs.graphs[(size, 0)]
    times = []
    for i in range(20):
        torch.cuda.synchronize()
        torch.cuda._sleep(3_000_000)  # the host gets far ahead: no host time below
        e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        e0.record()
        graph.replay()
        e1.record()
        torch.cuda.synchronize()
        if i >= 3:
            times.append(e0.elapsed_time(e1))
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        graph.replay()
        torch.cuda.synchronize()
    by_name: dict[str, list[float]] = defaultdict(lambda: [0, 0.0])
    spans = []
    for e in prof.events():
        if e.device_type == CUDA:
            by_name[e.name[:90]][0] += 1
            by_name[e.name[:90]][1] += e.device_time_total / 1e3
            spans.append((e.time_range.start, e.time_range.end))
    spans.sort()
    return {
        "replay_gpu_ms": statistics.median(times),
        "replay_graph_size": size,
        "replay_kernels": len(spans),
        "replay_kernel_sum_ms": sum(e - s for s, e in spans) / 1e3,
        "replay_span_ms": (spans[-1][1] - spans[0][0]) / 1e3,
        "replay_top_kernels": sorted(by_name.items(), key=lambda kv: -kv[1][1])[:25],
    }


def profile_batch(engine: Engine, b: int, args: argparse.Namespace) -> dict[str, Any]:
    from torch.profiler import ProfilerActivity, profile

    vocab = engine.model_config.vocab_size
    gen = torch.Generator().manual_seed(b)
    params = SamplingParams(
        temperature=0.0, max_tokens=engine.context_length - args.context_len - 1, ignore_eos=True
    )
    rids = [f"loop-{b}-{i}" for i in range(b)]
    for rid in rids:
        prompt = torch.randint(3, vocab, (args.context_len,), generator=gen).tolist()
        engine.add_request(rid, prompt, params)
    produced: dict[str, int] = defaultdict(int)
    inflight = None
    while min((produced[r] for r in rids), default=0) < 8:
        inflight, results = engine.overlap_step(inflight)
        for r in results:
            produced[r.rid] += 1
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    inflight = run_steps(engine, inflight, args.steps)
    torch.cuda.synchronize()
    row: dict[str, Any] = {"loop_wall_ms": (time.perf_counter() - t0) / args.steps * 1e3}
    host = cProfile.Profile()
    host.enable()
    inflight = run_steps(engine, inflight, args.steps)
    host.disable()
    trace_steps = 6
    with profile(activities=[ProfilerActivity.CUDA, ProfilerActivity.CPU]) as prof:
        inflight = run_steps(engine, inflight, trace_steps)
        torch.cuda.synchronize()
    if args.trace_dir:
        out = Path(args.trace_dir)
        out.mkdir(parents=True, exist_ok=True)
        text = io.StringIO()
        pstats.Stats(host, stream=text).sort_stats("tottime").print_stats(30)
        pstats.Stats(host, stream=text).sort_stats("cumulative").print_stats(45)
        (out / f"cprofile-b{b}.txt").write_text(text.getvalue())
        if b in args.batch_sizes[:2]:
            prof.export_chrome_trace(str(out / f"trace-b{b}.json"))
    row.update(gaps_of(prof, trace_steps))
    row.update(replay_alone(engine, b))
    if inflight is not None:
        engine.finish(inflight)
    for rid in rids:
        engine.abort(rid)
    return row


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--model", default="llama-3.1-8b", help="checkpoint dir or preset")
    ap.add_argument("--device", default="cuda:0", help="CUDA device (default: %(default)s)")
    ap.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 64, 256])
    ap.add_argument("--context-len", type=int, default=1024, help="prompt tokens per request")
    ap.add_argument("--steps", type=int, default=50, help="timed and host-profiled steps")
    ap.add_argument("--kv-cache-memory-gb", type=float, default=60.0)
    ap.add_argument("--cuda-graph-max-bs", type=int, default=256)
    ap.add_argument("--page-size", type=int, default=16, help="KV page size (default: 16)")
    ap.add_argument("--trace-dir", default=None, help="write host profiles and chrome traces")
    ap.add_argument("--output-file", default=None, help="JSON record (default: results dir)")
    return ap


def main(argv: list[str] | None = None) -> None:
    args = build_parser().parse_args(argv)
    load_format = "auto" if Path(args.model).exists() else "dummy"
    engine = Engine(
        EngineConfig(
            model=args.model,
            load_format=load_format,
            device=args.device,
            kv_cache_memory_gb=args.kv_cache_memory_gb,
            cuda_graph_max_bs=args.cuda_graph_max_bs,
            page_size=args.page_size,
            max_running_requests=max(256, *args.batch_sizes),
        )
    )
    engine.runner.pool.kv.normal_()  # timing on zeros can flatter the kernels
    results = {}
    for b in args.batch_sizes:
        row = profile_batch(engine, b, args)
        results[b] = row
        brief = {k: v for k, v in row.items() if k not in ("top_gaps", "replay_top_kernels")}
        print(b, json.dumps(brief), flush=True)
    write_record(
        "profile_loop",
        argv if argv is not None else sys.argv[1:],
        {"model": args.model, "results": results},
        args.output_file,
        f"profile-loop-{Path(args.model).name}",
        machine={**host_info(), "torch": torch.__version__, "gpu": torch.cuda.get_device_name()},
    )


if __name__ == "__main__":
    main()
