"""The short fault matrix (``harness.fault_matrix.short_config``, what
``python -m benchmarks.fault_matrix --short`` runs): one prefill and two decode
workers and a gateway under streaming load, whose greedy outputs are checked
against the offline engine, while a decode worker is killed and restarted, a
KV data message is lost, clients hang up mid-stream, and malformed requests
arrive. Nothing may be wrong, hang, leak pages or get a 5xx; the killed
worker's traffic fails over and the restarted one gets traffic again."""

from __future__ import annotations

import asyncio
import json
from dataclasses import asdict
from pathlib import Path

import pytest
from workers import log_tail

from harness.fault_matrix import Result, run_matrix, short_config

pytestmark = pytest.mark.e2e


def test_short_fault_matrix(tmp_path: Path) -> None:
    logs = tmp_path / "logs"
    results: list[Result] = []
    try:
        asyncio.run(run_matrix(short_config(log_dir=logs), results.append))
    finally:
        tails = "\n".join(
            f"----- {p.name} -----\n{log_tail(p, 60)}" for p in sorted(logs.glob("*.log"))
        )
        report = f"{json.dumps([asdict(r) for r in results], indent=1)}\n{tails}"
    by_name = {r.scenario: r for r in results}
    assert list(by_name) == ["kill-decode", "kv-drop", "disconnect", "malformed"], report
    for r in results:
        assert not r.bad, report
        assert r.wrong == r.hung == r.leaked_pages == r.stuck == 0, report
        assert r.server_errors == r.accepted == 0, report
        assert r.ok > 0, report
    kill = by_name["kill-decode"]
    assert kill.failover_s is not None and kill.recovery_s is not None, report
    # The lost message fails its request with a reason, never silently.
    assert by_name["kv-drop"].failed >= 1, report
    assert by_name["disconnect"].disconnected > 0, report
    assert by_name["malformed"].failed >= 40, report


def test_a_killed_gateway_replica_fails_only_its_clients(tmp_path: Path) -> None:
    """Two gateway replicas, half the clients on each: one is SIGKILLed under
    load and restarted. Its clients see errors; the other's see none; the
    workers drain the killed replica's requests (nothing leaked or stuck)."""
    logs = tmp_path / "logs"
    results: list[Result] = []
    cfg = short_config(log_dir=logs, gateways=2, scenarios=("kill-gateway",))
    try:
        asyncio.run(run_matrix(cfg, results.append))
    finally:
        tails = "\n".join(
            f"----- {p.name} -----\n{log_tail(p, 60)}" for p in sorted(logs.glob("*.log"))
        )
        report = f"{json.dumps([asdict(r) for r in results], indent=1)}\n{tails}"
    (r,) = results
    assert not r.bad and not r.notes, report
    assert r.ok > 0 and r.failed > 0, report
    assert r.wrong == r.hung == r.leaked_pages == r.stuck == r.server_errors == 0, report
