"""Two gateway replicas routing by the prefill workers' KV events
(``harness.fleet``, what ``python -m benchmarks.bench_fleet`` measures):
a shared-prefix workload spread over both replicas is served without a
failure, the workers' own counters show the shared prefixes hit their
caches, and a prefill worker restarted with a cold cache is seen as empty by
both replicas within a second of answering /health."""

from __future__ import annotations

from pathlib import Path

import pytest

from harness.fleet import FleetConfig, run_fleet

pytestmark = pytest.mark.e2e


def test_two_replicas_route_by_kv_events_and_see_a_restart(tmp_path: Path) -> None:
    cfg = FleetConfig(gateways=2, kv_events=True, groups=8, per_group=4, concurrency=4)
    r = run_fleet(cfg, tmp_path, measure_restart=True)
    assert r.requests == cfg.groups * cfg.per_group and r.failed == 0, r
    # Each group's first prompt misses; the best possible rate is
    # (per_group - 1) / per_group of the system prompt's share of the tokens.
    best = (
        (cfg.per_group - 1) / cfg.per_group * cfg.system_len / (cfg.system_len + cfg.question_len)
    )
    assert r.hit_rate > 0.5 * best, r
    assert r.restart_reflected_s is not None and r.restart_reflected_s < 1.0, r
