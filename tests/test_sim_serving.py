"""``python -m benchmarks.sim_serving`` on the tiny model: closed loops and
Poisson arrivals through the engine's overlap loop, each prefill setting
applied, every request to its last token, and no page left held."""

from __future__ import annotations

import json
import random
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent


def test_closed_and_open_loops_for_each_setting(model_dir: str, tmp_path: Path) -> None:
    out = tmp_path / "sim.json"
    cmd = [
        sys.executable, "-m", "benchmarks.sim_serving",
        "--model", model_dir, "--device", "cpu", "--kv-cache-memory-gb", "0.05",
        "--input-len", "24", "--output-len", "5", "--requests", "7",
        "--concurrency", "3", "--request-rates", "20",
        "--prefill-per-request", "0", "6", "--prefill-floor", "32",
        "--output-file", str(out),
    ]  # fmt: skip
    run = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stdout + run.stderr
    rows = json.loads(out.read_text())["rows"]
    assert [(r["prefill_per_request"], r["arrivals"]) for r in rows] == [
        (0, "closed loop of 3"),
        (0, "poisson 20.0/s"),
        (6, "closed loop of 3"),
        (6, "poisson 20.0/s"),
    ]
    # The open loop's requests arrive at seeded Poisson times: the run cannot
    # end before the last one arrived (0.40 s at 20/s), as a closed loop may.
    draws = random.Random(0)
    last_arrival = sum(draws.expovariate(20.0) for _ in range(7))
    for r in rows:
        assert r["prefill_floor"] == 32 and r["requests"] == 7
        assert 0 < r["ttft_p50_ms"] <= r["ttft_p99_ms"]
        assert 0 < r["itl_p50_ms"] <= r["itl_p99_ms"]
        assert 0 < r["tpot_p50_ms"] <= r["tpot_p99_ms"]
        # 5 tokens each: one from a step with prefill, four from steps with decode rows.
        assert sum(k["n"] for k in r["steps"].values()) >= 5
        assert r["pages_leaked"] == 0
        if r["request_rate"]:
            assert r["wall_s"] >= last_arrival
