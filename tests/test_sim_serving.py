"""benchmarks.sim_serving on the tiny model: a closed loop and Poisson
arrivals through the engine's overlap loop, every request finished with its
tokens, the prefill settings applied, and the pool back to its free pages."""

from __future__ import annotations

import json
import random
from pathlib import Path

import pytest

from benchmarks import sim_serving
from engine.config import EngineConfig
from engine.engine import Engine


@pytest.fixture(scope="module")
def engine(model_dir: str) -> Engine:
    # No prefix cache: a finished request's pages go straight back to the pool.
    cfg = EngineConfig(
        model=model_dir, device="cpu", kv_cache_memory_gb=0.05, enable_prefix_cache=False
    )
    return Engine(cfg)


def args(**kw: int) -> object:
    return sim_serving.build_parser().parse_args(
        [
            f"--{k.replace('_', '-')}={v}"
            for k, v in {"input_len": 24, "output_len": 5, **kw}.items()
        ]
    )


@pytest.mark.parametrize("rate", [None, 200.0])
def test_every_request_runs_to_its_last_token(engine: Engine, rate: float | None) -> None:
    free = engine.runner.pool.allocator.num_free
    row = sim_serving.simulate(engine, 3, 7, args(), rate)
    assert row["requests"] == 7 and row["request_rate"] == rate
    assert row["arrivals"] == (f"poisson {rate}/s" if rate else "closed loop of 3")
    steps = row["steps"]
    # 7 prompts of 24 tokens and 5 tokens each: the first token from a prefill
    # (or mixed) step, the other 4 from steps with decode rows.
    assert sum(k["n"] for k in steps.values()) >= 5
    assert 0 < row["ttft_p50_ms"] <= row["ttft_p99_ms"]
    assert 0 < row["itl_p50_ms"] <= row["itl_p99_ms"]
    assert 0 < row["tpot_p50_ms"] <= row["tpot_p99_ms"]
    assert row["output_tok_s"] > 0
    assert engine.runner.pool.allocator.num_free == free


def test_open_loop_requests_arrive_over_time(engine: Engine) -> None:
    # At 20 requests/s, 6 arrivals take ~0.3 s: the run cannot end before the
    # last one arrived, which a closed loop of 6 would.
    free = engine.runner.pool.allocator.num_free
    row = sim_serving.simulate(engine, 0, 6, args(), 20.0)
    draws = random.Random(0)  # the same seeded draws the simulation makes
    last_arrival = sum(draws.expovariate(20.0) for _ in range(6))
    assert row["wall_s"] >= last_arrival
    assert engine.runner.pool.allocator.num_free == free


def test_main_compares_settings_and_writes_a_record(model_dir: str, tmp_path: Path) -> None:
    out = tmp_path / "sim.json"
    sim_serving.main(
        [
            "--model", model_dir, "--device", "cpu", "--kv-cache-memory-gb", "0.05",
            "--input-len", "16", "--output-len", "3", "--requests", "4",
            "--concurrency", "2", "--request-rates", "100",
            "--prefill-per-request", "0", "6", "--prefill-floor", "32",
            "--output-file", str(out),
        ]
    )  # fmt: skip
    rows = json.loads(out.read_text())["rows"]
    assert [(r["prefill_per_request"], r["concurrency"], r["request_rate"]) for r in rows] == [
        (0, 2, None),
        (0, None, 100.0),
        (6, 2, None),
        (6, None, 100.0),
    ]
    assert {r["prefill_floor"] for r in rows} == {32}
