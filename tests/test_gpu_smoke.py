"""``python -m benchmarks.gpu_smoke`` on the CPU with the built-in tiny model:
the embedded gateway (a), a colocated worker (c) and a prefill/decode pair (d),
each with its requests, a decode worker killed mid-stream and restarted."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from workers import REPO

pytestmark = pytest.mark.e2e

TIMEOUT_S = 240.0
CHECKS = {
    "a": ["start", "chat", "stream", "json", "metrics"],
    "c": ["start", "chat", "stream", "json", "metrics", "kill", "restart"],
    "d": ["start", "chat", "stream", "json", "metrics", "kill", "restart"],
}


def test_gpu_smoke_on_cpu(tmp_path: Path) -> None:
    out = tmp_path / "smoke.json"
    cmd = [sys.executable, "-m", "benchmarks.gpu_smoke", "--device", "cpu", "--skip-pytest"]
    cmd += ["--only", "a,c,d", "--json", str(out)]
    proc = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=TIMEOUT_S)
    report = f"{proc.stdout}\n{proc.stderr[-4000:]}"
    assert proc.returncode == 0, report
    lines = proc.stdout.splitlines()
    expected = [f"{label}/{check}" for label, checks in CHECKS.items() for check in checks]
    for name in expected:
        assert any(line.split()[:2] == ["PASS", name] for line in lines), f"{name}:\n{report}"
    assert lines[-1].startswith(f"{len(expected)} passed, 0 failed"), report
    record = json.loads(out.read_text())
    assert [r["name"] for r in record["results"]] == expected
    assert all(r["ok"] for r in record["results"])
    assert record["cuda"] is False and record["machine"]["hostname"]


def test_the_tuned_deployment_is_refused_without_cuda() -> None:
    """e's kernels need FlashInfer: without CUDA it is refused up front,
    nothing started."""
    cmd = [sys.executable, "-m", "benchmarks.gpu_smoke", "--device", "cpu", "--only", "a,e"]
    proc = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert "deployment e needs CUDA" in proc.stderr
    assert "== a" not in proc.stdout
