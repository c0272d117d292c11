"""Demand signals of the prefill and decode pools, and the replica counts they call for.

The planner turns what the gateway already sees into per-pool signals and a
recommended number of prefill and decode replicas, exported on ``/metrics``
(``gateway_recommended_replicas{role=...}``) for an autoscaler to act on. It
starts and stops nothing itself.

Two halves, so that the rule can be tested without a gateway:

- I/O: ``Planner.snapshot`` reads the router's workers (their last polled
  ``/server_info`` stats and the gateway's own in-flight counts) and the
  latency samples of ``LatencyWindow`` (fed by ``gateway.metrics.RequestTiming``
  as tokens reach clients) into one ``PoolSignals`` record.
- Pure: ``recommend(signals, config)`` turns a ``PoolSignals`` into a
  ``Recommendation``; no clock, no state.

Signals (``PoolSignals``; workers that are down or draining do not count):

- prefill busy: the sum over prefill workers of the fraction of time each
  one's engine stepped over the window (``engine_step_seconds_total`` against
  ``uptime_seconds``, both from the worker, so no clock is shared).
- prefill service time: engine seconds per finished prefill request
  (``engine_step_seconds_total`` per ``transfers_ok``), and the throughput it
  implies, ``prefill_tokens_per_s`` (mean prompt tokens in flight on the
  prefill pool over the service time).
- prefill backlog: requests waiting or running on prefill engines, in tokens
  (times the mean prompt in flight) and in seconds of one worker's compute
  (times the service time); the queue time estimate is that work spread over
  the pool's workers.
- decode load: per decode worker, the larger of its KV utilization
  (``1 - available_pages / total_pages``) and its slot load (requests running,
  waiting or waiting for pages over ``max_running_requests``); the pool's
  KV utilization is the largest worker's.
- decode queue time: the 90th percentile of the gap between a choice's first
  token and the next (for a disaggregated request: the KV transfer's tail, the
  wait for a decode slot or pages, and one decode step).
- decode step floor: ``--planner-decode-step-floor-s``, or (auto) the lowest
  median TPOT of any evaluation so far.
- TTFT and TPOT: 50th (TPOT), 90th and 99th percentiles over the window, and the fraction
  of choices within ``--slo-ttft-s`` / ``--slo-tpot-s`` (attainment).

The rule (``recommend``), in replicas ("worker-equivalents" before rounding):

- prefill demand = busy / ``--planner-prefill-utilization`` + backlog seconds
  / ``--slo-ttft-s``: enough workers to keep up with the arrivals at the target
  busy fraction, plus enough to drain the queued prompt tokens within the TTFT
  objective at the measured per-worker throughput.
- decode demand = sum of the decode workers' loads / ``--planner-decode-utilization``,
  times how much longer a decode step gets at that target than now: the KV
  pages and batch slots in use, spread so that no worker passes the target,
  corrected for the steps lengthening with the batch (linear from
  ``--planner-decode-step-floor-s`` at batch 1 to the median TPOT at the
  current batch; ``_step_growth``). Without the correction a pool measured
  with room to spare would look as if half of it could go.
- a pool whose objective is missed (TTFT p90 over ``--slo-ttft-s`` for
  prefill, TPOT p90 over ``--slo-tpot-s`` for decode) gets at least one
  replica more than it has and never shrinks.
- recommended = ceil(demand), never below 1, at most ``--planner-max-scale``
  times the current count (one replica more at least) and at most one replica
  fewer per evaluation: a pool grows fast and shrinks slowly (a pool shrunk
  too far shows it in the windows that follow before it shrinks again), and
  one noisy window moves it a bounded amount.
"""

from __future__ import annotations

import math
import time
from collections import deque
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any, NamedTuple

from gateway.routing.workers import POOL_ROLES, WorkerInfo
from protocol.roles import DECODE, PREFILL
from protocol.settings import setting

PLANNER_GROUP = "planner (pool signals and recommended replicas on /metrics)"

MAX_SAMPLES = 20_000
"""Latency samples the window keeps at most (the newest): bounds memory and
the cost of a /metrics scrape under any request rate."""


@dataclass(frozen=True)
class PlannerConfig:
    slo_ttft_s: float = setting(
        1.0,
        help="time-to-first-token objective in seconds: the planner judges the 90th "
        "percentile against it and sizes prefill to drain its backlog within it "
        "(default: %(default)s)",
        group=PLANNER_GROUP,
    )
    slo_tpot_s: float = setting(
        0.05,
        help="time-per-output-token objective in seconds, judged on the 90th percentile "
        "(default: %(default)s)",
        group=PLANNER_GROUP,
    )
    planner_window_s: float = setting(
        60.0,
        help="the planner's latency percentiles and worker rates cover this many seconds "
        "(default: %(default)s)",
        group=PLANNER_GROUP,
    )
    planner_prefill_utilization: float = setting(
        0.7,
        help="busy fraction of a prefill worker the recommendation aims at (default: %(default)s)",
        group=PLANNER_GROUP,
    )
    planner_decode_utilization: float = setting(
        0.8,
        help="KV or batch-slot utilization of a decode worker the recommendation aims at "
        "(default: %(default)s)",
        group=PLANNER_GROUP,
    )
    planner_decode_step_floor_s: float | None = setting(
        None,
        help="a decode worker's step time at batch 1 (bench_engine's figure for the model "
        "and GPU), from which the planner extrapolates how decode steps lengthen as a "
        "smaller pool's batches grow; auto: the lowest median TPOT this gateway has seen "
        "(default: auto)",
        group=PLANNER_GROUP,
        metavar="SECONDS",
        minimum=0,
    )
    planner_max_scale: float = setting(
        2.0,
        help="one evaluation grows a pool's recommended replicas by at most this factor "
        "(one replica at least); it shrinks them by one replica at most "
        "(default: %(default)s)",
        group=PLANNER_GROUP,
    )

    def __post_init__(self) -> None:
        if min(self.slo_ttft_s, self.slo_tpot_s, self.planner_window_s) <= 0:
            raise ValueError("slo_ttft_s, slo_tpot_s and planner_window_s must be > 0")
        for name in ("planner_prefill_utilization", "planner_decode_utilization"):
            if not 0 < getattr(self, name) <= 1:
                raise ValueError(f"{name} must be in (0, 1]")
        if self.planner_decode_step_floor_s is not None and self.planner_decode_step_floor_s < 0:
            raise ValueError("planner_decode_step_floor_s must be >= 0")
        if self.planner_max_scale < 1:
            raise ValueError("planner_max_scale must be >= 1")


# -- latency samples -------------------------------------------------------------


class LatencySample:
    """The token times of one choice, updated in place as its tokens reach the
    client (a record in ``LatencyWindow`` from its first token on)."""

    __slots__ = ("first", "last", "second_gap", "tokens", "ttft")

    def __init__(self, t: float, ttft: float, tokens: int) -> None:
        self.first = self.last = t
        self.ttft = ttft
        self.tokens = tokens
        self.second_gap: float | None = None
        """From the first token's event to the next event (None: no next yet)."""

    def more(self, t: float, tokens: int) -> None:
        """``tokens`` more tokens reached the client at ``t``."""
        if self.second_gap is None:
            self.second_gap = t - self.first
        self.last = t
        self.tokens += tokens

    @property
    def tpot(self) -> float | None:
        """Time per output token after the first (None: one token so far)."""
        return (self.last - self.first) / (self.tokens - 1) if self.tokens > 1 else None


class LatencySummary(NamedTuple):
    """Percentiles and SLO attainment over the window (None: no sample)."""

    samples: int
    ttft_p90: float | None = None
    ttft_p99: float | None = None
    tpot_p90: float | None = None
    tpot_p99: float | None = None
    tpot_p50: float | None = None
    ttft_attainment: float | None = None
    tpot_attainment: float | None = None
    second_gap_p90: float | None = None


def quantile(sorted_values: list[float], q: float) -> float | None:
    """The nearest-rank ``q`` quantile of ascending ``sorted_values``."""
    if not sorted_values:
        return None
    rank = max(1, math.ceil(q * len(sorted_values)))
    return sorted_values[rank - 1]


class LatencyWindow:
    """The choices whose first token came within the last ``window_s`` seconds
    (at most ``MAX_SAMPLES``, the newest). Samples go in in time order."""

    def __init__(self, window_s: float, clock: Callable[[], float] = time.monotonic) -> None:
        self.window_s = window_s
        self.clock = clock
        self._samples: deque[LatencySample] = deque(maxlen=MAX_SAMPLES)

    def first_token(self, t: float, ttft: float, tokens: int = 1) -> LatencySample:
        """A choice's first event (``tokens`` tokens) reached the client at
        ``t``, ``ttft`` after the request came; returns its sample, which the
        caller updates with ``LatencySample.more``."""
        sample = LatencySample(t, ttft, tokens)
        self._samples.append(sample)
        return sample

    def __len__(self) -> int:
        return len(self._samples)

    def summary(self, slo_ttft_s: float, slo_tpot_s: float) -> LatencySummary:
        """Percentiles and attainment of the samples in the window; older ones
        are dropped."""
        horizon = self.clock() - self.window_s
        samples = self._samples
        while samples and samples[0].first < horizon:
            samples.popleft()
        if not samples:
            return LatencySummary(0)
        ttft = sorted(s.ttft for s in samples)
        tpot = sorted(x for s in samples if (x := s.tpot) is not None)
        gaps = sorted(s.second_gap for s in samples if s.second_gap is not None)
        return LatencySummary(
            samples=len(samples),
            ttft_p90=quantile(ttft, 0.9),
            ttft_p99=quantile(ttft, 0.99),
            tpot_p90=quantile(tpot, 0.9),
            tpot_p99=quantile(tpot, 0.99),
            tpot_p50=quantile(tpot, 0.5),
            ttft_attainment=sum(x <= slo_ttft_s for x in ttft) / len(ttft),
            tpot_attainment=sum(x <= slo_tpot_s for x in tpot) / len(tpot) if tpot else None,
            second_gap_p90=quantile(gaps, 0.9),
        )


# -- the snapshot and the rule ------------------------------------------------------


class PoolSignals(NamedTuple):
    """What the rule reads: one snapshot of both pools."""

    prefill_replicas: int
    """Prefill workers that are up (healthy, not draining)."""
    decode_replicas: int
    """Decode-pool workers ("decode" and "both") that are up."""
    prefill_busy: float = 0.0
    """Sum of the prefill workers' busy fractions over the window."""
    prefill_queued: int = 0
    """Requests waiting or running on the prefill engines."""
    prefill_service_s: float | None = None
    """Engine seconds per finished prefill request (None: none finished yet)."""
    prefill_backlog_tokens: float = 0.0
    """``prefill_queued`` times the mean prompt in flight on the prefill pool."""
    prefill_tokens_per_s: float | None = None
    """Prompt tokens one prefill worker computes per busy second."""
    decode_load: float = 0.0
    """Sum over decode workers of max(KV utilization, slot load)."""
    decode_kv_utilization: float = 0.0
    """The largest decode worker's KV utilization."""
    decode_requests: float = 0.0
    """Requests running or waiting per decode worker (mean)."""
    decode_step_floor_s: float | None = None
    """A decode step's time at batch 1 (configured, or the lowest median TPOT seen)."""
    decode_queued: int = 0
    """Requests waiting for a slot or for pages on the decode workers."""
    latency: LatencySummary = LatencySummary(0)

    @property
    def prefill_backlog_s(self) -> float:
        """Seconds of one prefill worker's compute queued (0: unknown service time)."""
        return self.prefill_queued * (self.prefill_service_s or 0.0)

    @property
    def prefill_queue_s(self) -> float:
        """Estimated wait of a new prompt: the backlog spread over the pool."""
        return self.prefill_backlog_s / max(1, self.prefill_replicas)


class Recommendation(NamedTuple):
    prefill: int
    decode: int
    prefill_demand: float
    """Prefill workers the signals call for, before rounding and bounds."""
    decode_demand: float


def recommend(signals: PoolSignals, config: PlannerConfig) -> Recommendation:
    """The replica counts ``signals`` call for under ``config`` (the rule of
    the module's docstring)."""
    lat = signals.latency
    prefill_demand = (
        signals.prefill_busy / config.planner_prefill_utilization
        + signals.prefill_backlog_s / config.slo_ttft_s
    )
    decode_demand = (
        signals.decode_load / config.planner_decode_utilization * _step_growth(signals, config)
    )
    ttft_missed = lat.ttft_p90 is not None and lat.ttft_p90 > config.slo_ttft_s
    tpot_missed = lat.tpot_p90 is not None and lat.tpot_p90 > config.slo_tpot_s
    return Recommendation(
        prefill=_replicas(prefill_demand, signals.prefill_replicas, ttft_missed, config),
        decode=_replicas(decode_demand, signals.decode_replicas, tpot_missed, config),
        prefill_demand=prefill_demand,
        decode_demand=decode_demand,
    )


def _step_growth(signals: PoolSignals, config: PlannerConfig) -> float:
    """How many times the load rule's decode workers the pool needs, once its
    steps lengthen with the larger batches of the target (>= 1).

    Decode steps lengthen with the batch: t(c) = floor + k * c for c requests
    per worker, k from now (t(c) = the median TPOT). The load rule fills each
    worker to c_u = c * target / load requests; it delivers c_u / t(c_u)
    tokens per second, not the c_u / t(c) the rule assumes, and where t(c_u)
    would pass the TPOT objective it may hold only c* < c_u requests. The pool
    needs (c_u / c*) * (t(c*) / t(c)) times the rule's workers: a pool
    measured with room to spare (small batches, short steps) needs more than
    its load says.
    """
    step, floor = signals.latency.tpot_p50, signals.decode_step_floor_s
    c, load = signals.decode_requests, signals.decode_load / max(1, signals.decode_replicas)
    if step is None or floor is None or step <= floor or c <= 0 or load <= 0:
        return 1.0
    k = (step - floor) / c
    filled = c * config.planner_decode_utilization / load
    held = min(filled, max(c, (config.slo_tpot_s - floor) / k))
    return max(1.0, filled / held * (floor + k * held) / step)


def _replicas(demand: float, current: int, slo_missed: bool, config: PlannerConfig) -> int:
    want = math.ceil(demand - 1e-9)
    if slo_missed:
        want = max(want, current + 1)
    # Up fast, down slowly: a pool measured while it has room to spare
    # understates what a smaller one needs (its batches, and so its steps,
    # grow as it shrinks), so it gives back one replica per evaluation.
    upper = max(current + 1, math.floor(current * config.planner_max_scale))
    lower = current if slo_missed else current - 1
    return max(1, lower, min(upper, want))


# -- reading the workers ------------------------------------------------------------


class _Counters(NamedTuple):
    uptime_s: float
    step_s: float
    done: float


class _WorkerRates:
    """One worker's counter readings over the window, by its own uptime clock."""

    def __init__(self) -> None:
        self.readings: deque[_Counters] = deque()

    def add(self, reading: _Counters, window_s: float) -> None:
        last = self.readings[-1] if self.readings else None
        if last is not None and reading.uptime_s < last.uptime_s:
            self.readings.clear()  # a new process at the same URL
        elif last is not None and reading.uptime_s == last.uptime_s:
            return  # not polled since
        self.readings.append(reading)
        # Keep one reading at or before the window's start, so the rates span it.
        while len(self.readings) > 2 and self.readings[1].uptime_s <= reading.uptime_s - window_s:
            self.readings.popleft()

    def deltas(self) -> _Counters | None:
        if len(self.readings) < 2:
            return None
        a, b = self.readings[0], self.readings[-1]
        return _Counters(b.uptime_s - a.uptime_s, b.step_s - a.step_s, b.done - a.done)


def _number(stats: dict[str, Any], key: str) -> float:
    value = stats.get(key, 0)
    return float(value) if isinstance(value, int | float) and not isinstance(value, bool) else 0.0


def _text(value: float) -> str:
    return str(value) if isinstance(value, int) else repr(round(float(value), 6))


def _up(worker: WorkerInfo) -> bool:
    return worker.healthy and not worker.draining and worker.refused is None


class Planner:
    """Keeps the latency window and the workers' counter history; each
    ``evaluate`` reads the workers into ``PoolSignals`` and applies ``recommend``."""

    def __init__(
        self, config: PlannerConfig | None = None, clock: Callable[[], float] = time.monotonic
    ) -> None:
        self.config = config or PlannerConfig()
        self.samples = LatencyWindow(self.config.planner_window_s, clock)
        self._rates: dict[str, _WorkerRates] = {}
        self._fastest_tpot: float | None = None
        """The lowest median TPOT of any evaluation: the step floor's estimate."""

    def configure(self, config: PlannerConfig) -> None:
        """Use ``config`` from now on (the command line's, once it is known);
        the samples and rates gathered so far stay."""
        self.config = config
        self.samples.window_s = config.planner_window_s

    def snapshot(self, workers: Iterable[WorkerInfo]) -> PoolSignals:
        cfg = self.config
        prefill = [w for w in workers if w.role in POOL_ROLES[PREFILL] and _up(w)]
        decode = [w for w in workers if w.role in POOL_ROLES[DECODE] and _up(w)]

        busy = step_s = done = 0.0
        queued = 0
        seen: set[str] = set()
        for w in prefill:
            s = w.stats
            queued += int(_number(s, "waiting") + _number(s, "running"))
            if "uptime_seconds" not in s:
                continue
            seen.add(w.url)
            rates = self._rates.setdefault(w.url, _WorkerRates())
            reading = _Counters(
                _number(s, "uptime_seconds"),
                _number(s, "engine_step_seconds_total"),
                _number(s, "transfers_ok"),
            )
            rates.add(reading, cfg.planner_window_s)
            d = rates.deltas()
            if d is not None and d.uptime_s > 0:
                busy += min(1.0, max(0.0, d.step_s / d.uptime_s))
                step_s += max(0.0, d.step_s)
                done += max(0.0, d.done)
        for url in set(self._rates) - seen:
            del self._rates[url]
        service_s = step_s / done if done > 0 else None
        in_flight = sum(w.outstanding_requests for w in prefill)
        mean_prompt = sum(w.outstanding_tokens for w in prefill) / in_flight if in_flight else 0.0

        load = kv_max = requests = 0.0
        decode_queued = 0
        for w in decode:
            s = w.stats
            total = _number(s, "total_pages")
            kv = 1.0 - _number(s, "available_pages") / total if total > 0 else 0.0
            kv = min(1.0, max(0.0, kv))
            waiting = int(_number(s, "waiting") + _number(s, "prealloc"))
            decode_queued += waiting
            requests += _number(s, "running") + waiting
            slots = w.info.get("max_running_requests")
            slot_load = 0.0
            if isinstance(slots, int) and slots > 0:
                slot_load = (_number(s, "running") + waiting) / slots
            load += max(kv, slot_load)
            kv_max = max(kv_max, kv)

        latency = self.samples.summary(cfg.slo_ttft_s, cfg.slo_tpot_s)
        if latency.tpot_p50 is not None and decode:
            seen_min = self._fastest_tpot
            self._fastest_tpot = min(seen_min, latency.tpot_p50) if seen_min else latency.tpot_p50
        floor = cfg.planner_decode_step_floor_s
        return PoolSignals(
            prefill_replicas=len(prefill),
            decode_replicas=len(decode),
            prefill_busy=busy,
            prefill_queued=queued,
            prefill_service_s=service_s,
            prefill_backlog_tokens=queued * mean_prompt,
            prefill_tokens_per_s=mean_prompt / service_s if service_s and mean_prompt else None,
            decode_load=load,
            decode_kv_utilization=kv_max,
            decode_queued=decode_queued,
            decode_requests=requests / len(decode) if decode else 0.0,
            decode_step_floor_s=self._fastest_tpot if floor is None else floor,
            latency=latency,
        )

    def evaluate(self, workers: Iterable[WorkerInfo]) -> tuple[PoolSignals, Recommendation]:
        signals = self.snapshot(list(workers))
        return signals, recommend(signals, self.config)

    def render(self, workers: Iterable[WorkerInfo]) -> list[str]:
        """The signals and the recommendation in the Prometheus text format
        (gauges; a signal with no sample in the window is left out)."""
        signals, rec = self.evaluate(workers)
        lat = signals.latency
        cfg = self.config
        out: list[str] = []

        def gauge(name: str, help_: str, values: list[tuple[str, float | None]]) -> None:
            rows = [(labels, v) for labels, v in values if v is not None]
            if not rows:
                return
            out.extend((f"# HELP {name} {help_}", f"# TYPE {name} gauge"))
            out.extend(f"{name}{{{labels}}} {_text(v)}" for labels, v in rows)

        p, d = f'role="{PREFILL}"', f'role="{DECODE}"'
        gauge(
            "gateway_pool_replicas",
            "workers of the pool that are up",
            [(p, signals.prefill_replicas), (d, signals.decode_replicas)],
        )
        gauge(
            "gateway_pool_queue_seconds",
            "estimated wait before a request's work starts on the pool (prefill: queued "
            "compute over the workers; decode: p90 gap from first to second token)",
            [(p, signals.prefill_queue_s), (d, lat.second_gap_p90)],
        )
        gauge(
            "gateway_pool_backlog_tokens",
            "prompt tokens waiting or running on the prefill engines",
            [(p, signals.prefill_backlog_tokens)],
        )
        gauge(
            "gateway_pool_queued_requests",
            "requests waiting on the pool's engines",
            [(p, signals.prefill_queued), (d, signals.decode_queued)],
        )
        gauge(
            "gateway_pool_busy",
            "prefill: sum of the workers' busy fractions; decode: sum of the workers' "
            "max(KV utilization, slot load)",
            [(p, signals.prefill_busy), (d, signals.decode_load)],
        )
        gauge(
            "gateway_pool_prefill_tokens_per_second",
            "prompt tokens one prefill worker computes per busy second",
            [(p, signals.prefill_tokens_per_s)],
        )
        gauge(
            "gateway_pool_kv_utilization",
            "KV pool utilization of the fullest decode worker",
            [(d, signals.decode_kv_utilization)],
        )
        gauge(
            "gateway_latency_window_seconds",
            "TTFT and TPOT percentiles over the planner's window",
            [
                ('slo="ttft",quantile="0.9"', lat.ttft_p90),
                ('slo="ttft",quantile="0.99"', lat.ttft_p99),
                ('slo="tpot",quantile="0.9"', lat.tpot_p90),
                ('slo="tpot",quantile="0.99"', lat.tpot_p99),
            ],
        )
        gauge(
            "gateway_slo_target_seconds",
            "the latency objectives (--slo-ttft-s, --slo-tpot-s)",
            [('slo="ttft"', cfg.slo_ttft_s), ('slo="tpot"', cfg.slo_tpot_s)],
        )
        gauge(
            "gateway_slo_attainment",
            "fraction of the window's choices within the objective",
            [('slo="ttft"', lat.ttft_attainment), ('slo="tpot"', lat.tpot_attainment)],
        )
        gauge(
            "gateway_recommended_replicas",
            "replicas of each pool the planner's rule calls for",
            [(p, rec.prefill), (d, rec.decode)],
        )
        return out
