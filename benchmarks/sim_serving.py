"""Serving on the engine alone: the scheduler's view of a serving run.

Closed loop (``--concurrency``): keeps C requests in flight (random prompts of
``--input-len`` tokens, ``--output-len`` greedy tokens with ``ignore_eos``),
replacing each one that finishes until ``--requests`` have run. Open loop
(``--request-rates``): requests arrive at Poisson times at each rate (seeded),
however many are in flight. Either way through the engine's overlap loop and
nothing else (no HTTP, no request plane, no detokenization); arrivals are
taken between steps, as the worker takes them. A first closed round of C
requests (8 before the open-loop runs) warms the engine up and is not counted.

Reports output tokens/s, the gaps between a request's tokens (p50/p99), the
time from a request's arrival to its first token (p50/p99), the requests'
mean gaps (TPOT, p50/p99), and the steps by kind: pure decode steps and mixed
steps (decode rows plus prefill chunks) with their mean duration and
composition. This is where scheduling policies (token budget,
``--prefill-per-request``, ``--prefill-floor``) are compared before a full
``bench_serving`` run::

    python -m benchmarks.sim_serving --model llama-3.1-8b --device cuda:0 \\
        --concurrency 64 256 --request-rates 10 14 --requests 256 \\
        --prefill-per-request 0 6 --prefill-floor 256 1024 \\
        --kv-cache-memory-gb 60 --cuda-graph-max-bs 256
"""

from __future__ import annotations

import argparse
import itertools
import json
import random
import statistics
import time
from collections import defaultdict
from pathlib import Path
from typing import Any

import torch

from benchmarks.common import machine, write_record
from engine.config import EngineConfig, resolve_device
from engine.engine import Engine
from protocol.sampling import SamplingParams


def simulate(
    engine: Engine,
    concurrency: int,
    requests: int,
    args: argparse.Namespace,
    rate: float | None = None,
) -> dict:
    """``requests`` requests in a closed loop of ``concurrency``, or with
    ``rate``, arriving at Poisson times at ``rate`` per second."""
    vocab = engine.model_config.vocab_size
    gen = torch.Generator().manual_seed(0)
    params = SamplingParams(temperature=0.0, max_tokens=args.output_len, ignore_eos=True)
    arrived: dict[str, float] = {}
    token_times: dict[str, list[float]] = defaultdict(list)
    started = done = 0
    tag = f"c{concurrency}-r{rate}-n{requests}-{time.monotonic_ns()}"
    due: list[float] = []  # open loop: arrival times after the start, in seconds
    if rate:
        rng = random.Random(0)
        due = list(itertools.accumulate(rng.expovariate(rate) for _ in range(requests)))

    def add(at: float) -> None:
        nonlocal started
        rid = f"{tag}-{started}"
        prompt = torch.randint(3, vocab, (args.input_len,), generator=gen).tolist()
        arrived[rid] = at
        engine.add_request(rid, prompt, params)
        started += 1

    t0 = last = time.perf_counter()
    if not rate:
        for _ in range(min(concurrency, requests)):
            add(t0)
    steps: list[tuple[int, int, float]] = []  # (decode rows, prefill tokens, seconds)
    inflight = None
    while done < requests:
        if rate:
            now = time.perf_counter()
            while started < requests and t0 + due[started] <= now:
                add(t0 + due[started])
        nxt = None if engine.scheduler.starved else engine.launch(inflight)
        results = engine.finish(inflight) if inflight is not None else []
        if nxt is None:
            engine.scheduler.starved = False
        now = time.perf_counter()
        if inflight is not None:
            lens = inflight.batch.extend_lens
            decode = sum(1 for n in lens if n == 1)
            steps.append((decode, sum(lens) - decode, now - last))
        last = now
        for r in results:
            token_times[r.rid].append(now)
            if r.finish_reason is not None:
                done += 1
                if not rate and started < requests:
                    add(now)
        inflight = nxt
    wall = time.perf_counter() - t0
    if inflight is not None:  # a step launched beside the last finishing one
        engine.finish(inflight)
    sched = engine.scheduler
    cached = sched.cache.cached_pages if sched.cache is not None else 0
    itl = sorted(b - a for ts in token_times.values() for a, b in zip(ts, ts[1:]))
    ttft = sorted(ts[0] - arrived[rid] for rid, ts in token_times.items())
    tpot = sorted((ts[-1] - ts[0]) / (len(ts) - 1) for ts in token_times.values() if len(ts) > 1)
    kinds: dict[str, list[float]] = defaultdict(lambda: [0, 0.0])
    for _, prefill, dt in steps:
        k = kinds["mixed" if prefill else "decode"]
        k[0] += 1
        k[1] += dt
    mixed = [(d, p) for d, p, _ in steps if p]

    def pct(xs: list[float], q: float) -> float:
        return xs[min(len(xs) - 1, int(len(xs) * q))] * 1e3 if xs else 0.0

    return {
        "arrivals": f"poisson {rate}/s" if rate else f"closed loop of {concurrency}",
        "concurrency": None if rate else concurrency,
        "request_rate": rate,
        "requests": requests,
        "wall_s": wall,
        "output_tok_s": requests * args.output_len / wall,
        "itl_p50_ms": pct(itl, 0.5),
        "itl_p99_ms": pct(itl, 0.99),
        "ttft_p50_ms": pct(ttft, 0.5),
        "ttft_p99_ms": pct(ttft, 0.99),
        "tpot_p50_ms": pct(tpot, 0.5),
        "tpot_p99_ms": pct(tpot, 0.99),
        "steps": {
            k: {"n": int(n), "total_s": s, "mean_ms": s / n * 1e3} for k, (n, s) in kinds.items()
        },
        "mixed_mean_prefill_tokens": statistics.mean([p for _, p in mixed]) if mixed else 0.0,
        "mixed_mean_decode_rows": statistics.mean([d for d, _ in mixed]) if mixed else 0.0,
        # Pages neither free nor held by the prefix cache once every request ended.
        "pages_leaked": sched.allocator.capacity - sched.allocator.num_free - cached,
    }


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(
        prog="python -m benchmarks.sim_serving",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    ap.add_argument("--model", default=None, help="checkpoint dir or preset (dummy weights)")
    ap.add_argument("--device", default="auto", help="engine device (default: %(default)s)")
    ap.add_argument("--kv-cache-memory-gb", type=float, default=1.0, help="KV pool size")
    ap.add_argument("--cuda-graph-max-bs", type=int, default=None, help="engine setting")
    ap.add_argument(
        "--max-running-requests", type=int, default=256, help="engine setting (default: 256)"
    )
    ap.add_argument(
        "--max-num-batched-tokens",
        type=int,
        nargs="+",
        default=[2048],
        help="token budgets to compare (default: %(default)s)",
    )
    ap.add_argument(
        "--prefill-per-request",
        type=int,
        nargs="+",
        default=[-1],
        help="engine setting values to compare; -1 for the engine's default (default: -1)",
    )
    ap.add_argument(
        "--prefill-floor",
        type=int,
        nargs="+",
        default=[EngineConfig.prefill_floor],
        help="engine setting values to compare (default: %(default)s)",
    )
    ap.add_argument(
        "--concurrency",
        type=int,
        nargs="*",
        default=[64],
        help="closed loops: requests kept in flight (default: %(default)s)",
    )
    ap.add_argument(
        "--request-rates",
        type=float,
        nargs="*",
        default=[],
        help="open loops: Poisson arrivals per second (default: none)",
    )
    ap.add_argument(
        "--requests",
        type=int,
        default=None,
        help="timed requests (default: 2 x C closed, 128 open)",
    )
    ap.add_argument("--input-len", type=int, default=1024, help="prompt tokens (default: 1024)")
    ap.add_argument("--output-len", type=int, default=256, help="output tokens (default: 256)")
    ap.add_argument("--output-file", default=None, help="JSON record (default: results dir)")
    return ap


def main(argv: list[str] | None = None) -> None:
    args = build_parser().parse_args(argv)
    load_format = "auto" if args.model is None or Path(args.model).exists() else "dummy"
    rows: list[dict[str, Any]] = []
    settings = itertools.product(
        args.max_num_batched_tokens, args.prefill_per_request, args.prefill_floor
    )
    for budget, per_request, floor in settings:
        engine = Engine(
            EngineConfig(
                model=args.model,
                load_format=load_format,
                device=args.device,
                kv_cache_memory_gb=args.kv_cache_memory_gb,
                cuda_graph_max_bs=args.cuda_graph_max_bs,
                max_running_requests=args.max_running_requests,
                max_num_batched_tokens=budget,
                prefill_per_request=None if per_request < 0 else per_request,
                prefill_floor=floor,
            )
        )
        runs = [(c, None, args.requests or 2 * c) for c in args.concurrency]
        runs += [(0, rate, args.requests or 128) for rate in args.request_rates]
        for c, rate, n in runs:
            warm = c or 8
            simulate(engine, warm, warm, args)  # warm-up round
            row = simulate(engine, c, n, args, rate)
            row["max_num_batched_tokens"] = budget
            row["prefill_per_request"] = engine.config.prefill_per_request
            row["prefill_floor"] = floor
            rows.append(row)
            print(json.dumps(row), flush=True)
        del engine
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
    write_record(
        "benchmarks.sim_serving",
        argv,
        {"model": args.model or "tiny (built-in)", "rows": rows},
        args.output_file,
        f"sim-serving-{Path(args.model).name if args.model else 'tiny'}",
        machine(resolve_device(args.device)),
    )


if __name__ == "__main__":
    main()
