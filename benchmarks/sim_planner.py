"""Prefill:decode ratios on a simulated fleet, and the ratio the planner picks.

For each workload (short prompts / long outputs: 128 in, 1024 out, 140 req/s;
long prompts / short outputs: 4096 in, 64 out, 85 req/s; mixed: half of each,
100 req/s; ``--rate-scale`` scales the rates), every ratio P:D of
``--ratios`` splits ``--total-workers`` into P prefill and D decode workers,
and one open-loop run sends the same Poisson arrivals through them for
``--duration-s``. Goodput: the requests that finished after ``--warmup-s``
and before the end, meeting both objectives (TTFT <= ``--slo-ttft-s``, TPOT =
(end - first token) / (output - 1) <= ``--slo-tpot-s``), per second of that
window; a pool that cannot keep up caps it at its capacity. The rates put the
best ratio's busiest pool at about 85-95% of its capacity, so that the ratios
next to it fall short.

The planner is the gateway's own (``gateway.planner.Planner``), fed as the
gateway feeds it: the simulated workers are ``WorkerInfo`` entries of a real
``Router`` (least-load routing and the router's in-flight accounting, as
``gateway.dispatch`` does it) whose ``stats`` are refreshed every
``--scrape-s`` with what a worker's ``/server_info`` reports (waiting,
running, prealloc, pages, ``uptime_seconds``, ``engine_step_seconds_total``,
``transfers_ok``), and its latency window gets each request's tokens as a
client sees them (at the first token, the second, at each evaluation and at
the end). Its configuration: the objectives above, ``--window-s``, and
``--decode-step-floor-s`` (bench_engine's batch-1 decode step; 0 leaves it
to the planner's auto estimate). Its pick on a workload: start at 1:1, take
the recommendation of the run's last evaluation, move to the tried ratio
nearest the recommended prefill:decode split (in log P/D), and repeat until
the ratio stays (at most as many moves as there are ratios). The pick is right
when no tried ratio's goodput is more than ``--tie`` above it.

The model is a discrete-event one (no engine runs, no GPU needed; the default
arguments take about 10 s of one CPU core). Step costs are the H200 figures of
docs/benchmarks.md (dummy Llama-3.1-8B, one GPU per worker), all of them
flags:

- decode step = ``--decode-base-ms`` + ``--decode-row-ms`` x batch +
  ``--decode-kv-ns`` x context tokens in the batch (4.79 ms at batch 1 and
  19.08 ms at batch 256 with 1024-token contexts; attention 10 ms for 34 GB
  of KV);
- prefill step = max(``--prefill-floor-ms``, sum over its chunks of tokens /
  ``--prefill-tok-s`` + ``--prefill-quad-ns`` x attention's token pairs)
  (23.1 ms for a 1024-token prompt, 0.217 s for 8192), up to
  ``--token-budget`` tokens per step, first come first served, chunked;
- the first token leaves the prefill worker when its prompt is done; the KV
  reaches the decode worker ``--transfer-ms`` later; a decode worker runs up
  to ``--max-running`` requests and reserves each one's whole context
  (prompt + output) in its ``--kv-tokens`` at admission (no retraction).

    python -m benchmarks.sim_planner
"""

from __future__ import annotations

import argparse
import heapq
import itertools
import json
import math
import random
import time
from collections import deque
from typing import Any, NamedTuple

from benchmarks.common import write_record
from gateway.planner import LatencySample, Planner, PlannerConfig, Recommendation
from gateway.routing import Router, RouterConfig, WorkerInfo

PAGE = 16


class Workload(NamedTuple):
    name: str
    shapes: tuple[tuple[int, int], ...]
    """(prompt tokens, output tokens) of the requests, drawn with equal odds."""
    rate: float
    """Requests per second."""


WORKLOADS = (
    Workload("short-in-long-out", ((128, 1024),), 140.0),
    Workload("long-in-short-out", ((4096, 64),), 85.0),
    Workload("mixed", ((128, 1024), (4096, 64)), 100.0),
)


class Costs(NamedTuple):
    decode_base_ms: float
    decode_row_ms: float
    decode_kv_ns: float
    prefill_tok_s: float
    prefill_quad_ns: float
    prefill_floor_ms: float
    token_budget: int
    transfer_ms: float
    max_running: int
    kv_tokens: int

    def decode_step_s(self, batch: int, context_tokens: int) -> float:
        return (
            self.decode_base_ms * 1e-3
            + self.decode_row_ms * 1e-3 * batch
            + self.decode_kv_ns * 1e-9 * context_tokens
        )

    def prefill_chunk_s(self, done: int, tokens: int) -> float:
        """A chunk of ``tokens`` after ``done`` tokens of its prompt."""
        pairs = ((done + tokens) ** 2 - done**2) / 2
        return tokens / self.prefill_tok_s + self.prefill_quad_ns * 1e-9 * pairs


class Request:
    __slots__ = (
        "admit_step",
        "arrival",
        "decode",
        "finish",
        "first",
        "output",
        "prefill",
        "prompt",
        "sample",
    )

    def __init__(self, arrival: float, prompt: int, output: int) -> None:
        self.arrival, self.prompt, self.output = arrival, prompt, output
        self.first = self.finish = math.nan
        self.admit_step = 0
        self.sample: LatencySample | None = None
        self.prefill: PrefillWorker | None = None
        self.decode: DecodeWorker | None = None


class PrefillWorker:
    def __init__(self, info: WorkerInfo) -> None:
        self.info = info
        self.queue: deque[list[Any]] = deque()  # [request, tokens done]
        self.in_step: list[Request] = []
        self.busy_s = 0.0
        self.done = 0

    def stats(self, now: float) -> dict[str, Any]:
        return {
            "waiting": len(self.queue) - len(self.in_step),
            "running": len(self.in_step),
            "uptime_seconds": now,
            "engine_step_seconds_total": self.busy_s,
            "transfers_ok": self.done,
        }


class DecodeWorker:
    def __init__(self, info: WorkerInfo, costs: Costs) -> None:
        self.info = info
        self.costs = costs
        self.waiting: deque[Request] = deque()
        self.finishing: list[tuple[int, int, Request]] = []  # (finish step, seq, request)
        self.step = 0
        self.stepping = False
        self.context = 0
        self.reserved = 0
        self.busy_s = 0.0
        self.last_step_end = 0.0
        self.new: list[Request] = []
        """Admitted since the last step: their second token comes with the next."""

    @property
    def running(self) -> int:
        return len(self.finishing)

    def stats(self, now: float) -> dict[str, Any]:
        total = self.costs.kv_tokens // PAGE
        return {
            "waiting": len(self.waiting),
            "prealloc": 0,
            "running": self.running,
            "total_pages": total,
            "available_pages": total - math.ceil(self.reserved / PAGE),
            "uptime_seconds": now,
            "engine_step_seconds_total": self.busy_s,
        }


class Run(NamedTuple):
    prefill: int
    decode: int
    finished: int
    good: int
    goodput: float
    ttft_p90_s: float
    tpot_p90_s: float
    recommendation: Recommendation


def simulate(
    workload: Workload, prefill: int, decode: int, costs: Costs, args: argparse.Namespace
) -> Run:
    rng = random.Random(args.seed)
    now = 0.0
    planner = Planner(
        PlannerConfig(
            slo_ttft_s=args.slo_ttft_s,
            slo_tpot_s=args.slo_tpot_s,
            planner_window_s=args.window_s,
            planner_decode_step_floor_s=args.decode_step_floor_s or None,
        ),
        clock=lambda: now,
    )
    router = Router(RouterConfig(prefill_policy="least_load", decode_policy="least_load"))
    prefills = [
        PrefillWorker(router.add(WorkerInfo(f"http://prefill-{i}", "prefill")))
        for i in range(prefill)
    ]
    decodes = [
        DecodeWorker(router.add(WorkerInfo(f"http://decode-{i}", "decode")), costs)
        for i in range(decode)
    ]
    by_info = {id(w.info): w for w in [*prefills, *decodes]}
    for w in decodes:
        w.info.info = {"max_running_requests": costs.max_running}

    events: list[tuple[float, int, int, Any]] = []
    seq = itertools.count()
    ARRIVE, PREFILL_STEP, KV_IN, DECODE_STEP, SCRAPE = range(5)

    def at(t: float, kind: int, obj: Any) -> None:
        heapq.heappush(events, (t, next(seq), kind, obj))

    # Arrivals, drawn up front from the seeded generator.
    t, arrivals = 0.0, []
    while True:
        t += rng.expovariate(workload.rate)
        if t > args.duration_s:
            break
        prompt, output = rng.choice(workload.shapes)
        arrivals.append(Request(t, prompt, output))
    for r in arrivals:
        at(r.arrival, ARRIVE, r)
    for k in range(1, int(args.duration_s / args.scrape_s) + 1):
        at(k * args.scrape_s, SCRAPE, None)
    recommendation: Recommendation | None = None

    def start_prefill(w: PrefillWorker) -> None:
        budget, cost, chunks = costs.token_budget, 0.0, []
        for item in w.queue:
            if budget <= 0:
                break
            r, done = item
            n = min(budget, r.prompt - done)
            cost += costs.prefill_chunk_s(done, n)
            chunks.append((item, n))
            budget -= n
        dt = max(costs.prefill_floor_ms * 1e-3, cost)
        w.in_step = [item[0] for item, _ in chunks]
        w.busy_s += dt
        at(now + dt, PREFILL_STEP, (w, chunks))

    def start_decode(w: DecodeWorker) -> None:
        while w.waiting:
            r = w.waiting[0]
            need = r.prompt + r.output
            if w.running >= costs.max_running or w.reserved + need > costs.kv_tokens:
                break
            w.waiting.popleft()
            w.reserved += need
            w.context += r.prompt + 1
            r.admit_step = w.step
            heapq.heappush(w.finishing, (w.step + r.output - 1, next(seq), r))
            w.new.append(r)
        if not w.finishing:
            w.stepping = False
            return
        w.stepping = True
        dt = costs.decode_step_s(w.running, w.context)
        w.busy_s += dt
        at(now + dt, DECODE_STEP, w)

    def finish(r: Request, w: DecodeWorker) -> None:
        r.finish = now
        w.reserved -= r.prompt + r.output
        w.context -= r.prompt + r.output
        router.end(w.info, r.prompt + r.output, True)
        assert r.prefill is not None
        router.end(r.prefill.info, r.prompt, True)
        if r.sample is not None and r.output > r.sample.tokens:
            r.sample.more(now, r.output - r.sample.tokens)

    def scrape() -> Recommendation:
        for w in [*prefills, *decodes]:
            w.info.stats = w.stats(now)
        for w in decodes:  # tokens streamed so far, as a client sees them
            for _, _, r in w.finishing:
                made = 1 + w.step - r.admit_step
                if r.sample is not None and made > r.sample.tokens:
                    r.sample.more(w.last_step_end, made - r.sample.tokens)
        return planner.evaluate(router.workers())[1]

    while events and events[0][0] <= args.duration_s:
        now, _, kind, obj = heapq.heappop(events)
        if kind == ARRIVE:
            r = obj
            p = router.pick_prefill([])
            d = router.pick_decode([], with_prefill=True)
            assert p is not None and d is not None
            router.begin(d, r.prompt + r.output)
            router.begin(p, r.prompt)
            r.prefill, r.decode = by_info[id(p)], by_info[id(d)]
            pw = r.prefill
            pw.queue.append([r, 0])
            if not pw.in_step:
                start_prefill(pw)
        elif kind == PREFILL_STEP:
            pw, chunks = obj
            for item, n in chunks:
                item[1] += n
            while pw.queue and pw.queue[0][1] >= pw.queue[0][0].prompt:
                r = pw.queue.popleft()[0]
                r.first = now
                r.sample = planner.samples.first_token(now, now - r.arrival)
                pw.done += 1
                at(now + costs.transfer_ms * 1e-3, KV_IN, r)
            pw.in_step = []
            if pw.queue:
                start_prefill(pw)
        elif kind == KV_IN:
            r = obj
            dw = r.decode
            assert dw is not None
            if r.output <= 1:
                finish(r, dw)
                continue
            dw.waiting.append(r)
            if not dw.stepping:
                start_decode(dw)
        elif kind == DECODE_STEP:
            dw = obj
            dw.step += 1
            dw.context += dw.running
            dw.last_step_end = now
            for r in dw.new:
                if r.sample is not None:
                    r.sample.more(now, 1)
            dw.new = []
            while dw.finishing and dw.finishing[0][0] <= dw.step:
                finish(heapq.heappop(dw.finishing)[2], dw)
            start_decode(dw)
        elif kind == SCRAPE:
            recommendation = scrape()

    assert recommendation is not None, "no evaluation: --duration-s below --scrape-s"
    # Steady state: the requests that finished after the warm-up and before
    # the arrivals stop (no drain: an overloaded pool caps this at its capacity).
    lo, hi = args.warmup_s, args.duration_s
    done = [r for r in arrivals if lo <= r.finish <= hi]
    good = [
        r
        for r in done
        if r.first - r.arrival <= args.slo_ttft_s
        and (r.output <= 1 or (r.finish - r.first) / (r.output - 1) <= args.slo_tpot_s)
    ]
    # Latency percentiles: TTFT of the requests that came in the window, TPOT
    # of those whose first token came in it, counting a request the run
    # ended on as if it ended then (a lower bound).
    ttft = sorted(
        (r.first if r.first <= hi else hi) - r.arrival for r in arrivals if r.arrival >= lo
    )
    started = [r for r in arrivals if lo <= r.first <= hi]
    tpot = sorted(
        ((r.finish if r.finish <= hi else hi) - r.first) / (r.output - 1)
        for r in started
        if r.output > 1
    )
    return Run(
        prefill=prefill,
        decode=decode,
        finished=len(done),
        good=len(good),
        goodput=len(good) / (hi - lo),
        ttft_p90_s=ttft[int(0.9 * (len(ttft) - 1))] if ttft else math.inf,
        tpot_p90_s=tpot[int(0.9 * (len(tpot) - 1))] if tpot else 0.0,
        recommendation=recommendation,
    )


def parse_ratio(text: str) -> tuple[int, int]:
    p, sep, d = text.partition(":")
    if not sep or not p.isdigit() or not d.isdigit() or int(p) < 1 or int(d) < 1:
        raise argparse.ArgumentTypeError(f"not a ratio P:D of positive integers: {text!r}")
    return int(p), int(d)


def split(total: int, ratio: tuple[int, int]) -> tuple[int, int]:
    p, d = ratio
    if total % (p + d):
        raise SystemExit(f"--total-workers {total} does not split {p}:{d}")
    k = total // (p + d)
    return p * k, d * k


def nearest(ratios: list[tuple[int, int]], prefill: float, decode: float) -> tuple[int, int]:
    """The ratio closest to ``prefill:decode`` in log P/D."""
    target = math.log(prefill / decode)
    return min(ratios, key=lambda r: abs(math.log(r[0] / r[1]) - target))


def evaluate_workload(workload: Workload, costs: Costs, args: argparse.Namespace) -> dict[str, Any]:
    ratios: list[tuple[int, int]] = args.ratios
    runs = {r: simulate(workload, *split(args.total_workers, r), costs, args) for r in ratios}
    # The planner's walk: from 1:1 (or the middle ratio), follow its recommendation.
    current = (1, 1) if (1, 1) in ratios else ratios[len(ratios) // 2]
    path = [current]
    for _ in range(len(ratios)):
        rec = runs[current].recommendation
        nxt = nearest(ratios, rec.prefill, rec.decode)
        if nxt == current:
            break
        current = nxt
        path.append(current)
    best = max(run.goodput for run in runs.values())
    pick = runs[current]
    return {
        "workload": workload.name,
        "shapes": [list(s) for s in workload.shapes],
        "rate": workload.rate,
        "ratios": [
            {
                "ratio": f"{p}:{d}",
                "prefill": run.prefill,
                "decode": run.decode,
                "finished": run.finished,
                "good": run.good,
                "goodput": round(run.goodput, 3),
                "ttft_p90_s": round(run.ttft_p90_s, 4),
                "tpot_p90_s": round(run.tpot_p90_s, 5),
                "recommended": [run.recommendation.prefill, run.recommendation.decode],
                "demand": [
                    round(run.recommendation.prefill_demand, 3),
                    round(run.recommendation.decode_demand, 3),
                ],
            }
            for (p, d), run in runs.items()
        ],
        "planner_path": [f"{p}:{d}" for p, d in path],
        "planner_pick": f"{current[0]}:{current[1]}",
        "best_goodput": round(best, 3),
        "best": [
            f"{p}:{d}" for (p, d), run in runs.items() if run.goodput >= best * (1 - args.tie)
        ],
        "pick_is_best": pick.goodput >= best * (1 - args.tie),
    }


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(
        prog="python -m benchmarks.sim_planner",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    ap.add_argument("--total-workers", type=int, default=12, help="(default: %(default)s)")
    ap.add_argument(
        "--ratios",
        type=parse_ratio,
        nargs="+",
        default=[(1, 3), (1, 2), (1, 1), (2, 1), (3, 1)],
        help="P:D ratios to try (default: 1:3 1:2 1:1 2:1 3:1)",
    )
    ap.add_argument(
        "--workloads",
        nargs="+",
        choices=[w.name for w in WORKLOADS],
        default=[w.name for w in WORKLOADS],
        help="(default: all)",
    )
    ap.add_argument(
        "--rate-scale",
        type=float,
        default=1.0,
        help="multiplies each workload's rate ("
        + ", ".join(f"{w.name} {w.rate:g}/s" for w in WORKLOADS)
        + ") (default: %(default)s)",
    )
    ap.add_argument(
        "--duration-s",
        type=float,
        default=150.0,
        help="simulated seconds of arrivals (default: %(default)s)",
    )
    ap.add_argument(
        "--warmup-s",
        type=float,
        default=60.0,
        help="goodput counts the requests that finish after this, once the pools' batches "
        "have built up (default: %(default)s)",
    )
    ap.add_argument("--slo-ttft-s", type=float, default=1.0, help="(default: %(default)s)")
    ap.add_argument("--slo-tpot-s", type=float, default=0.05, help="(default: %(default)s)")
    ap.add_argument(
        "--window-s", type=float, default=30.0, help="the planner's window (default: %(default)s)"
    )
    ap.add_argument(
        "--decode-step-floor-s",
        type=float,
        default=0.00479,
        help="the planner's --planner-decode-step-floor-s: bench_engine's batch-1 decode "
        "step on the H200; 0: auto (default: %(default)s)",
    )
    ap.add_argument(
        "--scrape-s",
        type=float,
        default=5.0,
        help="stats polls and planner evaluations every (default: %(default)s)",
    )
    ap.add_argument(
        "--tie",
        type=float,
        default=0.02,
        help="goodputs within this fraction of the best count as best: runs whose pools all "
        "keep up differ by about 1%% from where the window cuts them (default: %(default)s)",
    )
    ap.add_argument("--seed", type=int, default=0, help="(default: %(default)s)")
    costs = ap.add_argument_group("cost model (H200, Llama-3.1-8B; docs/benchmarks.md)")
    costs.add_argument("--decode-base-ms", type=float, default=4.7, help="(default: %(default)s)")
    costs.add_argument("--decode-row-ms", type=float, default=0.0171, help="(default: %(default)s)")
    costs.add_argument("--decode-kv-ns", type=float, default=38.0, help="(default: %(default)s)")
    costs.add_argument("--prefill-tok-s", type=float, default=45400, help="(default: %(default)s)")
    costs.add_argument("--prefill-quad-ns", type=float, default=1.1, help="(default: %(default)s)")
    costs.add_argument("--prefill-floor-ms", type=float, default=4.7, help="(default: %(default)s)")
    costs.add_argument("--token-budget", type=int, default=8192, help="(default: %(default)s)")
    costs.add_argument("--transfer-ms", type=float, default=2.0, help="(default: %(default)s)")
    costs.add_argument("--max-running", type=int, default=256, help="(default: %(default)s)")
    costs.add_argument(
        "--kv-tokens",
        type=int,
        default=55_690 * PAGE,
        help="KV pool per decode worker (default: %(default)s, 55,690 pages of 16)",
    )
    ap.add_argument("--output-file", default=None, help="JSON record (default: results dir)")
    return ap


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    for r in args.ratios:
        split(args.total_workers, r)
    costs = Costs(
        args.decode_base_ms,
        args.decode_row_ms,
        args.decode_kv_ns,
        args.prefill_tok_s,
        args.prefill_quad_ns,
        args.prefill_floor_ms,
        args.token_budget,
        args.transfer_ms,
        args.max_running,
        args.kv_tokens,
    )
    t0 = time.perf_counter()
    results = []
    for w in WORKLOADS:
        if w.name not in args.workloads:
            continue
        res = evaluate_workload(w._replace(rate=w.rate * args.rate_scale), costs, args)
        results.append(res)
        print(f"{res['workload']} at {res['rate']:g} req/s:")
        for row in res["ratios"]:
            print(
                f"  {row['ratio']:>4} ({row['prefill']}P+{row['decode']}D): goodput "
                f"{row['goodput']:7.2f} req/s, TTFT p90 {row['ttft_p90_s']:.3f} s, TPOT p90 "
                f"{row['tpot_p90_s'] * 1e3:.1f} ms, recommends {row['recommended'][0]}P "
                f"{row['recommended'][1]}D"
            )
        verdict = "best" if res["pick_is_best"] else "NOT the best"
        print(
            f"  planner: {' -> '.join(res['planner_path'])}, picks {res['planner_pick']} "
            f"({verdict}; best within --tie: {', '.join(res['best'])})",
            flush=True,
        )
    body = {
        "costs": costs._asdict(),
        "slo_ttft_s": args.slo_ttft_s,
        "slo_tpot_s": args.slo_tpot_s,
        "total_workers": args.total_workers,
        "duration_s": args.duration_s,
        "wall_s": round(time.perf_counter() - t0, 2),
        "workloads": results,
        "planner_picks_best": all(r["pick_is_best"] for r in results),
    }
    print(json.dumps({"planner_picks_best": body["planner_picks_best"], "wall_s": body["wall_s"]}))
    write_record("benchmarks.sim_planner", argv, body, args.output_file, "sim-planner")
    return 0 if body["planner_picks_best"] else 1


if __name__ == "__main__":
    raise SystemExit(main())
