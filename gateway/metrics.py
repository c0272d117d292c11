"""Prometheus metrics of the gateway, rendered in the text format."""

from __future__ import annotations

import bisect
import time
from collections import defaultdict

from gateway.planner import LatencySample, Planner, PlannerConfig
from gateway.routing import Router
from gateway.stages import StageMetrics
from protocol.tracing import StageSpans

_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)


class Histogram:
    def __init__(self, name: str, help_: str) -> None:
        self.name, self.help = name, help_
        self.counts = [0] * (len(_BUCKETS) + 1)
        self.total = 0.0
        self.n = 0

    def observe(self, seconds: float, times: int = 1) -> None:
        self.counts[bisect.bisect_left(_BUCKETS, seconds)] += times
        self.total += seconds * times
        self.n += times

    def render(self) -> list[str]:
        out = [f"# HELP {self.name} {self.help}", f"# TYPE {self.name} histogram"]
        acc = 0
        for bound, c in zip(_BUCKETS, self.counts):
            acc += c
            out.append(f'{self.name}_bucket{{le="{bound}"}} {acc}')
        out.append(f'{self.name}_bucket{{le="+Inf"}} {self.n}')
        out += [f"{self.name}_sum {self.total}", f"{self.name}_count {self.n}"]
        return out


class Counter:
    def __init__(self, name: str, help_: str, label: str) -> None:
        self.name, self.help, self.label = name, help_, label
        self.values: dict[str, int] = defaultdict(int)

    def inc(self, value: str) -> None:
        self.values[value] += 1

    def render(self) -> list[str]:
        out = [f"# HELP {self.name} {self.help}", f"# TYPE {self.name} counter"]
        out += [f'{self.name}{{{self.label}="{k}"}} {v}' for k, v in sorted(self.values.items())]
        return out


class GatewayMetrics:
    def __init__(self, planner: PlannerConfig | None = None) -> None:
        self.ttft = Histogram("gateway_time_to_first_token_seconds", "time to first token")
        self.itl = Histogram("gateway_inter_token_latency_seconds", "gap between streamed tokens")
        self.e2e = Histogram("gateway_e2e_request_latency_seconds", "request latency")
        self.requests = Counter("gateway_requests_total", "requests by endpoint", "endpoint")
        self.failures = Counter("gateway_request_failures_total", "failed requests by kind", "kind")
        self.stages = StageMetrics(StageSpans.from_env("gateway"))
        self.planner = Planner(planner)
        """Pool signals and recommended replicas (``gateway.planner``); fed by
        ``RequestTiming``, rendered with the rest."""

    def render(self, router: Router) -> str:
        lines: list[str] = []
        for m in (self.ttft, self.itl, self.e2e, self.requests, self.failures):
            lines += m.render()
        lines += self.stages.render()
        lines += [
            "# HELP gateway_worker_healthy 1 if the worker is taking requests",
            "# TYPE gateway_worker_healthy gauge",
        ]
        for w in router.workers():
            ok = 1 if router.is_available(w) else 0
            lines.append(f'gateway_worker_healthy{{url="{w.url}",role="{w.role}"}} {ok}')
        lines += self.planner.render(router.workers())
        return "\n".join(lines) + "\n"


class RequestTiming:
    """TTFT and ITL of each choice of a request, into the gateway's histograms."""

    def __init__(self, metrics: GatewayMetrics, n: int, started: float) -> None:
        self.metrics = metrics
        self.started = started
        self.last: list[float | None] = [None] * n
        self.samples: list[LatencySample | None] = [None] * n
        """Each choice's record in the planner's latency window."""

    def observe(self, i: int, num_tokens: int) -> None:
        """Choice ``i`` produced an event with ``num_tokens`` tokens. The tokens
        of one event reach the client together: after the first, each counts
        as a gap of 0 (so there is one ITL sample per token but the first)."""
        if not num_tokens:
            return
        t = time.monotonic()
        last = self.last[i]
        itl = self.metrics.itl
        if last is None:
            self.metrics.ttft.observe(t - self.started)
            window = self.metrics.planner.samples
            self.samples[i] = window.first_token(t, t - self.started, num_tokens)
        else:
            itl.observe(t - last)
            sample = self.samples[i]
            if sample is not None:
                sample.more(t, num_tokens)
        if num_tokens > 1:
            itl.observe(0.0, num_tokens - 1)
        self.last[i] = t
