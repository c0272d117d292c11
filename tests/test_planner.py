"""The planner: its rule on hand-made signals, the signals it reads from the
router's workers and the gateway's latency samples, its metrics and flags, and
the simulated fleet on which it must pick the best prefill:decode ratio."""

from __future__ import annotations

import json
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest

from gateway.__main__ import _gateway_config, build_parser, main
from gateway.config import GatewayConfig
from gateway.dispatch import Dispatcher
from gateway.metrics import GatewayMetrics, RequestTiming
from gateway.planner import (
    LatencySummary,
    LatencyWindow,
    Planner,
    PlannerConfig,
    PoolSignals,
    recommend,
)
from gateway.routing import HealthChecker, Router, RouterConfig, WorkerInfo
from gateway.state import GatewayState
from protocol.settings import CLUSTER_TOKEN_ENV

REPO = Path(__file__).resolve().parent.parent
CFG = PlannerConfig(slo_ttft_s=1.0, slo_tpot_s=0.05)


@pytest.fixture(autouse=True)
def no_env_defaults(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(CLUSTER_TOKEN_ENV, raising=False)


def signals(**fields: object) -> PoolSignals:
    base: dict[str, object] = {"prefill_replicas": 2, "decode_replicas": 4}
    return PoolSignals(**{**base, **fields})  # type: ignore[arg-type]


# -- the rule ----------------------------------------------------------------------


def test_a_growing_prefill_backlog_raises_prefill() -> None:
    steady = signals(prefill_busy=1.0, prefill_service_s=0.1)
    # 1.0 busy worker at a 0.7 target: 2 workers, as many as there are.
    assert recommend(steady, CFG).prefill == 2
    counts = [recommend(steady._replace(prefill_queued=q), CFG).prefill for q in (0, 10, 20, 40)]
    assert counts == sorted(counts) and counts[0] < counts[-1], counts
    # 10 queued x 0.1 s = 1 s of compute to drain within the 1 s objective:
    # one worker more than the arrivals need (1.43 + 1.0 -> 3).
    assert recommend(steady._replace(prefill_queued=10), CFG).prefill == 3


def test_prefill_throughput_sizes_the_backlog() -> None:
    # The same queue takes twice the workers when each prompt takes twice as long.
    queued = signals(prefill_replicas=8, prefill_queued=40)
    fast = recommend(queued._replace(prefill_service_s=0.05), CFG)
    slow = recommend(queued._replace(prefill_service_s=0.1), CFG)
    assert (fast.prefill_demand, slow.prefill_demand) == pytest.approx((2.0, 4.0))


def test_kv_utilization_and_tpot_raise_decode() -> None:
    calm = signals(decode_load=4 * 0.5)
    assert recommend(calm, CFG).decode == 3  # 2.0 / 0.8 = 2.5, one down per evaluation
    full = signals(decode_load=4 * 0.95, decode_kv_utilization=0.95)
    assert recommend(full, CFG).decode == 5  # 3.8 / 0.8 = 4.75
    slow = calm._replace(latency=LatencySummary(100, tpot_p90=0.08))
    assert recommend(slow, CFG).decode == 5  # the objective is missed: one more


def test_a_missed_objective_never_shrinks_a_pool() -> None:
    idle = signals(prefill_replicas=3, decode_replicas=3)
    assert recommend(idle, CFG)[:2] == (2, 2)
    missed = idle._replace(latency=LatencySummary(100, ttft_p90=1.5, tpot_p90=0.06))
    assert recommend(missed, CFG)[:2] == (4, 4)
    met = idle._replace(latency=LatencySummary(100, ttft_p90=0.5, tpot_p90=0.04))
    assert recommend(met, CFG)[:2] == (2, 2)


def test_idle_pools_go_down_one_at_a_time_to_one() -> None:
    s = signals(prefill_replicas=5, decode_replicas=3)
    seen = []
    for _ in range(6):
        rec = recommend(s, CFG)
        seen.append((rec.prefill, rec.decode))
        s = s._replace(prefill_replicas=rec.prefill, decode_replicas=rec.decode)
    assert seen == [(4, 2), (3, 1), (2, 1), (1, 1), (1, 1), (1, 1)]
    # Empty pools (all workers down) are recommended one replica each.
    assert recommend(signals(prefill_replicas=0, decode_replicas=0), CFG)[:2] == (1, 1)


@pytest.mark.parametrize(
    ("scale", "current", "expected"), [(2.0, 3, 6), (2.0, 1, 2), (1.5, 4, 6), (1.0, 4, 5)]
)
def test_growth_per_evaluation_is_bounded(scale: float, current: int, expected: int) -> None:
    cfg = PlannerConfig(planner_max_scale=scale)
    s = signals(prefill_replicas=current, decode_replicas=current)
    rec = recommend(s._replace(prefill_busy=50.0, decode_load=50.0), cfg)
    assert (rec.prefill, rec.decode) == (expected, expected)
    assert rec.prefill_demand > expected and rec.decode_demand > expected


def test_decode_demand_counts_longer_steps_at_the_target() -> None:
    # 4 workers with 50 requests each at 20% load and 10 ms steps; at the
    # target (80%) each holds 200 requests: with a 5 ms floor, the step grows
    # linearly to 5 + 5 * 200 / 50 = 25 ms, so 2.5x the plain load rule.
    s = signals(
        decode_load=4 * 0.2,
        decode_requests=50,
        latency=LatencySummary(100, tpot_p50=0.010),
    )
    plain = recommend(s, CFG).decode_demand
    assert plain == pytest.approx(1.0)
    assert recommend(s._replace(decode_step_floor_s=0.005), CFG).decode_demand == pytest.approx(2.5)
    # A 20 ms objective stops a worker at c = 150 (t = 20 ms) short of 200:
    # 200 / 150 times the workers, each step 2x as long.
    tight = PlannerConfig(slo_ttft_s=1.0, slo_tpot_s=0.02)
    capped = recommend(s._replace(decode_step_floor_s=0.005), tight).decode_demand
    assert capped == pytest.approx(1.0 * 200 / 150 * 2)
    # Steps never count as getting shorter: an overloaded pool keeps its load.
    over = s._replace(decode_load=4 * 1.5, decode_step_floor_s=0.005)
    assert recommend(over, CFG).decode_demand == pytest.approx(6.0 / 0.8)


def test_config_refuses_nonsense() -> None:
    for bad in (
        {"slo_ttft_s": 0},
        {"slo_tpot_s": -1},
        {"planner_window_s": 0},
        {"planner_prefill_utilization": 1.5},
        {"planner_decode_utilization": 0},
        {"planner_max_scale": 0.5},
        {"planner_decode_step_floor_s": -0.1},
    ):
        with pytest.raises(ValueError):
            PlannerConfig(**bad)  # type: ignore[arg-type]


# -- the signals -------------------------------------------------------------------


def prefill_worker(url: str, **stats: float) -> WorkerInfo:
    w = WorkerInfo(url=url, role="prefill")
    w.stats = dict(stats)
    return w


def test_prefill_signals_come_from_the_workers_counters() -> None:
    planner = Planner(CFG)
    a = prefill_worker(
        "http://a", uptime_seconds=100, engine_step_seconds_total=10, transfers_ok=50
    )
    b = prefill_worker("http://b", uptime_seconds=40, engine_step_seconds_total=4, transfers_ok=20)
    first = planner.snapshot([a, b])
    assert first.prefill_busy == 0 and first.prefill_service_s is None  # one reading each
    # Ten seconds later (each by its own clock): a was busy 8 of them for 40
    # requests, b 3 of them for 20; a has 6 requests queued, b 2.
    a.stats.update(uptime_seconds=110, engine_step_seconds_total=18, transfers_ok=90, waiting=5)
    a.stats["running"] = 1
    b.stats.update(uptime_seconds=50, engine_step_seconds_total=7, transfers_ok=40, waiting=2)
    a.outstanding_requests, a.outstanding_tokens = 3, 3000
    b.outstanding_requests, b.outstanding_tokens = 1, 1000
    s = planner.snapshot([a, b])
    assert s.prefill_replicas == 2
    assert s.prefill_busy == pytest.approx(0.8 + 0.3)
    assert s.prefill_service_s == pytest.approx(11 / 60)
    assert s.prefill_queued == 8
    assert s.prefill_backlog_tokens == pytest.approx(8 * 1000)
    assert s.prefill_tokens_per_s == pytest.approx(1000 / (11 / 60))
    assert s.prefill_queue_s == pytest.approx(8 * 11 / 60 / 2)
    # No new poll: the same numbers.
    assert planner.snapshot([a, b]).prefill_busy == pytest.approx(1.1)
    # b restarted (its uptime went back): its history starts over.
    b.stats.update(uptime_seconds=5, engine_step_seconds_total=1, transfers_ok=3)
    assert planner.snapshot([a, b]).prefill_busy == pytest.approx(0.8)
    # A worker that is down or draining does not count.
    b.healthy, a.draining = False, True
    assert planner.snapshot([a, b])[:3] == (0, 0, 0.0)


def test_decode_signals_come_from_pages_and_slots() -> None:
    planner = Planner(CFG)
    d1 = WorkerInfo(url="http://d1", role="decode")
    d1.stats = {"total_pages": 1000, "available_pages": 100, "running": 10, "waiting": 0}
    d1.info = {"max_running_requests": 256}
    d2 = WorkerInfo(url="http://d2", role="both")
    d2.stats = {"total_pages": 1000, "available_pages": 800, "running": 200, "prealloc": 56}
    d2.info = {"max_running_requests": 256}
    s = planner.snapshot([d1, d2])
    assert s.decode_replicas == 2
    assert s.decode_kv_utilization == pytest.approx(0.9)
    assert s.decode_load == pytest.approx(0.9 + 1.0)  # KV-bound, then slot-bound
    assert s.decode_queued == 56
    assert s.decode_requests == pytest.approx((10 + 256) / 2)
    assert recommend(s, CFG).decode == 3  # 1.9 / 0.8 = 2.4


def test_latency_window_percentiles_attainment_and_expiry() -> None:
    now = 1000.0
    window = LatencyWindow(60.0, clock=lambda: now)
    for i in range(10):
        sample = window.first_token(now - 100 + i * 10, ttft=0.1 * (i + 1))
        # 11 tokens: 10 gaps of (i + 1) ms, the first after 5 ms.
        sample.more(sample.first + 0.005, 1)
        sample.more(sample.first + 0.010 * (i + 1), 9)
    s = window.summary(slo_ttft_s=0.75, slo_tpot_s=0.0065)
    # 60 s back from 1000: the samples of 940..990 (i = 4..9) remain.
    assert s.samples == len(window) == 6
    assert s.ttft_p90 == pytest.approx(1.0) and s.ttft_p99 == pytest.approx(1.0)
    assert s.tpot_p50 == pytest.approx(0.007) and s.tpot_p90 == pytest.approx(0.010)
    assert s.ttft_attainment == pytest.approx(3 / 6)  # 0.5, 0.6 and 0.7 s
    assert s.tpot_attainment == pytest.approx(2 / 6)  # 5 and 6 ms
    assert s.second_gap_p90 == pytest.approx(0.005)
    now += 100
    assert window.summary(0.75, 0.0065) == LatencySummary(0)


def test_request_timing_feeds_the_planner() -> None:
    metrics = GatewayMetrics(PlannerConfig(planner_window_s=30))
    timing = RequestTiming(metrics, n=2, started=time.monotonic() - 0.25)
    timing.observe(0, 1)
    timing.observe(0, 3)
    timing.observe(1, 0)  # nothing yet for choice 1
    s = metrics.planner.samples.summary(1.0, 1.0)
    assert s.samples == 1
    assert s.ttft_p90 is not None and 0.25 <= s.ttft_p90 < 5
    assert s.tpot_p90 is not None and s.tpot_p90 >= 0
    assert metrics.planner.samples.window_s == 30
    # The command line's config replaces the defaults, keeping the samples.
    metrics.planner.configure(PlannerConfig(planner_window_s=10))
    assert metrics.planner.samples.window_s == 10 and len(metrics.planner.samples) == 1


# -- metrics and flags ---------------------------------------------------------------


def test_metrics_render_the_signals_and_the_recommendation() -> None:
    router = Router()
    p = router.add(WorkerInfo(url="http://p", role="prefill"))
    p.stats = {"uptime_seconds": 10, "engine_step_seconds_total": 1, "transfers_ok": 1}
    d = router.add(WorkerInfo(url="http://d", role="decode"))
    d.stats = {"total_pages": 100, "available_pages": 5, "running": 3}
    d.info = {"max_running_requests": 8}
    metrics = GatewayMetrics()
    RequestTiming(metrics, 1, time.monotonic() - 2.0).observe(0, 1)  # TTFT 2 s: missed
    text = metrics.render(router)
    values = {
        m[1]: float(m[2])
        for m in re.finditer(r"^(gateway_(?:pool|slo|recommended|latency)\S*) (\S+)$", text, re.M)
    }
    assert values['gateway_recommended_replicas{role="prefill"}'] == 2  # 1 + 1: TTFT missed
    assert values['gateway_recommended_replicas{role="decode"}'] == 2  # 0.95 / 0.8
    assert values['gateway_pool_kv_utilization{role="decode"}'] == pytest.approx(0.95)
    assert values['gateway_pool_replicas{role="prefill"}'] == 1
    assert values['gateway_slo_attainment{slo="ttft"}'] == 0.0
    assert values['gateway_slo_target_seconds{slo="tpot"}'] == 0.05
    for name in (
        'gateway_pool_queue_seconds{role="prefill"}',
        'gateway_pool_backlog_tokens{role="prefill"}',
        'gateway_latency_window_seconds{slo="ttft",quantile="0.9"}',
    ):
        assert name in values, name
    for name in ("gateway_recommended_replicas", "gateway_pool_kv_utilization"):
        assert f"# TYPE {name} gauge" in text


def test_the_flags_parse_into_the_planner_config() -> None:
    ns = build_parser().parse_args(
        [
            *("--slo-ttft-s", "0.4", "--slo-tpot-s", "0.02", "--planner-window-s", "20"),
            *("--planner-prefill-utilization", "0.6", "--planner-decode-utilization", "0.9"),
            *("--planner-decode-step-floor-s", "0.005", "--planner-max-scale", "3"),
        ]
    )
    assert _gateway_config(ns).planner == PlannerConfig(
        slo_ttft_s=0.4,
        slo_tpot_s=0.02,
        planner_window_s=20,
        planner_prefill_utilization=0.6,
        planner_decode_utilization=0.9,
        planner_decode_step_floor_s=0.005,
        planner_max_scale=3,
    )
    assert _gateway_config(build_parser().parse_args([])).planner == PlannerConfig()


def test_the_gateway_state_runs_the_configured_planner() -> None:
    config = GatewayConfig(planner=PlannerConfig(slo_ttft_s=0.3, planner_window_s=15))
    router = Router(RouterConfig())
    state = GatewayState(config, router, HealthChecker(router), Dispatcher(router, 5.0))
    assert state.metrics.planner.config == config.planner
    assert state.metrics.planner.samples.window_s == 15


@pytest.mark.parametrize(
    "argv", [["--slo-ttft-s", "0"], ["--planner-max-scale", "0.5"], ["--slo-tpot-s", "x"]]
)
def test_bad_planner_flags_are_usage_errors(argv: list[str]) -> None:
    with pytest.raises(SystemExit) as e:
        main(argv)
    assert e.value.code == 2


# -- the simulated fleet -------------------------------------------------------------


def test_the_planner_picks_the_best_ratio_of_the_simulated_fleet(tmp_path: Path) -> None:
    # Four workers, a third of the default rates: the three workloads' best
    # ratios are 1:3, 3:1 and 1:1, each alone.
    out = tmp_path / "sim.json"
    argv = [
        *("--total-workers", "4", "--ratios", "1:3", "1:1", "3:1", "--rate-scale", "0.3"),
        *("--duration-s", "90", "--warmup-s", "40", "--output-file", str(out)),
    ]
    proc = subprocess.run(
        [sys.executable, "-m", "benchmarks.sim_planner", *argv],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    record = json.loads(out.read_text())
    picks = {}
    for w in record["workloads"]:
        goodput = {row["ratio"]: row["goodput"] for row in w["ratios"]}
        best = max(goodput.values())
        assert best > 0, w
        assert goodput[w["planner_pick"]] >= best * 0.98, (
            w["workload"],
            goodput,
            w["planner_pick"],
        )
        picks[w["workload"]] = w["planner_pick"]
    assert picks == {"short-in-long-out": "1:3", "long-in-short-out": "3:1", "mixed": "1:1"}
    assert record["planner_picks_best"] is True
    assert record["git_commit"] and record["command"].startswith("python -m benchmarks.sim_planner")
