"""``python -m benchmarks.bench_ttft_stages``: the /metrics arithmetic it uses
(``harness.stages``) against numbers written by hand, and a smoke run that
starts both deployments itself (tiny model, CPU), skips a case longer than the
context and leaves no process behind."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import uuid
from pathlib import Path

import pytest
from workers import REPO, procs_mentioning

from harness.stages import stage_means_ms, stage_totals

SMOKE_TIMEOUT_S = 240.0
TOO_LONG = 1_000_000
"""A prompt length beyond any context here: its case is skipped."""

METRICS_BEFORE = """\
# TYPE gateway_stage_seconds histogram
gateway_stage_seconds_sum{stage="tokenize"} 0.5
gateway_stage_seconds_count{stage="tokenize"} 10
gateway_worker_stage_seconds_sum{role="prefill",stage="first_forward"} 2.0
gateway_worker_stage_seconds_count{role="prefill",stage="first_forward"} 10
"""
METRICS_AFTER = """\
gateway_stage_seconds_bucket{stage="tokenize",le="0.001"} 12
gateway_stage_seconds_sum{stage="tokenize"} 0.506
gateway_stage_seconds_count{stage="tokenize"} 12
gateway_stage_seconds_sum{stage="route"} 0.004
gateway_stage_seconds_count{stage="route"} 2
gateway_worker_stage_seconds_sum{role="prefill",stage="first_forward"} 2.05
gateway_worker_stage_seconds_count{role="prefill",stage="first_forward"} 12
gateway_worker_stage_seconds_sum{role="decode",stage="first_forward"} 1.0
gateway_worker_stage_seconds_count{role="decode",stage="first_forward"} 10
"""


def test_stage_means_between_snapshots() -> None:
    means = stage_means_ms(stage_totals(METRICS_BEFORE), stage_totals(METRICS_AFTER))
    # (0.506 - 0.5) / 2 s = 3 ms; route is new (2 ms each); decode's count moved by 10.
    assert means == pytest.approx(
        {
            "gateway:tokenize": 3.0,
            "gateway:route": 2.0,
            "prefill:first_forward": 25.0,
            "decode:first_forward": 100.0,
        }
    )


@pytest.mark.e2e
def test_deploys_colocated_and_disaggregated(tmp_path: Path) -> None:
    marker = f"ttft-smoke-{uuid.uuid4().hex[:8]}"
    out = tmp_path / "record.json"
    cmd = [sys.executable, "-m", "benchmarks.bench_ttft_stages"]
    cmd += ["--deploy", "colocated", "disagg", "--device", "cpu", "--transfer-backend", "tcp"]
    cmd += ["--lengths", "16", "40", str(TOO_LONG), "--cached-prefix", "32", "--cached-new", "8"]
    cmd += ["--requests", "2", "--gap-s", "0", "--label", marker, "--output-file", str(out)]
    proc = subprocess.Popen(
        cmd,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        cwd=REPO,
        env={**os.environ, "OMP_NUM_THREADS": "1"},
        text=True,
    )
    try:
        output, _ = proc.communicate(timeout=SMOKE_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        proc.send_signal(signal.SIGTERM)  # the script stops its processes on SIGTERM
        output, _ = proc.communicate(timeout=60)
        pytest.fail(f"no result in {SMOKE_TIMEOUT_S}s:\n{output[-6000:]}")
    assert proc.returncode == 0, output[-6000:]
    assert not procs_mentioning(marker), "processes left running"
    record = json.loads(out.read_text())
    assert record["label"] == marker and record["git_commit"]
    rows = record["results"]
    assert [(r["deployment"], r["case"]) for r in rows] == [
        (d, c) for d in ("colocated", "disagg") for c in ("16 tokens", "40 tokens", "32 cached + 8")
    ]
    for r in rows:
        stages = r["stage_ms_mean"]
        roles = {k.split(":")[0] for k in stages}
        assert roles == (
            {"gateway", "both"}
            if r["deployment"] == "colocated"
            else {"gateway", "prefill", "decode"}
        ), stages
        # The gateway's stretch from dispatch to first byte lies inside the
        # client's TTFT (own clocks, nested intervals); all of a request's at most.
        inner = (
            stages["gateway:dispatch_to_first_token"] + stages["gateway:first_token_to_first_byte"]
        )
        assert 0 < inner <= r["ttft_ms_max"], r
        assert r["ttft_ms_min"] <= r["ttft_ms_median"] <= r["ttft_ms_max"]
    assert output.count("TTFT p50") == 2
    assert output.count(f"skipping {TOO_LONG} tokens: longer than the context") == 2
