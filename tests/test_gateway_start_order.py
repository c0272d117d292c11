"""The gateway and its workers start in any order, and a worker whose first
contact fails is listed as down with the reason instead of ending the
gateway.

With processes: ``python -m gateway --prefill URL --decode URL`` started
before its workers keeps serving (503 while none is up), and admits each
worker once it answers. In-process, against workers faked over HTTP (a mock
transport) and ZMQ (a request-plane socket that only shakes hands): every way
a first contact can fail (no connection, a timeout, no tokenizer, bad JSON,
a role other than the one named, another model, another cluster token)
leaves the worker listed as down with ``last_error`` and logged once, the
gateway answers 503 with the reason at once when no worker can serve, and a
worker that is fixed joins at the next health round.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import subprocess
import sys
import time
from collections.abc import AsyncIterator, Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
import zmq
import zmq.asyncio
from workers import REPO, Worker, dump_log, free_port, launch_workers, log_tail, stop, worker_cmd

from gateway.config import GatewayConfig
from gateway.dispatch import Dispatcher, NoWorkerAvailable
from gateway.routing import HealthChecker, Router, RouterConfig
from gateway.state import GatewayState
from protocol import tokenizer_files
from protocol.auth import keys_for, secure_server
from worker.config import CLUSTER_TOKEN_ENV

TOKEN = "start-order-cluster-secret"
HEALTH_INTERVAL_S = 0.2
START_TIMEOUT_S = 60.0


# -- processes: the gateway first, its workers later -------------------------------


def wait_answering(
    proc: subprocess.Popen[bytes],
    url: str,
    log_path: Path,
    *,
    ready: bool = False,
    timeout: float = 5.0,
) -> httpx.Response:
    """Poll ``url`` (each GET given ``timeout`` seconds) until the gateway
    ``proc`` answers at all (``ready``: answers 200), and return that answer;
    fail the test, with the tail of ``log_path``, if it exits first or
    ``START_TIMEOUT_S`` passes."""
    deadline = time.monotonic() + START_TIMEOUT_S
    while True:
        assert proc.poll() is None, f"the gateway exited:\n{log_tail(log_path)}"
        assert time.monotonic() < deadline, f"the gateway never answered:\n{log_tail(log_path)}"
        with contextlib.suppress(httpx.HTTPError):
            resp = httpx.get(url, timeout=timeout)
            if resp.status_code == 200 or not ready:
                return resp
        time.sleep(0.1)


def _idle(stats: dict[str, Any]) -> bool:
    return not (stats["running"] or stats["waiting"] or stats.get("in_flight"))


def test_gateway_started_before_its_workers(
    model_dir: str, tmp_path: Path, request: pytest.FixtureRequest
) -> None:
    ports = {"prefill": free_port(), "decode": free_port()}
    urls = {role: f"http://127.0.0.1:{port}" for role, port in ports.items()}
    gw_port = free_port()
    gw_url = f"http://127.0.0.1:{gw_port}"
    gw_log = tmp_path / "gateway.log"
    cmd = [sys.executable, "-m", "gateway", "--host", "127.0.0.1", "--port", str(gw_port)]
    cmd += ["--prefill", urls["prefill"], "--decode", urls["decode"]]
    cmd += ["--health-interval-s", str(HEALTH_INTERVAL_S), "--worker-startup-timeout-s", "0.5"]
    env = {**os.environ, CLUSTER_TOKEN_ENV: TOKEN, "OMP_NUM_THREADS": "1"}
    logs = [gw_log]
    failed = request.session.testsfailed
    with open(gw_log, "wb") as out:
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, cwd=REPO, env=env)
    try:
        # Up and answering while no worker is: /health lists both as down.
        health = wait_answering(proc, f"{gw_url}/health", gw_log)
        assert health.status_code == 503
        listed = {w["url"]: w for w in health.json()["workers"]}
        assert set(listed) == set(urls.values())
        assert all(not w["healthy"] and w["last_error"] for w in listed.values()), listed
        resp = httpx.post(
            f"{gw_url}/v1/completions",
            json={"model": "m", "prompt": "Hello", "max_tokens": 2},
            timeout=30,
        )
        assert resp.status_code == 503, resp.text
        assert resp.json()["error"]["code"] == "no_worker"
        # No model is listed before a worker says which it serves.
        models = httpx.get(f"{gw_url}/v1/models", timeout=30)
        assert models.status_code == 503 and models.json()["error"]["code"] == "no_worker"

        # The workers come up on the addresses the gateway was given.
        specs = []
        for role, port in ports.items():
            module = f"{role}_server"
            settings = dict(page_size=4, num_pages=128, context_length=512)
            wcmd = worker_cmd(
                module, model_dir, port, role=role, transfer_backend="tcp", **settings
            )
            specs.append((wcmd, port, tmp_path / f"{role}.log", env))
        logs += [s[2] for s in specs]
        with launch_workers(specs) as workers:
            start = {w.name: w.stats()["available_pages"] for w in workers}
            deadline = time.monotonic() + 30
            while httpx.get(f"{gw_url}/health", timeout=5).status_code != 200:
                assert time.monotonic() < deadline, "the gateway never admitted its workers"
                time.sleep(0.1)
            client = openai.OpenAI(base_url=f"{gw_url}/v1", api_key="unused", max_retries=0)
            model = client.models.list().data[0].id
            done = client.completions.create(
                model=model, prompt="Hello", max_tokens=6, extra_body={"ignore_eos": True}
            )
            assert done.usage.completion_tokens == 6
            _wait_pools(workers, start)
        assert proc.poll() is None
        text = gw_log.read_text()
        assert "Traceback" not in text
        for url in urls.values():
            lines = [x for x in text.splitlines() if f"worker {url} is not up yet" in x]
            assert len(lines) == 1, lines
    finally:
        stop(proc)
        if request.session.testsfailed > failed:
            for path in logs:
                dump_log(request.config, path, 80)


def _wait_pools(workers: list[Worker], start: dict[str, int]) -> None:
    deadline = time.monotonic() + 20
    while True:
        stats = {w.name: w.stats() for w in workers}
        now = {name: s["available_pages"] for name, s in stats.items()}
        if now == start and all(_idle(s) for s in stats.values()):
            return
        assert time.monotonic() < deadline, f"pools not back: {now} != {start}"
        time.sleep(0.05)


# -- in-process: fake workers ---------------------------------------------------------


@dataclass
class FakeWorker:
    """A worker as the gateway's first contact sees it: its HTTP answers
    (``answer`` may replace any of them) and a request-plane socket holding
    ``token``."""

    url: str
    role: str
    endpoint: str
    info: dict[str, Any]
    answer: dict[str, Callable[[httpx.Request], httpx.Response]] = field(default_factory=dict)


class Fleet:
    """Fake workers behind one mock HTTP transport, their request planes on
    real ZMQ sockets (CURVE keys of each one's token)."""

    def __init__(self, model_dir: str) -> None:
        self.files = tokenizer_files.pack(model_dir)
        self.workers: dict[str, FakeWorker] = {}
        self.sockets: dict[str, zmq.asyncio.Socket] = {}
        self.transport = httpx.MockTransport(self._handle)

    def add(self, role: str, token: str | None = TOKEN, **info: Any) -> FakeWorker:
        port = free_port()
        url = f"http://worker-{len(self.workers)}:8000"
        endpoint = self.listen(f"tcp://127.0.0.1:{port}", token)
        facts = {
            "role": role,
            "request_endpoint": endpoint,
            "bootstrap_endpoint": None if role == "both" else "tcp://127.0.0.1:1",
            "served_model_name": "tiny",
            "vocab_size": 512,
            "page_size": 4,
            "context_length": 256,
            "max_model_len": 200,
            "started_at": 1.0,
            "stats": {},
            **info,
        }
        worker = self.workers[url] = FakeWorker(url, role, endpoint, facts)
        return worker

    def listen(self, endpoint: str, token: str | None) -> str:
        """(Re)bind ``endpoint``'s request plane with ``token``'s keys."""
        old = self.sockets.pop(endpoint, None)
        if old is not None:
            old.close(linger=0)
        sock = zmq.asyncio.Context.instance().socket(zmq.ROUTER)
        sock.linger = 0
        secure_server(sock, keys_for(token))
        # close() hands the old listener to zmq's I/O thread, which lets the
        # port go a moment later; a worker restarted on its port retries.
        deadline = time.monotonic() + 5
        while True:
            try:
                sock.bind(endpoint)
                break
            except zmq.ZMQError as e:
                if e.errno != zmq.EADDRINUSE or time.monotonic() > deadline:
                    sock.close(linger=0)
                    raise
                time.sleep(0.01)
        self.sockets[endpoint] = sock
        return endpoint

    def close(self) -> None:
        for sock in self.sockets.values():
            sock.close(linger=0)

    def _handle(self, request: httpx.Request) -> httpx.Response:
        url = f"{request.url.scheme}://{request.url.host}:{request.url.port}"
        worker = self.workers.get(url)
        if worker is None:
            raise httpx.ConnectError("connection refused", request=request)
        path = request.url.path
        if path in worker.answer:
            return worker.answer[path](request)
        if path == "/health":
            return httpx.Response(200, json={"status": "ok"})
        if path == "/server_info":
            return httpx.Response(200, json=worker.info)
        if path == "/tokenizer":
            return httpx.Response(200, json=self.files)
        return httpx.Response(404)


@contextlib.asynccontextmanager
async def gateway_state(
    fleet: Fleet, prefill: list[str], decode: list[str], token: str | None = TOKEN
) -> AsyncIterator[GatewayState]:
    config = GatewayConfig(
        prefill=tuple(prefill),
        decode=tuple(decode),
        cluster_token=token,
        worker_startup_timeout_s=5.0,
        connect_timeout_s=1.0,
    )
    router = Router(RouterConfig(health_timeout_s=1.0))
    dispatcher = Dispatcher(
        router, 10.0, connect_timeout_s=1.0, auth=keys_for(token), wait_for_worker_s=5.0
    )
    state = GatewayState(
        config, router, HealthChecker(router, transport=fleet.transport), dispatcher
    )
    try:
        yield state
    finally:
        await state.health.stop()
        await dispatcher.close()


def raises(exc: type[Exception], *args: Any) -> Callable[[httpx.Request], httpx.Response]:
    def answer(request: httpx.Request) -> httpx.Response:
        raise exc(*args, request=request)

    return answer


@pytest.fixture
def fleet(model_dir: str) -> Iterator[Fleet]:
    fleet = Fleet(model_dir)
    try:
        yield fleet
    finally:
        fleet.close()


def not_usable_lines(caplog: pytest.LogCaptureFixture, url: str) -> list[str]:
    return [
        r.getMessage()
        for r in caplog.records
        if f"worker {url} is not usable" in r.getMessage()
        or f"worker {url} is not up yet" in r.getMessage()
    ]


FAILURES: dict[str, tuple[dict[str, Callable[[httpx.Request], httpx.Response]], str, bool]] = {
    # Each: the worker's answers, what its last_error says, whether it is
    # refused (answers, but cannot serve: requests get a 503 at once).
    "connection-refused": (
        {"/server_info": raises(httpx.ConnectError, "connection refused")},
        "connection refused",
        False,
    ),
    "timeout": ({"/server_info": raises(httpx.ReadTimeout, "timed out")}, "timed out", False),
    "server-info-not-json": (
        {"/server_info": lambda _: httpx.Response(200, content=b"<html>")},
        "invalid JSON",
        False,
    ),
    "tokenizer-404": (
        {"/tokenizer": lambda _: httpx.Response(404, json={"error": "no tokenizer files"})},
        "serves no tokenizer files (GET /tokenizer answered 404)",
        True,
    ),
    "tokenizer-not-json": (
        {"/tokenizer": lambda _: httpx.Response(200, content=b"{not json")},
        "serves no tokenizer files",
        True,
    ),
    "tokenizer-without-tokenizer-json": (
        {"/tokenizer": lambda _: httpx.Response(200, json={"files": {}})},
        "no tokenizer.json",
        True,
    ),
}


@pytest.mark.parametrize("case", sorted(FAILURES))
def test_first_contact_failure_lists_the_worker_as_down(
    fleet: Fleet, case: str, caplog: pytest.LogCaptureFixture
) -> None:
    answers, reason, refused = FAILURES[case]
    caplog.set_level(logging.INFO)
    worker = fleet.add("both")
    worker.answer = dict(answers)

    async def go() -> None:
        async with gateway_state(fleet, [], [worker.url]) as state:
            await state.add_initial_workers()  # no exception: the gateway goes on
            (listed,) = state.router.workers()
            assert not listed.healthy and reason in (listed.last_error or ""), listed.last_error
            assert (listed.refused is not None) == refused
            for _ in range(3):  # health rounds: logged once all the same
                await state.health.check_all()
            assert not listed.healthy
            assert len(not_usable_lines(caplog, worker.url)) == 1, caplog.text
            if refused:  # no worker will serve: a 503 with the reason, at once
                t0 = time.monotonic()
                with pytest.raises(NoWorkerAvailable, match="tokenizer") as e:
                    await state.wait_ready()
                assert time.monotonic() - t0 < 1.0
                assert worker.url in str(e.value)
            # Fixed: it joins at the next health round.
            worker.answer.clear()
            await state.health.check_all()
            assert listed.healthy and listed.refused is None
            assert state.ready and state.model_name == "tiny"
            assert state.max_model_len == 200

    asyncio.run(go())


def test_role_other_than_named_is_listed_as_refused(fleet: Fleet) -> None:
    worker = fleet.add("prefill")

    async def go() -> None:
        async with gateway_state(fleet, [], [worker.url]) as state:
            await state.add_initial_workers()
            (listed,) = state.router.workers()
            assert not listed.healthy and "reports role 'prefill'" in (listed.last_error or "")
            with pytest.raises(NoWorkerAvailable, match="reports role 'prefill'"):
                await state.wait_ready()

    asyncio.run(go())


def test_worker_of_another_model_is_refused(fleet: Fleet) -> None:
    first = fleet.add("prefill")
    renamed = fleet.add("decode", served_model_name="other-model")
    resized = fleet.add("decode", vocab_size=1024)
    same = fleet.add("decode", max_model_len=120)

    async def go() -> None:
        urls = [renamed.url, resized.url, same.url]
        async with gateway_state(fleet, [first.url], urls) as state:
            await state.add_initial_workers()
            w = {x.url: x for x in state.router.workers()}
            assert w[first.url].healthy and w[same.url].healthy
            assert not w[renamed.url].healthy
            assert "serves the model 'other-model'" in (w[renamed.url].refused or "")
            assert not w[resized.url].healthy
            assert "vocabulary of 1024 tokens" in (w[resized.url].refused or "")
            assert state.router.pick_decode([1, 2, 3], with_prefill=True) is w[same.url]
            # The served limit: the least that the usable workers take.
            assert state.max_model_len == 120

    asyncio.run(go())


def test_cluster_token_mismatch_is_refused_until_fixed(
    fleet: Fleet, caplog: pytest.LogCaptureFixture
) -> None:
    """A worker whose request plane holds another cluster token is out of
    routing (not just unreachable when a request tries it), says so once in
    the log and in /health's reasons, and joins once it holds the gateway's."""
    caplog.set_level(logging.INFO)
    worker = fleet.add("both", token="not-the-gateways")

    async def go() -> None:
        async with gateway_state(fleet, [], [worker.url]) as state:
            await state.add_initial_workers()
            (listed,) = state.router.workers()
            assert not listed.healthy
            assert "cluster token" in (listed.refused or ""), listed.last_error
            assert not state.ready  # no facts from a worker that cannot serve
            for _ in range(3):
                await state.health.check_all()
                await state.dispatcher.prune()
            assert len(not_usable_lines(caplog, worker.url)) == 1, caplog.text
            with pytest.raises(NoWorkerAvailable, match="cluster token"):
                await state.wait_ready()
            fleet.listen(worker.endpoint, TOKEN)  # restarted with the right token
            deadline = time.monotonic() + 5
            while not listed.healthy:
                assert time.monotonic() < deadline, listed.last_error
                await asyncio.sleep(0.1)
                await state.health.check_all()
            assert listed.refused is None and state.ready

    asyncio.run(go())


def test_worker_named_for_both_pools_keeps_its_own(fleet: Fleet) -> None:
    """A prefill worker also named with --decode: its prefill entry serves;
    the decode one is not added (logged), and nothing raises."""
    worker = fleet.add("prefill")

    async def go() -> None:
        async with gateway_state(fleet, [worker.url], [worker.url]) as state:
            await state.add_initial_workers()
            (listed,) = state.router.workers()
            assert listed.role == "prefill" and listed.healthy and listed.refused is None
            assert state.ready

    asyncio.run(go())


def test_a_check_that_breaks_leaves_the_worker_down(fleet: Fleet) -> None:
    """An admission check failing in a way nobody foresaw: the worker is down
    with the reason, the gateway goes on, and a later round admits it."""
    worker = fleet.add("both")
    broken = [True]

    async def check(_: Any) -> None:
        if broken[0]:
            raise KeyError("surprise")

    async def go() -> None:
        async with gateway_state(fleet, [], [worker.url]) as state:
            state.health.checks.insert(0, check)
            await state.add_initial_workers()
            (listed,) = state.router.workers()
            assert not listed.healthy and "surprise" in (listed.last_error or "")
            broken[0] = False
            await state.health.check_all()
            assert listed.healthy and state.ready

    asyncio.run(go())
