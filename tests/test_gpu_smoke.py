"""``python -m benchmarks.gpu_smoke`` on the CPU with the built-in tiny model:
the embedded gateway (a), a colocated worker (c) and a prefill/decode pair (d),
each with its requests, a decode worker killed mid-stream and restarted."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import threading
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
    assert record["interrupted"] is False


def test_a_run_stopped_part_way_still_writes_its_record(tmp_path: Path) -> None:
    """SIGTERM (what a time limit sends) after the first check: the run stops
    its processes, exits 130 and writes the checks it ran, marked
    interrupted."""
    out = tmp_path / "smoke.json"
    cmd = [sys.executable, "-m", "benchmarks.gpu_smoke", "--device", "cpu", "--skip-pytest"]
    cmd += ["--only", "a", "--json", str(out)]
    proc = subprocess.Popen(
        cmd, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    )
    watchdog = threading.Timer(TIMEOUT_S, proc.kill)
    watchdog.start()
    try:
        assert proc.stdout is not None
        seen = []
        for line in proc.stdout:
            seen.append(line)
            if line.split()[:2] == ["PASS", "a/start"]:
                proc.send_signal(signal.SIGTERM)
                break
        rest, err = proc.communicate()
    finally:
        watchdog.cancel()
        proc.kill()
    report = "".join(seen) + rest + err[-4000:]
    assert proc.returncode == 130, report
    assert "interrupted; every process started was stopped" in err, report
    record = json.loads(out.read_text())
    assert record["interrupted"] is True, report
    names = [r["name"] for r in record["results"]]
    assert names[0] == "a/start" and record["results"][0]["ok"], report


def test_the_tuned_deployment_is_refused_without_cuda() -> None:
    """e's kernels need FlashInfer: without CUDA it is refused up front,
    nothing started."""
    cmd = [sys.executable, "-m", "benchmarks.gpu_smoke", "--device", "cpu", "--only", "a,e"]
    proc = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert "deployment e needs CUDA" in proc.stderr
    assert "== a" not in proc.stdout
