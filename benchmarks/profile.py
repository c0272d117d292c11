"""Where the engine's decode and prefill time goes on CUDA, three ways:

    python -m benchmarks.profile step --model llama-3.1-8b --device cuda:0 \\
        --batch-sizes 1 64 256 --context-len 1024 --cuda-graph-max-bs 256
    python -m benchmarks.profile loop --model llama-3.1-8b --device cuda:0 \\
        --batch-sizes 1 64 256 --context-len 1024

``step``: one decode step taken apart, for each batch size (every request at
``--context-len`` tokens of random KV):

- an eager forward under torch.profiler: the CUDA kernels launched and their
  GPU time by category (gemm, attention, norm/rope/act/kv-append, other);
- the step as the runner runs it (a CUDA graph when the size is captured):
  GPU time of the forward and of sampling (CUDA events), the host's time to
  queue the step (build the batch, plan, launch) and the step's wall time with
  a sync;
- sampling alone, GPU ms per set of sampling parameters.

``loop``: the engine's own overlap loop (``Engine.overlap_step``) with ``b``
greedy requests of ``--context-len``-token prompts, once they all decode:

- the loop's wall time per step;
- from a torch.profiler trace of a few steps: the fraction of the time the
  device was busy, the idle gaps per step and the largest gaps with the
  kernels on either side (what the device waited for);
- the graph replay alone, timed on the device with the host far ahead of it
  (no host time in it), its kernel count and its heaviest kernels;
- a cProfile of the host side of the loop (``--trace-dir``: text files, and
  chrome traces of the first two batch sizes).

``prefill``: one forward of a single ``--prompt-lens`` prompt, for each length
(with ``--decode-rows``, beside that many decoding rows, as a serving loop's
steps are while streams decode): its kernels and their GPU time by category
(as ``step``; and the kernels of the forward as the engine runs it, from its
graphs where captured), the device's
elapsed time over the forward and the share of it spent in kernels (below
100%: the device waited for the host), timed as ``step`` times a step (the
last token sampled) the host's time to queue it and the wall time, one such
step traced (the device's idle gaps and the kernels on either side, as
``loop``), and the host's hotspots (cProfile: the functions with the most
time of their own)::

    python -m benchmarks.profile prefill --model llama-3.1-8b --prompt-lens 1024 8192 \\
        [--quantization fp8]

``--model`` is a preset (dummy weights) or a checkpoint directory. Each writes
a JSON record to ``--output-file`` (default: ``benchmarks/results/``).
"""

from __future__ import annotations

import argparse
import cProfile
import io
import json
import pstats
import statistics
import time
from collections import defaultdict
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch

from benchmarks.common import KERNEL_SETTINGS, add_engine_flag, machine, write_record
from engine.config import EngineConfig
from engine.engine import Engine, InFlight
from engine.forward_batch import ExtendSpec, build_forward_batch
from engine.runner import ModelRunner
from engine.sampling import SamplingBatch, sample
from protocol.sampling import SamplingParams

TOOL = "benchmarks.profile"
CUDA = torch.autograd.DeviceType.CUDA
CATEGORIES = {
    "moe": (
        "route_kernel",
        "align_kernel",
        "grouped_gate_up",
        "grouped_down",
        "gemv_gate_up",
        "gemv_down",
    ),
    # Before "gemm": FlashInfer's sm_90 prefill kernel names its cutlass types.
    "attention": (
        "batchdecode",
        "batchprefill",
        "prefillwithkvcache",
        "attention",
        "mergestate",
        "variablelength",
        "split_attend",
        "merge",
    ),
    "gemm": (
        "gemm",
        "gemv",
        "nvjet",
        "cutlass",
        "sm90_xmma",
        "cublas",
        "splitk",
        "skinny",
        "fp8_rows",
    ),
    "fp8 quant": ("quantize_rows",),
    "norm/rope/act/kv": ("norm", "rope", "rotary", "silu", "act_and_mul", "append", "paged_kv"),
}
"""Category -> lower-case fragments of kernel names, tried in this order;
anything else is "other"."""
TOP_KERNELS = 25
"""Kernels by GPU time kept in a record (the categories' detail)."""
SAMPLING_CASES = {
    "greedy": SamplingParams(temperature=0.0),
    "temperature": SamplingParams(temperature=0.8),
    "top_p": SamplingParams(temperature=0.8, top_p=0.9),
    "top_k_top_p": SamplingParams(temperature=0.8, top_k=50, top_p=0.9),
    "flat_top_p": SamplingParams(temperature=3.0, top_p=0.95),
}
"""Sampling parameter sets timed on their own (every row of the batch alike)."""


def category(kernel: str) -> str:
    name = kernel.lower()
    for cat, fragments in CATEGORIES.items():
        if any(f in name for f in fragments):
            return cat
    return "other"


def make_engine(args: argparse.Namespace) -> Engine:
    engine = Engine(
        EngineConfig(
            model=args.model,
            load_format="auto" if Path(args.model).exists() else "dummy",
            device=args.device,
            page_size=args.page_size,
            kv_cache_memory_gb=args.kv_cache_memory_gb,
            cuda_graph_max_bs=args.cuda_graph_max_bs,
            max_running_requests=args.max_running_requests
            or max(256, *getattr(args, "batch_sizes", [1])),
            **{name: getattr(args, name) for name in KERNEL_SETTINGS},
            **({"dtype": args.dtype} if args.dtype else {}),
            **({"attention_backend": args.attention_backend} if args.attention_backend else {}),
        )
    )
    fill_normal(engine.runner.pool.kv)  # timing on zeros can flatter the kernels
    return engine


def fill_normal(kv: torch.Tensor) -> None:
    """Standard normal values in the KV pool, a slice at a time (an e4m3 pool
    has no ``normal_``: each slice is drawn in float16 and copied)."""
    if kv.dtype.itemsize > 1:
        kv.normal_()
        return
    for part in kv.view(-1).split(1 << 28):
        part.copy_(torch.randn(part.shape, dtype=torch.float16, device=part.device))


# -- step: one decode step taken apart --------------------------------------------------


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


def profile_eager(runner: ModelRunner, specs: list, as_run: bool = False) -> dict[str, Any]:
    """Kernels and GPU time by category of one eager forward (no CUDA graph);
    ``as_run``: of the forward as the engine runs it (``forward_logits``:
    the graphs where captured, whose kernels the trace lists one by one)."""
    from torch.profiler import ProfilerActivity, profile

    def forward() -> torch.Tensor:
        batch = build_forward_batch(specs, runner.pool.page_size, runner.device)
        if as_run:
            return runner.forward_logits(batch)
        runner.attn.begin_forward(batch)
        hidden = runner.model(batch.input_ids, batch.positions, runner.attn)
        return runner.model.compute_logits(hidden[batch.logits_indices])

    with torch.inference_mode():
        forward()
        torch.cuda.synchronize(runner.device)
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            forward()
            torch.cuda.synchronize(runner.device)
    by_cat: dict[str, float] = defaultdict(float)
    by_name: dict[tuple[str, str], list] = defaultdict(lambda: [0, 0.0])
    kernels = 0
    for e in prof.events():
        if e.device_type != CUDA:
            continue
        name = e.name.lower()
        if name.startswith(("memcpy", "memset")):
            continue
        kernels += 1
        ms = e.device_time_total / 1e3
        cat = category(e.name)
        by_cat[cat] += ms
        calls_ms = by_name[short_name(e.name), cat]
        calls_ms[0] += 1
        calls_ms[1] += ms
    top = sorted(by_name.items(), key=lambda kv: -kv[1][1])[:TOP_KERNELS]
    return {
        "kernels": kernels,
        "gpu_ms_by_category": dict(by_cat),
        "top_kernels": [
            {"kernel": k, "category": cat, "calls": n, "ms": ms} for (k, cat), (n, ms) in top
        ],
    }


def short_name(kernel: str) -> str:
    """A kernel's name without its template arguments and parameter list (the
    kernels of one template add up)."""
    name = kernel.removeprefix("void ")
    for sep in ("<", "("):
        name = name.split(sep, 1)[0]
    return name[:120]


def traced_step_gaps(runner: ModelRunner, specs: list) -> dict[str, Any]:
    """One step as ``time_steps`` runs it (piecewise graphs where captured),
    traced: where the GPU waits between the first kernel and the last, and
    on which neighbouring kernels (the tracer adds host time of its own, so
    gaps the host causes read somewhat longer than untraced)."""
    from torch.profiler import ProfilerActivity, profile

    with torch.inference_mode():
        torch.cuda.synchronize(runner.device)
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            batch, sampling = step_inputs(runner, specs, step_params(len(specs)), 0)
            sample(runner.forward_logits(batch), sampling).token_ids.tolist()
    return {f"traced_step_{k}": v for k, v in gaps_of(prof, 1).items()}


def step_params(n: int) -> list[SamplingParams]:
    """The sampling of a profiled step's ``n`` rows: temperature, top-k and
    top-p, a seed a row."""
    return [SamplingParams(temperature=0.8, top_k=50, top_p=0.9, seed=i) for i in range(n)]


def step_inputs(
    runner: ModelRunner, specs: list, params: list[SamplingParams], step: int
) -> tuple[Any, SamplingBatch]:
    """A step's forward batch and its sampling, built as the engine builds
    them on the host."""
    vocab, dev, n = runner.model_config.vocab_size, runner.device, len(specs)
    batch = build_forward_batch(specs, runner.pool.page_size, dev)
    return batch, SamplingBatch.build(params, list(range(n)), [step] * n, vocab, dev)


def time_steps(runner: ModelRunner, specs: list, steps: int) -> dict[str, float]:
    """The step as the engine runs it: forward (graph if captured) then sampling."""
    params = step_params(len(specs))
    fwd_ms, sample_ms, host_ms, wall_ms = [], [], [], []
    dev = runner.device
    with torch.inference_mode():
        for step in range(steps + 3):
            torch.cuda.synchronize(dev)
            e0, e1, e2 = (torch.cuda.Event(enable_timing=True) for _ in range(3))
            t0 = time.perf_counter()
            batch, sampling = step_inputs(runner, specs, params, step)
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


def profile_step(engine: Engine, b: int, args: argparse.Namespace) -> dict[str, Any]:
    runner = engine.runner
    specs, tables = decode_batch(runner, b, args.context_len)
    row: dict[str, Any] = {"batch_size": b, "context_len": args.context_len}
    row.update(profile_eager(runner, specs))
    row.update(time_steps(runner, specs, args.steps))
    row["sampling_ms_by_params"] = time_sampling(runner, b)
    row["graph"] = runner.graphs is not None and runner.graphs.can_run(
        build_forward_batch(specs, runner.pool.page_size, runner.device)
    )
    for t in tables:
        runner.pool.allocator.free(t)
    print(f"batch {b}: sampling ms by params {row['sampling_ms_by_params']}")
    return row


def print_steps(rows: list[dict[str, Any]]) -> None:
    cats = [*CATEGORIES, "other"]
    head = f"{'batch':>5} {'kernels':>7} " + " ".join(f"{c:>16}" for c in cats)
    head += f" {'fwd GPU ms':>10} {'sample ms':>9} {'host ms':>8} {'wall ms':>8} graph"
    print(head)
    for r in rows:
        cat_ms = " ".join(f"{r['gpu_ms_by_category'].get(c, 0.0):>16.3f}" for c in cats)
        print(
            f"{r['batch_size']:>5} {r['kernels']:>7} {cat_ms} {r['forward_gpu_ms']:>10.3f} "
            f"{r['sampling_gpu_ms']:>9.3f} {r['host_enqueue_ms']:>8.3f} {r['step_wall_ms']:>8.3f} "
            f"{r['graph']!s:>5}"
        )


def run_step(args: argparse.Namespace, argv: list[str] | None) -> None:
    engine = make_engine(args)
    cfg = engine.config
    rows = [profile_step(engine, b, args) for b in args.batch_sizes]
    print(
        f"model={args.model} attention={cfg.attention_backend} graphs<= {cfg.cuda_graph_max_bs} "
        f"context={args.context_len}"
    )
    print_steps(rows)
    body = {
        "model": args.model,
        "attention_backend": cfg.attention_backend,
        "cuda_graph_max_bs": cfg.cuda_graph_max_bs,
        **_kernel_settings(cfg),
        "results": rows,
    }
    stem = f"profile-step-{Path(args.model).name}"
    write_record(TOOL, argv, body, args.output_file, stem, machine(args.device))


# -- loop: the engine's overlap loop -----------------------------------------------------


@contextmanager
def decoding(engine: Engine, b: int, context_len: int) -> Iterator[list[InFlight | None]]:
    """``b`` greedy requests of ``context_len`` random tokens, run until every
    one has decoded a few tokens; yields a one-item list holding the loop's
    in-flight step (the caller keeps it current), then finishes that step and
    aborts the requests."""
    vocab = engine.model_config.vocab_size
    gen = torch.Generator().manual_seed(b)
    # Long enough that no request finishes before the timed steps end; aborted after.
    max_tokens = engine.context_length - context_len - 1
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    rids = [f"loop-{b}-{i}" for i in range(b)]
    for rid in rids:
        prompt = torch.randint(3, vocab, (context_len,), generator=gen).tolist()
        engine.add_request(rid, prompt, params)
    produced: dict[str, int] = defaultdict(int)
    inflight = None
    while min((produced[r] for r in rids), default=0) < 8:
        inflight, results = engine.overlap_step(inflight)
        for r in results:
            produced[r.rid] += 1
    torch.cuda.synchronize()
    holder = [inflight]
    try:
        yield holder
    finally:
        if holder[0] is not None:
            engine.finish(holder[0])
        for rid in rids:
            engine.abort(rid)


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


def profile_loop(engine: Engine, b: int, args: argparse.Namespace) -> dict[str, Any]:
    from torch.profiler import ProfilerActivity, profile

    with decoding(engine, b, args.context_len) as inflight:
        t0 = time.perf_counter()
        inflight[0] = run_steps(engine, inflight[0], args.steps)
        torch.cuda.synchronize()
        row: dict[str, Any] = {"loop_wall_ms": (time.perf_counter() - t0) / args.steps * 1e3}
        host = cProfile.Profile()
        host.enable()
        inflight[0] = run_steps(engine, inflight[0], args.steps)
        host.disable()
        trace_steps = 6
        with profile(activities=[ProfilerActivity.CUDA, ProfilerActivity.CPU]) as prof:
            inflight[0] = run_steps(engine, inflight[0], trace_steps)
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
    return row


def run_loop(args: argparse.Namespace, argv: list[str] | None) -> None:
    engine = make_engine(args)
    results = {}
    for b in args.batch_sizes:
        row = profile_loop(engine, b, args)
        results[b] = row
        brief = {k: v for k, v in row.items() if k not in ("top_gaps", "replay_top_kernels")}
        print(b, json.dumps(brief), flush=True)
    body = {
        "model": args.model,
        **_kernel_settings(engine.config),
        "results": results,
    }
    stem = f"profile-loop-{Path(args.model).name}"
    write_record(TOOL, argv, body, args.output_file, stem, machine(args.device))


# -- prefill: one prompt's forward taken apart -------------------------------------------


def profile_prefill(engine: Engine, prompt_len: int, args: argparse.Namespace) -> dict[str, Any]:
    """With ``--decode-rows``, the forward a serving loop makes while streams
    decode: that many rows of one new token over ``--decode-context`` cached
    tokens (pages of the pool as they are), first, then the prompt."""
    runner = engine.runner
    ps, alloc = runner.pool.page_size, runner.pool.allocator
    ctx = args.decode_context
    tables = [alloc.alloc(-(-(ctx + 1) // ps)) for _ in range(args.decode_rows)]
    tables.append(alloc.alloc(-(-prompt_len // ps)))
    if any(t is None for t in tables):
        raise SystemExit("KV pool too small for the forward; raise --kv-cache-memory-gb")
    vocab = runner.model_config.vocab_size
    specs = [ExtendSpec([(5 * i + 1) % vocab], ctx, t) for i, t in enumerate(tables[:-1])]
    specs.append(ExtendSpec([(7 * i + 3) % vocab for i in range(prompt_len)], 0, tables[-1]))
    row: dict[str, Any] = {"prompt_len": prompt_len, "decode_rows": args.decode_rows}
    if args.decode_rows:
        row["decode_context"] = ctx
    row.update(profile_eager(runner, specs))
    row["as_run"] = profile_eager(runner, specs, as_run=True)
    # As a step runs it, the last token sampled; the forward's events take in
    # the device's idle time waiting for the host.
    row.update(time_steps(runner, specs, args.steps))
    row.update(traced_step_gaps(runner, specs))
    busy = sum(row["gpu_ms_by_category"].values())
    row["kernel_ms"] = busy
    row["device_busy"] = busy / row["forward_gpu_ms"]
    row["host_hotspots"] = host_hotspots(runner, specs, args.steps)
    for t in tables:
        alloc.free(t)
    return row


def host_hotspots(runner: ModelRunner, specs: list, forwards: int, top: int = 15) -> list[dict]:
    """The host's side of ``forwards`` forwards under cProfile: the ``top``
    functions by their own time, in ms per forward (the device is synced
    only after the last, so waits on it do not count)."""
    host = cProfile.Profile()
    sync = torch.cuda.synchronize if str(runner.device).startswith("cuda") else lambda _: None
    with torch.inference_mode():
        sync(runner.device)
        host.enable()
        for _ in range(forwards):
            batch = build_forward_batch(specs, runner.pool.page_size, runner.device)
            runner.forward_logits(batch)
        host.disable()
        sync(runner.device)
    stats = pstats.Stats(host).stats  # type: ignore[attr-defined]
    rows = sorted(stats.items(), key=lambda kv: -kv[1][2])[:top]
    return [
        {
            "function": f"{Path(file).name}:{line}({name})",
            "calls_per_forward": calls / forwards,
            "own_ms": own / forwards * 1e3,
            "cumulative_ms": cum / forwards * 1e3,
        }
        for (file, line, name), (_, calls, own, cum, _) in rows
    ]


def run_prefill(args: argparse.Namespace, argv: list[str] | None) -> None:
    engine = make_engine(args)
    cfg = engine.config
    rows = [profile_prefill(engine, n, args) for n in args.prompt_lens]
    cats = [*CATEGORIES, "other"]
    print(f"model={args.model} quantization={cfg.quantization} attention={cfg.attention_backend}")
    if args.decode_rows:
        print(
            f"with {args.decode_rows} decoding rows over {args.decode_context} cached tokens each"
        )
    print(
        f"{'tokens':>6} {'kernels':>7} "
        + " ".join(f"{c:>16}" for c in cats)
        + f" {'kernel ms':>9} {'fwd GPU ms':>10} {'host ms':>8} {'wall ms':>8} {'busy':>5}"
    )
    for r in rows:
        cat_ms = " ".join(f"{r['gpu_ms_by_category'].get(c, 0.0):>16.3f}" for c in cats)
        print(
            f"{r['prompt_len']:>6} {r['kernels']:>7} {cat_ms} {r['kernel_ms']:>9.3f} "
            f"{r['forward_gpu_ms']:>10.3f} {r['host_enqueue_ms']:>8.3f} {r['step_wall_ms']:>8.3f} "
            f"{r['device_busy']:>5.0%}"
        )
    for r in rows:
        for what, table in (("eager", r), ("as run", r["as_run"])):
            print(
                f"kernels, {r['prompt_len']} tokens, {what}: {table['kernels']} kernels, "
                f"GPU ms, calls, category"
            )
            for k in table["top_kernels"][:12]:
                print(f"  {k['ms']:>8.3f} {k['calls']:>5}  {k['category']:<16} {k['kernel']}")
    for r in rows:
        print(
            f"traced step, {r['prompt_len']} tokens: window "
            f"{r['traced_step_trace_window_ms_per_step']:.3f} ms, idle "
            f"{r['traced_step_gap_sum_ms_per_step']:.3f} ms, "
            f"{r['traced_step_num_gaps_gt10us']} gaps over 10 us; the longest (us, after, before):"
        )
        for gap, after, before in r["traced_step_top_gaps"][:8]:
            print(f"  {gap:>8.1f}  {after}  ->  {before}")
    for r in rows:
        print(f"host, {r['prompt_len']} tokens: ms per forward (own / cumulative), calls")
        for h in r["host_hotspots"]:
            print(
                f"  {h['own_ms']:>7.3f} {h['cumulative_ms']:>8.3f} "
                f"{h['calls_per_forward']:>6.0f}  {h['function']}"
            )
    body = {
        "model": args.model,
        "attention_backend": cfg.attention_backend,
        **_kernel_settings(cfg),
        "results": rows,
    }
    stem = f"profile-prefill-{Path(args.model).name}"
    write_record(TOOL, argv, body, args.output_file, stem, machine(args.device))


# -- command line ---------------------------------------------------------------------


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(
        prog=f"python -m {TOOL}",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    modes = ap.add_subparsers(dest="mode", required=True, metavar="{step,loop,prefill}")
    step = modes.add_parser("step", help="one decode step taken apart")
    loop = modes.add_parser("loop", help="the engine's overlap loop")
    prefill = modes.add_parser("prefill", help="one prompt's forward taken apart")
    for p, batch_sizes, steps, kv_gb, graph_bs in (
        (step, [1, 64], 20, 40.0, None),
        (loop, [1, 64, 256], 50, 60.0, 256),
    ):
        p.add_argument(
            "--batch-sizes",
            type=int,
            nargs="+",
            default=batch_sizes,
            help="decode batch sizes (default: %(default)s)",
        )
        p.add_argument(
            "--context-len",
            type=int,
            default=1024,
            help="KV (prompt) length of every request (default: %(default)s)",
        )
        p.add_argument(
            "--steps", type=int, default=steps, help="timed steps (default: %(default)s)"
        )
        _engine_arguments(p, kv_gb, graph_bs)
    prefill.add_argument(
        "--prompt-lens",
        type=int,
        nargs="+",
        default=[1024, 8192],
        help="tokens of the one prompt of each forward (default: %(default)s)",
    )
    prefill.add_argument(
        "--steps", type=int, default=10, help="timed forwards (default: %(default)s)"
    )
    prefill.add_argument(
        "--decode-rows",
        type=int,
        default=0,
        help="decoding rows in the same forward, before the prompt (default: %(default)s)",
    )
    prefill.add_argument(
        "--decode-context",
        type=int,
        default=1024,
        help="cached tokens of each decoding row (default: %(default)s)",
    )
    _engine_arguments(prefill, 20.0, None)
    for p in (step, prefill):
        p.add_argument("--dtype", default="bfloat16", help="model dtype (default: %(default)s)")
        p.add_argument(
            "--attention-backend",
            default="auto",
            help="auto, flashinfer or torch_native (default: %(default)s)",
        )
    loop.set_defaults(dtype=None, attention_backend=None)
    loop.add_argument("--trace-dir", default=None, help="write host profiles and chrome traces")
    return ap


def _kernel_settings(cfg: EngineConfig) -> dict[str, Any]:
    """The settings that choose the kernels (``KERNEL_SETTINGS``: the
    weights', the KV pool's, the layer prologue's, decode attention's), for
    every mode's record."""
    return {name: getattr(cfg, name) for name in KERNEL_SETTINGS}


def _engine_arguments(p: argparse.ArgumentParser, kv_gb: float, graph_bs: int | None) -> None:
    """The engine and record options every mode takes."""
    p.add_argument(
        "--model",
        default="llama-3.1-8b",
        help="preset (dummy weights) or checkpoint dir (default: %(default)s)",
    )
    p.add_argument("--device", default="cuda:0", help="CUDA device (default: %(default)s)")
    p.add_argument(
        "--page-size", type=int, default=16, help="tokens per KV page (default: %(default)s)"
    )
    p.add_argument(
        "--kv-cache-memory-gb", type=float, default=kv_gb, help="KV pool (default: %(default)s)"
    )
    p.add_argument(
        "--cuda-graph-max-bs",
        type=int,
        default=graph_bs,
        help="largest graph-captured batch (default: %(default)s; None: the engine's auto)",
    )
    p.add_argument(
        "--max-running-requests",
        type=int,
        default=None,
        help="engine setting (bounds auto graph sizes; default: 256 or the largest batch)",
    )
    for setting in KERNEL_SETTINGS:
        add_engine_flag(p, setting)
    p.add_argument("--output-file", default=None, help="JSON record (default: results dir)")


def main(argv: list[str] | None = None) -> None:
    args = build_parser().parse_args(argv)
    {"step": run_step, "loop": run_loop, "prefill": run_prefill}[args.mode](args, argv)


if __name__ == "__main__":
    main()
