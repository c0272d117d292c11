"""What the gateway's metrics cost: the hand-written Prometheus code against
``prometheus-client``, per operation and per scrape::

    python -m benchmarks.bench_metrics [--number 200000] [--repeat 7]

Per streamed token the gateway runs ``RequestTiming.observe`` (one
``time.monotonic()`` and one unlabelled histogram observation); per request a
labelled counter, a histogram and the labelled stage histograms; per scrape it
renders everything. Each operation is timed with ``timeit`` (the minimum over
``--repeat`` runs of ``--number`` calls, in ns per call); the scrape renders
a registry shaped like a gateway's with one prefill and one decode worker.
``prometheus-client`` is optional (``pip install prometheus-client``): without
it only the hand-written side is measured. docs/metrics-library.md reads the
record this writes.
"""

from __future__ import annotations

import argparse
import importlib.metadata
import time
import timeit
from collections.abc import Callable
from typing import Any

from benchmarks.common import write_record
from gateway.metrics import _BUCKETS, Counter, GatewayMetrics, Histogram, RequestTiming
from harness.host import host_info
from protocol.prometheus import STAGE_BUCKETS, HistogramFamily

STAGES = ("tokenize", "route", "dispatch_to_first_token", "first_token_to_first_byte", "total")
WORKER_STAGES = tuple(f"stage_{i}" for i in range(13))
"""As many series as a gateway in front of one prefill and one decode worker
renders (the names do not change the cost)."""


def ns_per_call(fn: Callable[[], Any], number: int, repeat: int) -> float:
    return min(timeit.repeat(fn, number=number, repeat=repeat)) / number * 1e9


def hand_written(number: int, repeat: int) -> dict[str, float]:
    metrics = GatewayMetrics()
    timing = RequestTiming(metrics, 1, time.monotonic())
    timing.observe(0, 1)  # the first token: from here on every call is an ITL sample
    hist = Histogram("h", "h")
    counter = Counter("c", "c", "endpoint")
    one = HistogramFamily("s1", "s1", ("stage",))
    two = HistogramFamily("s2", "s2", ("role", "stage"))
    for stage in STAGES:
        one.observe((stage,), 0.001)
    for role in ("prefill", "decode"):
        for stage in WORKER_STAGES:
            two.observe((role, stage), 0.001)

    def scrape() -> str:
        lines: list[str] = []
        for m in (metrics.ttft, metrics.itl, metrics.e2e, counter):
            lines += m.render()
        return "\n".join(lines + one.render() + two.render())

    return {
        "token_path": ns_per_call(lambda: timing.observe(0, 1), number, repeat),
        "histogram_observe": ns_per_call(lambda: hist.observe(0.003), number, repeat),
        "counter_inc_labelled": ns_per_call(lambda: counter.inc("chat"), number, repeat),
        "histogram_observe_1_label": ns_per_call(
            lambda: one.observe(("route",), 0.003), number, repeat
        ),
        "histogram_observe_2_labels": ns_per_call(
            lambda: two.observe(("decode", "stage_3"), 0.003), number, repeat
        ),
        "scrape": ns_per_call(scrape, max(number // 1000, 20), repeat),
        "scrape_lines": len(scrape().splitlines()),
    }


def with_prometheus_client(number: int, repeat: int) -> dict[str, float] | None:
    try:
        import prometheus_client as pc
    except ImportError:
        return None
    reg = pc.CollectorRegistry()
    itl = pc.Histogram("itl", "itl", buckets=_BUCKETS, registry=reg)
    ttft = pc.Histogram("ttft", "ttft", buckets=_BUCKETS, registry=reg)
    e2e = pc.Histogram("e2e", "e2e", buckets=_BUCKETS, registry=reg)
    counter = pc.Counter("c", "c", ["endpoint"], registry=reg)
    one = pc.Histogram("s1", "s1", ["stage"], buckets=STAGE_BUCKETS, registry=reg)
    two = pc.Histogram("s2", "s2", ["role", "stage"], buckets=STAGE_BUCKETS, registry=reg)
    for h in (ttft, e2e):
        h.observe(0.01)
    counter.labels("chat").inc()
    for stage in STAGES:
        one.labels(stage).observe(0.001)
    for role in ("prefill", "decode"):
        for stage in WORKER_STAGES:
            two.labels(role, stage).observe(0.001)
    child_counter = counter.labels("chat")
    child_hist = one.labels("route")
    last = [time.monotonic()]

    def token_path() -> None:  # RequestTiming.observe's work, on prometheus-client
        t = time.monotonic()
        itl.observe(t - last[0])
        last[0] = t

    return {
        "token_path": ns_per_call(token_path, number, repeat),
        "histogram_observe": ns_per_call(lambda: itl.observe(0.003), number, repeat),
        "counter_inc_labelled": ns_per_call(lambda: counter.labels("chat").inc(), number, repeat),
        "counter_inc_bound_child": ns_per_call(child_counter.inc, number, repeat),
        "histogram_observe_1_label": ns_per_call(
            lambda: one.labels("route").observe(0.003), number, repeat
        ),
        "histogram_observe_bound_child": ns_per_call(
            lambda: child_hist.observe(0.003), number, repeat
        ),
        "histogram_observe_2_labels": ns_per_call(
            lambda: two.labels("decode", "stage_3").observe(0.003), number, repeat
        ),
        "scrape": ns_per_call(lambda: pc.generate_latest(reg), max(number // 1000, 20), repeat),
        "scrape_lines": len(pc.generate_latest(reg).decode().splitlines()),
        "version": importlib.metadata.version("prometheus-client"),
    }


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(
        prog="python -m benchmarks.bench_metrics",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    ap.add_argument("--number", type=int, default=200_000, help="calls per timed run")
    ap.add_argument("--repeat", type=int, default=7, help="timed runs; the minimum counts")
    ap.add_argument("--output-file", default=None, help="default: benchmarks/results/")
    args = ap.parse_args(argv)

    hand = hand_written(args.number, args.repeat)
    lib = with_prometheus_client(args.number, args.repeat)
    print(f"{'operation':<30} {'hand-written ns':>16} {'prometheus-client ns':>21}")
    for key, value in hand.items():
        other = "-" if lib is None or key not in lib else f"{lib[key]:.0f}"
        print(f"{key:<30} {value:>16.0f} {other:>21}")
    if lib is not None:
        for key in ("counter_inc_bound_child", "histogram_observe_bound_child"):
            print(f"{key:<30} {'-':>16} {lib[key]:>21.0f}")
    else:
        print("prometheus-client is not installed: only the hand-written side was measured")
    write_record(
        "benchmarks.bench_metrics",
        argv,
        {"hand_written_ns": hand, "prometheus_client_ns": lib},
        args.output_file,
        "metrics-library",
        machine=host_info(),
    )


if __name__ == "__main__":
    main()
