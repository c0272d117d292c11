"""The short fault matrix (``benchmarks/fault_matrix.py --short``): one
prefill and two decode workers and a gateway under streaming load, whose
greedy outputs are checked against the offline engine, while a decode worker
is killed and restarted, a KV data message is lost, clients hang up
mid-stream, and malformed requests arrive. Nothing may be wrong, hang, leak
pages or get a 5xx; the killed worker's traffic fails over and the restarted
one gets traffic again."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from workers import REPO, log_tail

pytestmark = pytest.mark.e2e

TIMEOUT_S = 300.0


def test_short_fault_matrix(tmp_path: Path) -> None:
    out = tmp_path / "matrix.json"
    logs = tmp_path / "logs"
    cmd = [sys.executable, "benchmarks/fault_matrix.py", "--short"]
    cmd += ["--json", str(out), "--log-dir", str(logs)]
    proc = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=TIMEOUT_S)

    def report() -> str:
        tails = "\n".join(
            f"----- {p.name} -----\n{log_tail(p, 60)}" for p in sorted(logs.glob("*.log"))
        )
        return f"{proc.stdout}\n{proc.stderr[-4000:]}\n{tails}"

    assert proc.returncode == 0, report()
    record = json.loads(out.read_text())
    results = {r["scenario"]: r for r in record["results"]}
    assert list(results) == ["kill-decode", "kv-drop", "disconnect", "malformed"], report()
    for r in results.values():
        assert r["wrong"] == r["hung"] == r["leaked_pages"] == r["stuck"] == 0, report()
        assert r["server_errors"] == r["accepted"] == 0, report()
        assert r["ok"] > 0, report()
    kill = results["kill-decode"]
    assert kill["failover_s"] is not None and kill["recovery_s"] is not None, report()
    # The lost message fails its request with a reason, never silently.
    assert results["kv-drop"]["failed"] >= 1, report()
    assert results["disconnect"]["disconnected"] > 0, report()
    assert results["malformed"]["failed"] >= 40, report()
