"""A worker's process settings and shutdown, against real worker processes:
its engine runs the intra-op thread count it was given, and SIGTERM drains it
(new requests refused as retryable, /health 503, in-flight requests run to
their end; past ``--shutdown-timeout-s`` the rest are aborted)."""

from __future__ import annotations

import asyncio
import os
import signal
import time
from pathlib import Path

import httpx
import pytest
from workers import Worker, dump_log, free_port, start_worker, stop, wait_healthy, worker_cmd

from protocol.auth import keys_for
from protocol.client import WorkerClient
from protocol.sampling import SamplingParams
from protocol.to_gateway import TokenDelta
from protocol.to_worker import Generate
from worker.config import CLUSTER_TOKEN_ENV, WorkerConfig

pytestmark = pytest.mark.e2e

TOKEN = "lifecycle-secret"
ENV = {CLUSTER_TOKEN_ENV: TOKEN}
EXIT_S = 30.0


def _start(model_dir: str, log_path: Path, **settings: object) -> Worker:
    port = free_port()
    cmd = worker_cmd(
        "decode_server", model_dir, port, page_size=1, num_pages=2048, torch_threads=1, **settings
    )
    return wait_healthy(start_worker(cmd, log_path, ENV), port, log_path)


def _spec(max_tokens: int) -> SamplingParams:
    return SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)


async def _health(worker: Worker) -> int:
    async with httpx.AsyncClient(timeout=5) as http:
        return (await http.get(f"{worker.url}/health")).status_code


async def _until_draining(worker: Worker) -> None:
    deadline = time.monotonic() + 10
    while await _health(worker) != 503:
        assert time.monotonic() < deadline, "/health never answered 503 while draining"
        await asyncio.sleep(0.02)


def test_engine_threads_resolution(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    monkeypatch.setattr("worker.config._usable_cores", lambda: 8)
    assert WorkerConfig().engine_threads == 4  # half the cores: never all of them
    monkeypatch.setattr("worker.config._usable_cores", lambda: 1)
    assert WorkerConfig().engine_threads == 1
    monkeypatch.setenv("OMP_NUM_THREADS", "3")
    assert WorkerConfig().engine_threads == 3
    assert WorkerConfig(torch_threads=2).engine_threads == 2
    with pytest.raises(ValueError, match="torch_threads"):
        WorkerConfig(torch_threads=0)
    assert "--torch-threads" in WorkerConfig(torch_threads=2).to_argv()


def test_busy_poll_resolution(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr("protocol.host.usable_cores", lambda: 16)
    gpu = WorkerConfig.from_settings(device="cuda:0")
    assert gpu.idle_spin_s == 1.0
    assert WorkerConfig.from_settings(device="cpu").idle_spin_s == 0.0
    assert WorkerConfig.from_settings(device="cuda:0", busy_poll_s=0.25).idle_spin_s == 0.25
    assert WorkerConfig.from_settings(device="cuda:0", busy_poll_s=0).idle_spin_s == 0.0
    monkeypatch.setattr("protocol.host.usable_cores", lambda: 2)
    assert gpu.idle_spin_s == 0.0  # no core to spare beside the other processes
    with pytest.raises(ValueError, match="busy_poll_s"):
        WorkerConfig(busy_poll_s=-1)
    assert WorkerConfig(busy_poll_s=0.5).to_argv()[-2:] == ["--busy-poll-s", "0.5"]


def _engine_cpu_s(front_pid: int) -> float:
    """CPU seconds (user + system) of the engine process the front spawned
    (its other child is multiprocessing's resource tracker)."""
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
            cmdline = (stat.parent / "cmdline").read_bytes()
        except OSError:
            continue
        if int(fields[1]) == front_pid and b"spawn_main" in cmdline:
            return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
    raise AssertionError(f"no engine process under {front_pid}")


def test_busy_poll_spins_after_a_request_then_sleeps(
    model_dir: str, tmp_path: Path, request: pytest.FixtureRequest
) -> None:
    """After a request the engine process polls without sleeping for
    --busy-poll-s (it burns CPU), then sleeps again; the requester's heartbeats
    do not keep it spinning."""
    linger = 0.6
    worker = _start(model_dir, tmp_path / "busy.log", busy_poll_s=linger)
    try:
        assert worker.info()["busy_poll_s"] == linger

        async def scenario() -> tuple[float, float]:
            async with WorkerClient(worker.endpoint, auth=keys_for(TOKEN)) as client:
                async for _ in client.generate(Generate("busy-1", [5, 6, 7], _spec(2))):
                    pass
                t0 = _engine_cpu_s(worker.proc.pid)
                await asyncio.sleep(0.4)
                spun = _engine_cpu_s(worker.proc.pid) - t0
                await asyncio.sleep(linger)  # heartbeats keep coming meanwhile
                t1 = _engine_cpu_s(worker.proc.pid)
                await asyncio.sleep(0.6)
                return spun, _engine_cpu_s(worker.proc.pid) - t1

        spun, idle = asyncio.run(scenario())
        # A spinning process gets most of a core even on a busy 2-core host;
        # an idle one wakes every 5 ms for a poll and takes a few percent.
        assert spun >= 0.15, f"the engine used {spun:.3f} s of CPU in 0.4 s after a request"
        assert idle <= 0.15, f"the engine used {idle:.3f} s of CPU in 0.6 s while idle"
    except BaseException:
        dump_log(request.config, worker.log_path)
        raise
    finally:
        stop(worker.proc)


def test_sigterm_drains_in_flight_and_refuses_new(
    model_dir: str, tmp_path: Path, request: pytest.FixtureRequest
) -> None:
    log_path = tmp_path / "worker.log"
    worker = _start(model_dir, log_path, shutdown_timeout_s=60.0)
    try:
        assert worker.start_info["torch_threads"] == 1

        async def go() -> tuple[list[TokenDelta], list[TokenDelta]]:
            async with WorkerClient(worker.endpoint, auth=keys_for(TOKEN)) as client:
                long = client.generate(Generate("long", [1, 2, 3, 4], _spec(300)))
                got = [await anext(long)]
                worker.proc.send_signal(signal.SIGTERM)
                await _until_draining(worker)
                late = [d async for d in client.generate(Generate("late", [5, 6], _spec(4)))]
                got += [d async for d in long]
                return got, late

        got, late = asyncio.run(go())
        assert [(d.finish_reason, d.retry) for d in late] == [("error", True)], late
        assert sum(len(d.token_ids) for d in got) == 300
        assert got[-1].finish_reason == "length"
        assert worker.proc.wait(EXIT_S) == 0
        assert "drained in" in log_path.read_text()
    except BaseException:
        dump_log(request.config, log_path)
        raise
    finally:
        stop(worker.proc)


def test_drain_aborts_what_outlives_the_shutdown_timeout(
    model_dir: str, tmp_path: Path, request: pytest.FixtureRequest
) -> None:
    log_path = tmp_path / "worker.log"
    limit_s = 1.0
    worker = _start(model_dir, log_path, shutdown_timeout_s=limit_s)
    try:

        async def go() -> tuple[list[TokenDelta], float]:
            async with WorkerClient(worker.endpoint, auth=keys_for(TOKEN)) as client:
                # Far longer than the test: a few tokens per millisecond at best.
                long = client.generate(Generate("long", [1, 2, 3, 4], _spec(2000)))
                got = [await anext(long)]
                t0 = time.monotonic()
                worker.proc.send_signal(signal.SIGTERM)
                got += [d async for d in long]
                return got, time.monotonic() - t0

        got, took = asyncio.run(go())
        assert got[-1].finish_reason == "error" and "shutting down" in (got[-1].error or "")
        assert sum(len(d.token_ids) for d in got) < 2000
        assert limit_s <= took < limit_s + 5.0
        assert worker.proc.wait(EXIT_S) == 0
        assert "still in flight after 1s; aborting them" in log_path.read_text()
    except BaseException:
        dump_log(request.config, log_path)
        raise
    finally:
        stop(worker.proc)
