"""Prefix routing across gateway replicas, on the CPU with the tiny model.

For each routing (``kv-events``: by the blocks the prefill workers' caches
report; ``tree``: by each gateway's own tree of what it routed) and each
replica count, a fresh fleet (``harness.fleet``: prefill and decode workers,
the gateways) serves a shared-prefix workload spread over the replicas;
reported are the prefix-cache hit rate from the prefill workers' own
counters, TTFT, and (KV events) how long after a prefill worker restarts with
a cold cache every replica's routing view of it is the new, empty one::

    python -m benchmarks.bench_fleet --gateways 1 2 --routing kv-events tree \\
        --groups 64 --per-group 8 --num-pages 8192

A smaller ``--num-pages`` makes the workers evict, which a gateway's own tree
does not see.
"""

from __future__ import annotations

import argparse
import tempfile
from dataclasses import asdict
from pathlib import Path

from benchmarks.common import write_record
from harness.fleet import FleetConfig, run_fleet


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(
        prog="python -m benchmarks.bench_fleet",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    d = FleetConfig()
    p.add_argument("--gateways", type=int, nargs="+", default=[1, 2])
    p.add_argument(
        "--routing", nargs="+", choices=["kv-events", "tree"], default=["kv-events", "tree"]
    )
    p.add_argument("--prefill", type=int, default=d.prefill)
    p.add_argument("--decode", type=int, default=d.decode)
    p.add_argument("--groups", type=int, default=d.groups, help="system prompts")
    p.add_argument("--per-group", type=int, default=d.per_group, help="questions per system prompt")
    p.add_argument("--system-len", type=int, default=d.system_len)
    p.add_argument("--question-len", type=int, default=d.question_len)
    p.add_argument("--output-len", type=int, default=d.output_len)
    p.add_argument("--concurrency", type=int, default=d.concurrency)
    p.add_argument("--num-pages", type=int, default=d.num_pages, help="KV pages per worker")
    p.add_argument("--page-size", type=int, default=d.page_size)
    p.add_argument("--seed", type=int, default=d.seed)
    p.add_argument("--output-file", type=Path, default=None)
    args = p.parse_args(argv)

    results = []
    print(
        f"{'routing':<10} {'gateways':>8} {'requests':>8} {'failed':>6} {'hit rate':>8} "
        f"{'TTFT mean':>9} {'p50':>7} {'p99':>7} {'restart->view':>13}"
    )
    with tempfile.TemporaryDirectory(prefix="bench_fleet-") as tmp:
        for routing in args.routing:
            for n in args.gateways:
                cfg = FleetConfig(
                    gateways=n,
                    kv_events=routing == "kv-events",
                    prefill=args.prefill,
                    decode=args.decode,
                    groups=args.groups,
                    per_group=args.per_group,
                    system_len=args.system_len,
                    question_len=args.question_len,
                    output_len=args.output_len,
                    concurrency=args.concurrency,
                    page_size=args.page_size,
                    num_pages=args.num_pages,
                    seed=args.seed,
                )
                r = run_fleet(cfg, Path(tmp) / f"{routing}-{n}", measure_restart=cfg.kv_events)
                restart = "-" if r.restart_reflected_s is None else f"{r.restart_reflected_s:.3f} s"
                print(
                    f"{routing:<10} {n:>8} {r.requests:>8} {r.failed:>6} {r.hit_rate:>8.3f} "
                    f"{r.ttft_mean_ms:>7.1f}ms {r.ttft_p50_ms:>5.1f}ms {r.ttft_p99_ms:>5.1f}ms "
                    f"{restart:>13}",
                    flush=True,
                )
                results.append({"routing": routing, **asdict(r)})
    write_record(
        "benchmarks.bench_fleet", argv, {"results": results}, args.output_file, "fleet-cpu"
    )


if __name__ == "__main__":
    main()
