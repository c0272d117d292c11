"""Stage timing end to end: the gateway app in-process (uvicorn in a thread,
its real dispatcher) in front of real worker processes on the tiny model: a
colocated worker (``--role both``), and a prefill plus a decode worker (tcp).

For streamed and non-streamed requests, every stage of the gateway and of each
worker is there and in order (each process's own clock), the gateway's and the
workers' /metrics expose the stage histograms, and the gateway and a worker
log one DEBUG line per request. Every test ends with the workers idle and
their whole KV pool available again.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import re
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest
import uvicorn
from workers import Worker, dump_log, free_port, launch_workers, worker_cmd

from engine.tiny import TINY_MODEL_NAME
from gateway.app import build_app
from gateway.config import GatewayConfig
from gateway.dispatch import Dispatcher
from gateway.routing import HealthChecker, Router, RouterConfig
from gateway.stages import RequestTrace, StageMetrics
from gateway.state import GatewayState
from protocol import stages as st
from protocol.auth import keys_for
from worker.cli import CLUSTER_TOKEN_ENV

pytestmark = pytest.mark.e2e

MODEL = TINY_MODEL_NAME
ENGINE: dict[str, Any] = dict(
    page_size=4, num_pages=256, context_length=512, transfer_backend="tcp", transfer_timeout_s=10
)
WORKER_ENV = {CLUSTER_TOKEN_ENV: "stages-e2e-secret", "OMP_NUM_THREADS": "1"}
DRAIN_TIMEOUT_S = 20.0

GATEWAY_STREAMED = [
    st.RECEIVED,
    st.TOKENIZED,
    st.DISPATCHED,
    st.FIRST_TOKEN_RECEIVED,
    st.FIRST_BYTE_WRITTEN,
    st.FINISHED,
]
GATEWAY_WHOLE = [s for s in GATEWAY_STREAMED if s != st.FIRST_BYTE_WRITTEN]
WORKER_COMMON = [
    st.ADMITTED,
    st.FORWARD_STARTED,
    st.FORWARD_FINISHED,
    st.FIRST_TOKEN,
    st.FIRST_TOKEN_SENT,
    st.FINISHED,
]
WORKER_ORDER = {
    "both": [st.RECEIVED, *WORKER_COMMON],
    # The reservation's round trip overlaps the prefill's compute: its stamp
    # is in the report only when it came before the first token.
    "prefill": [st.RECEIVED, *WORKER_COMMON],
    "decode": [st.RECEIVED, st.RESERVE_SENT, st.DONE_RECEIVED, *WORKER_COMMON],
}
"""Every stage a worker of each role reports, in the order they happen."""


class RecordingStages(StageMetrics):
    """The gateway's stage metrics, keeping every finished trace."""

    def __init__(self) -> None:
        super().__init__()
        self.finished: list[tuple[RequestTrace, bool]] = []

    def finish(self, trace: RequestTrace, ok: bool) -> None:
        self.finished.append((trace, ok))
        super().finish(trace, ok)


@dataclass
class Deployment:
    url: str
    workers: list[Worker]
    stages: RecordingStages


def _spec(log_dir: Path, name: str, module: str, role: str, model_dir: str, *flags: str) -> Any:
    port = free_port()
    flags = ("--served-model-name", MODEL, *flags)
    cmd = worker_cmd(module, model_dir, port, role=role, flags=flags, **ENGINE)
    return cmd, port, log_dir / f"{name}.log", WORKER_ENV


@contextlib.contextmanager
def in_process_gateway(prefill: list[str], decode: list[str]) -> Iterator[tuple[str, Any]]:
    """The gateway app over these workers, served by uvicorn in a thread."""
    token = WORKER_ENV[CLUSTER_TOKEN_ENV]
    config = GatewayConfig(prefill=tuple(prefill), decode=tuple(decode), cluster_token=token)
    router = Router(RouterConfig())
    dispatcher = Dispatcher(router, config.worker_timeout_s, auth=keys_for(token))
    state = GatewayState(config, router, HealthChecker(router), dispatcher)
    recording = RecordingStages()
    state.metrics.stages = recording
    port = free_port()
    server = uvicorn.Server(
        uvicorn.Config(build_app(state), host="127.0.0.1", port=port, log_level="warning")
    )
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    try:
        deadline = time.monotonic() + 60
        while not server.started:
            assert thread.is_alive() and time.monotonic() < deadline, "gateway did not start"
            time.sleep(0.02)
        yield f"http://127.0.0.1:{port}", recording
    finally:
        server.should_exit = True
        thread.join(30)


@pytest.fixture(scope="module")
def colocated(
    request: pytest.FixtureRequest, model_dir: str, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Deployment]:
    log_dir = tmp_path_factory.mktemp("stages-both")
    specs = [_spec(log_dir, "both", "decode_server", "both", model_dir, "--log-level", "debug")]
    yield from _deploy(request, specs, prefill=0)


@pytest.fixture(scope="module")
def disaggregated(
    request: pytest.FixtureRequest, model_dir: str, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Deployment]:
    log_dir = tmp_path_factory.mktemp("stages-pd")
    specs = [
        _spec(log_dir, "prefill", "prefill_server", "prefill", model_dir),
        _spec(log_dir, "decode", "decode_server", "decode", model_dir),
    ]
    yield from _deploy(request, specs, prefill=1)


def _deploy(request: pytest.FixtureRequest, specs: list[Any], prefill: int) -> Iterator[Deployment]:
    failed_before = request.session.testsfailed
    with launch_workers(specs) as workers:
        urls = [w.url for w in workers]
        try:
            with in_process_gateway(urls[:prefill], urls[prefill:]) as (url, recording):
                yield Deployment(url, workers, recording)
        finally:
            if request.session.testsfailed > failed_before:
                for w in workers:
                    dump_log(request.config, w.log_path, 120)


def assert_drained(workers: list[Worker]) -> None:
    """Every worker idle with the KV pool it had at start."""
    for w in workers:
        start = w.start_info["stats"]
        w.wait_stats(
            lambda s, start=start: (
                s["running"] == 0
                and s["waiting"] == 0
                and s["in_flight"] == 0
                and s.get("rooms", 0) == 0
                and s.get("transferring", 0) == 0
                and s["available_pages"] == s["total_pages"] == start["available_pages"]
            ),
            "idle with its whole pool",
            timeout=DRAIN_TIMEOUT_S,
        )


# -- requests --------------------------------------------------------------------------


def run_requests(url: str) -> list[tuple[str, bool]]:
    """A streamed and a whole chat and completion, two of them at once; returns
    (endpoint, streamed) of each in the order sent."""
    chat = {"model": MODEL, "messages": [{"role": "user", "content": "Tell me a story"}]}
    completion = {"model": MODEL, "prompt": "Once upon a time there was a"}
    common = {"max_tokens": 6, "temperature": 0, "ignore_eos": True}
    jobs = [
        ("/v1/chat/completions", {**chat, **common, "stream": True}),
        ("/v1/chat/completions", {**chat, **common}),
        ("/v1/completions", {**completion, **common, "stream": True}),
        ("/v1/completions", {**completion, **common}),
    ]

    async def one(client: httpx.AsyncClient, path: str, body: dict[str, Any]) -> None:
        resp = await client.post(f"{url}{path}", json=body)
        assert resp.status_code == 200, resp.text
        if body.get("stream"):
            assert resp.text.rstrip().endswith("data: [DONE]"), resp.text[-300:]
        else:
            assert resp.json()["usage"]["completion_tokens"] == 6

    async def go() -> None:
        async with httpx.AsyncClient(timeout=60) as client:
            await asyncio.gather(*(one(client, p, b) for p, b in jobs[:2]))
            await asyncio.gather(*(one(client, p, b) for p, b in jobs[2:]))

    asyncio.run(go())
    return [(p, bool(b.get("stream"))) for p, b in jobs]


def assert_in_order(stamps: dict[str, float], order: list[str], what: str) -> None:
    missing = [s for s in order if s not in stamps]
    assert not missing, f"{what}: stages {missing} missing from {stamps}"
    values = [stamps[s] for s in order]
    assert values == sorted(values), f"{what}: stages out of order: {dict(zip(order, values))}"


def check_traces(recording: RecordingStages, roles: list[str], jobs: int) -> list[RequestTrace]:
    traces = recording.finished[-jobs:]
    assert len(traces) == jobs
    streamed = whole = 0
    for trace, ok in traces:
        assert ok, trace.clock.stamps
        stamps = trace.clock.stamps
        if st.FIRST_BYTE_WRITTEN in stamps:
            streamed += 1
            assert_in_order(stamps, GATEWAY_STREAMED, f"gateway, streamed {trace.rid}")
        else:
            whole += 1
            assert_in_order(stamps, GATEWAY_WHOLE, f"gateway, whole {trace.rid}")
        assert trace.rid and sorted(trace.reports) == sorted(roles), trace.reports
        for role in roles:
            assert_in_order(trace.reports[role], WORKER_ORDER[role], f"{role} {trace.rid}")
            assert trace.reports[role][st.RECEIVED] == 0.0
    assert streamed == whole == jobs // 2
    return [t for t, _ in traces]


def metric_count(text: str, name: str, **labels: str) -> int:
    sel = ",".join(f'{k}="{v}"' for k, v in labels.items())
    m = re.search(rf"^{name}_count\{{{re.escape(sel)}\}} (\d+)$", text, re.M)
    return int(m.group(1)) if m else 0


# -- tests --------------------------------------------------------------------------------


def test_colocated_stages(colocated: Deployment, caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.DEBUG, logger="gateway.stages")
    jobs = run_requests(colocated.url)
    traces = check_traces(colocated.stages, ["both"], len(jobs))

    gw = httpx.get(f"{colocated.url}/metrics", timeout=10).text
    for iv in st.GATEWAY_INTERVALS:
        want = 2 if iv.end == st.FIRST_BYTE_WRITTEN else 4
        assert metric_count(gw, "gateway_stage_seconds", stage=iv.name) >= want, iv.name
    for name in ("admit", "queue", "first_forward", "send_first_token", "total"):
        assert metric_count(gw, "gateway_worker_stage_seconds", role="both", stage=name) >= 4
    (worker,) = colocated.workers
    text = httpx.get(f"{worker.url}/metrics", timeout=10).text
    assert "# TYPE worker_stage_seconds histogram" in text
    for name in ("admit", "queue", "first_forward", "time_to_first_token", "total"):
        assert metric_count(text, "worker_stage_seconds", stage=name) >= 4, name

    # One DEBUG line per request, with its id, in the gateway and in the worker.
    lines = [r.getMessage() for r in caplog.records if r.name == "gateway.stages"]
    for trace in traces:
        (line,) = [x for x in lines if f"rid={trace.rid} " in x]
        assert "gateway: tokenize=" in line and "both: admit=" in line
    assert_drained(colocated.workers)
    log_text = worker.log_path.read_text()
    for trace in traces:
        assert re.search(rf"rid={re.escape(trace.rid)} room=- role=both .*stages: ", log_text)


def test_disaggregated_stages(disaggregated: Deployment) -> None:
    jobs = run_requests(disaggregated.url)
    traces = check_traces(disaggregated.stages, ["prefill", "decode"], len(jobs))
    assert all(t.room for t in traces)

    gw = httpx.get(f"{disaggregated.url}/metrics", timeout=10).text
    for role, name in [
        ("decode", "wait_pages"),
        ("decode", "kv_transfer"),
        ("decode", "done_to_first_step"),
        ("decode", "first_forward"),
        ("prefill", "first_forward"),
        ("prefill", "send_first_token"),
    ]:
        assert metric_count(gw, "gateway_worker_stage_seconds", role=role, stage=name) >= 4, (
            role,
            name,
        )
    assert_drained(disaggregated.workers)
    # The prefill worker closes a room's record once its KV has landed: the
    # transfer's tail is in its own histograms.
    prefill, decode = disaggregated.workers
    text = httpx.get(f"{prefill.url}/metrics", timeout=10).text
    for name in ("wait_reserve", "first_forward", "kv_tail", "send_done", "total"):
        assert metric_count(text, "worker_stage_seconds", stage=name) >= 4, name
    text = httpx.get(f"{decode.url}/metrics", timeout=10).text
    for name in (
        "wait_pages",
        "kv_transfer",
        "done_to_first_step",
        "admit",
        "first_forward",
        "total",
    ):
        assert metric_count(text, "worker_stage_seconds", stage=name) >= 4, name
