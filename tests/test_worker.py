"""The worker runtime end to end: one real ``python -m decode_server --role both``
process (front + engine process) on the tiny model, driven over HTTP and the
ZMQ request plane through ``WorkerClient``."""

from __future__ import annotations

import asyncio
import contextlib
import http.server
import json
import os
import random
import signal
import subprocess
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import msgspec
import pytest
import zmq
from workers import (
    REPO,
    Worker,
    dump_log,
    free_port,
    launch_worker,
    log_tail,
    worker_cmd,
)

from engine.llm import LLM
from protocol import to_gateway, to_worker
from protocol.auth import keys_for, secure_client
from protocol.client import (
    WorkerClient,
    WorkerClientClosed,
    WorkerDisconnected,
    WorkerTimeout,
    WorkerUnreachable,
)
from protocol.sampling import SamplingParams
from protocol.to_gateway import TokenDelta
from protocol.to_worker import Generate, Prefill
from worker.cli import CLUSTER_TOKEN_ENV

pytestmark = pytest.mark.e2e

VOCAB = 512
TOKEN = "s3cret"
"""The module worker's cluster token: its request plane takes only its CURVE keys."""
AUTH = keys_for(TOKEN)
ENGINE = dict(
    page_size=4,
    num_pages=300,
    max_num_batched_tokens=64,
    chunk_size=16,
    max_running_requests=32,
    context_length=128,
)


class FakeGateway:
    """Records the worker registrations POSTed to /admin/workers."""

    def __init__(self) -> None:
        self.registrations: list[tuple[dict[str, Any], str | None]] = []
        records = self.registrations

        class Handler(http.server.BaseHTTPRequestHandler):
            def do_POST(self) -> None:
                body = self.rfile.read(int(self.headers.get("content-length", 0)))
                if self.path == "/admin/workers":
                    records.append((json.loads(body), self.headers.get("authorization")))
                self.send_response(200 if self.path == "/admin/workers" else 404)
                self.send_header("content-length", "0")
                self.end_headers()

            def log_message(self, *args: Any) -> None:
                pass

        self.server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)
        self.thread.start()

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


@pytest.fixture(scope="module")
def gateway() -> Iterator[FakeGateway]:
    gw = FakeGateway()
    try:
        yield gw
    finally:
        gw.close()


@pytest.fixture(scope="module")
def worker(
    request: pytest.FixtureRequest,
    model_dir: str,
    gateway: FakeGateway,
    tmp_path_factory: pytest.TempPathFactory,
) -> Iterator[Worker]:
    """The module's worker; its log is printed if any test of the module failed."""
    log_path = tmp_path_factory.mktemp("worker") / "worker.log"
    port = free_port()
    cmd = worker_cmd("decode_server", model_dir, port, register=gateway.url, **ENGINE)
    failed_before = request.session.testsfailed
    try:
        with launch_worker(cmd, port, log_path, {CLUSTER_TOKEN_ENV: TOKEN}) as w:
            yield w
    finally:
        if request.session.testsfailed > failed_before:
            dump_log(request.config, log_path)


@pytest.fixture(autouse=True)
def pool_back_to_start(request: pytest.FixtureRequest) -> Iterator[None]:
    """Every test on the shared worker ends with it idle and every page it had at
    the start available again."""
    yield
    if "worker" not in request.fixturenames:
        return
    worker: Worker = request.getfixturevalue("worker")
    start = worker.start_info["stats"]
    stats = worker.wait_stats(
        lambda s: (
            s["running"] == 0
            and s["waiting"] == 0
            and s["in_flight"] == 0
            and s["locked_pages"] == 0
            and s["available_pages"] == start["available_pages"]
        ),
        "idle with every page available",
    )
    assert stats["available_pages"] == stats["total_pages"]


@pytest.fixture(scope="module")
def offline(model_dir: str) -> LLM:
    return LLM(model_dir, device="cpu", **ENGINE)


def greedy(max_tokens: int, ignore_eos: bool = True) -> SamplingParams:
    return SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=ignore_eos)


def prompts_with_shared_prefixes(n: int, seed: int) -> list[list[int]]:
    g = random.Random(seed)
    prefixes = [[g.randrange(3, VOCAB) for _ in range(g.randrange(6, 30))] for _ in range(3)]
    return [prefixes[i % 3] + [g.randrange(3, VOCAB) for _ in range(1 + 3 * i)] for i in range(n)]


async def collect(client: WorkerClient, msg: Generate | Prefill) -> list[TokenDelta]:
    return [d async for d in client.generate(msg)]


def tokens_of(deltas: list[TokenDelta]) -> list[int]:
    return [t for d in deltas for t in d.token_ids]


def run(coro: Any) -> Any:
    return asyncio.run(coro)


# -- HTTP ----------------------------------------------------------------------


def test_health(worker: Worker) -> None:
    resp = httpx.get(f"{worker.url}/health", timeout=5)
    assert resp.status_code == 200
    assert resp.json() == {"status": "ok"}


def test_server_info(worker: Worker, model_dir: str) -> None:
    info = worker.info()
    assert info["role"] == "both"
    assert info["model"] == model_dir
    assert info["served_model_name"] == Path(model_dir).name
    assert info["request_endpoint"].startswith("tcp://127.0.0.1:")
    assert info["bootstrap_endpoint"] is None
    assert info["page_size"] == 4
    assert info["context_length"] == 128
    assert info["url"] == worker.url
    # Where the start went, in order (the engine's log line says the same).
    assert list(info["start_seconds"]) == ["weights", "KV pool", "attention", "scheduler"]
    assert all(s >= 0 for s in info["start_seconds"].values())
    stats = info["stats"]
    assert stats["total_pages"] == ENGINE["num_pages"] - 1
    for key in ("free_pages", "cached_pages", "available_pages", "running", "waiting"):
        assert isinstance(stats[key], int), key
    assert stats["available_pages"] == stats["free_pages"] + stats["evictable_pages"]


def test_metrics(worker: Worker) -> None:
    resp = httpx.get(f"{worker.url}/metrics", timeout=5)
    assert resp.status_code == 200
    assert resp.headers["content-type"].startswith("text/plain")
    text = resp.text
    assert "worker_engine_up 1" in text
    assert "# TYPE worker_free_pages gauge" in text
    assert f"worker_total_pages {ENGINE['num_pages'] - 1}" in text
    assert "# TYPE worker_running_requests gauge" in text
    assert "# TYPE worker_waiting_requests gauge" in text
    assert "# TYPE worker_prefix_cache_hit_tokens_total counter" in text
    for line in text.splitlines():
        if line and not line.startswith("#"):
            name, value = line.rsplit(" ", 1)
            float(value)
            assert name.startswith("worker_"), line


def test_registers_with_the_gateway(worker: Worker, gateway: FakeGateway) -> None:
    deadline = time.monotonic() + 10
    while not gateway.registrations:
        assert time.monotonic() < deadline, "the worker never registered"
        time.sleep(0.05)
    body, auth = gateway.registrations[0]
    assert body == {"url": worker.url, "role": "both"}
    assert auth == "Bearer s3cret"


# -- generation ------------------------------------------------------------------


def test_concurrent_greedy_matches_offline(worker: Worker, offline: LLM) -> None:
    prompts = prompts_with_shared_prefixes(16, seed=1)
    specs = [greedy(8 + (i % 5) * 4, ignore_eos=i % 2 == 0) for i in range(16)]
    expected = offline.generate(
        prompts,
        [
            SamplingParams(max_tokens=s.max_tokens, temperature=0.0, ignore_eos=s.ignore_eos)
            for s in specs
        ],
    )

    async def go() -> list[list[TokenDelta]]:
        async with WorkerClient(worker.endpoint, timeout_s=30, auth=AUTH) as client:
            return await asyncio.gather(
                *(
                    collect(client, Generate(f"cc-{i}", p, s))
                    for i, (p, s) in enumerate(zip(prompts, specs))
                )
            )

    results = run(go())
    for i, (deltas, exp) in enumerate(zip(results, expected)):
        assert tokens_of(deltas) == exp.token_ids, f"request {i}"
        assert deltas[-1].finish_reason == exp.finish_reason, f"request {i}"
        assert all(d.finish_reason is None for d in deltas[:-1])
        if len(exp.token_ids) > 1:
            assert len(deltas) > 1, f"request {i} did not stream"


def test_streaming_arrives_in_several_deltas(worker: Worker) -> None:
    async def go() -> list[TokenDelta]:
        async with WorkerClient(worker.endpoint, timeout_s=30, auth=AUTH) as client:
            return await collect(client, Generate("stream-1", [5, 6, 7, 8, 9], greedy(12)))

    deltas = run(go())
    assert len(deltas) == 12
    assert [len(d.token_ids) for d in deltas] == [1] * 12
    assert [len(d.logprobs) for d in deltas] == [1] * 12
    assert [d.finish_reason for d in deltas] == [None] * 11 + ["length"]


def test_prefix_cache_hits_are_reported(worker: Worker) -> None:
    g = random.Random(7)
    prefix = [g.randrange(3, VOCAB) for _ in range(24)]
    before = worker.stats()["prefix_cache_hit_tokens"]

    async def go() -> list[TokenDelta]:
        async with WorkerClient(worker.endpoint, timeout_s=30, auth=AUTH) as client:
            await collect(client, Generate("pc-1", prefix + [11, 12], greedy(4)))
            return await collect(client, Generate("pc-2", prefix + [13, 14, 15], greedy(4)))

    deltas = run(go())
    assert deltas[-1].num_cached_tokens >= 24
    assert worker.stats()["prefix_cache_hit_tokens"] >= before + 24
    text = httpx.get(f"{worker.url}/metrics", timeout=5).text
    line = next(
        x for x in text.splitlines() if x.startswith("worker_prefix_cache_hit_tokens_total ")
    )
    assert int(line.split()[1]) >= before + 24


# -- aborts and disconnects --------------------------------------------------------


def test_abort_mid_request(worker: Worker) -> None:
    async def go() -> list[TokenDelta]:
        got: list[TokenDelta] = []
        async with WorkerClient(worker.endpoint, timeout_s=30, auth=AUTH) as client:
            async for d in client.generate(Generate("abort-1", [3, 4, 5, 6], greedy(100))):
                got.append(d)
                if len(got) == 2:
                    await client.abort("abort-1")
        return got

    deltas = run(go())
    assert deltas[-1].finish_reason == "abort"
    assert deltas[-1].token_ids == []
    assert 2 < len(deltas) < 100
    worker.wait_stats(lambda s: s["running"] == 0 and s["in_flight"] == 0, "idle after abort")


def test_closing_the_iterator_aborts_the_request(worker: Worker) -> None:
    aborted = worker.stats()["requests_aborted_total"]

    async def go() -> None:
        async with WorkerClient(worker.endpoint, timeout_s=30, auth=AUTH) as client:
            stream = client.generate(Generate("close-it-1", [3, 4, 5, 6, 7], greedy(100)))
            async for _ in stream:
                break
            await stream.aclose()
            assert client.in_flight == 0
            # The socket still serves other requests.
            assert tokens_of(await collect(client, Generate("close-it-2", [9, 9], greedy(3))))

    run(go())
    worker.wait_stats(
        lambda s: s["requests_aborted_total"] == aborted + 1 and s["running"] == 0,
        "the closed stream's request aborted",
    )


def test_client_that_disconnects_mid_request(worker: Worker) -> None:
    aborted = worker.stats()["requests_aborted_total"]

    async def go() -> None:
        client = WorkerClient(worker.endpoint, timeout_s=30, auth=AUTH)
        await client.start()
        got: list[TokenDelta] = []

        async def consume() -> None:
            async for d in client.generate(Generate("gone-1", [3, 4, 5, 6, 8], greedy(100))):
                got.append(d)

        task = asyncio.create_task(consume())
        while len(got) < 2:
            await asyncio.sleep(0.01)
        await client.close()
        with pytest.raises(WorkerClientClosed):
            await task
        assert len(got) < 100

    run(go())
    worker.wait_stats(
        lambda s: s["requests_aborted_total"] == aborted + 1 and s["in_flight"] == 0,
        "the disconnected client's request aborted",
    )

    # The worker still serves.
    async def again() -> list[TokenDelta]:
        async with WorkerClient(worker.endpoint, timeout_s=30, auth=AUTH) as client:
            return await collect(client, Generate("gone-2", [3, 4], greedy(3)))

    assert len(tokens_of(run(again()))) == 3


def test_requester_that_vanishes_without_abort(worker: Worker) -> None:
    ctx = zmq.Context()
    try:
        sock = ctx.socket(zmq.DEALER)
        secure_client(sock, AUTH)
        sock.connect(worker.endpoint)
        sock.send(to_worker.encoder.encode(Generate("vanish-1", [3, 4, 5], greedy(30))))
        assert sock.poll(10_000), "no first delta"
        sock.close(linger=0)
    finally:
        ctx.term()
    # Its remaining deltas go nowhere; the request still runs to its end.
    worker.wait_stats(lambda s: s["in_flight"] == 0 and s["running"] == 0, "vanished request done")
    assert httpx.get(f"{worker.url}/health", timeout=5).status_code == 200


# -- errors ------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("prompt", "spec", "message"),
    [
        ([], greedy(4), "prompt is empty"),
        ([5] * ENGINE["context_length"], greedy(4), "context length"),
        ([3, VOCAB + 10], greedy(4), "outside the vocabulary"),
    ],
    ids=["empty", "too-long", "vocab"],
)
def test_invalid_request_gives_error_delta(
    worker: Worker, prompt: list[int], spec: SamplingParams, message: str
) -> None:
    async def go() -> list[TokenDelta]:
        async with WorkerClient(worker.endpoint, timeout_s=30, auth=AUTH) as client:
            return await collect(client, Generate(f"bad-{message}", prompt, spec))

    deltas = run(go())
    assert len(deltas) == 1
    assert deltas[0].finish_reason == "error"
    assert deltas[0].token_ids == []
    assert message in (deltas[0].error or ""), deltas[0].error


@pytest.mark.parametrize(
    ("sampling", "message"),
    [
        ({"temperature": -1.0}, "temperature"),
        ({"top_p": 0.0}, "top_p"),
        ({"max_tokens": 0}, "max_tokens"),
    ],
    ids=["temperature", "top_p", "max_tokens"],
)
def test_out_of_range_sampling_gives_error_delta(
    worker: Worker, sampling: dict[str, float], message: str
) -> None:
    # SamplingParams refuses these values on construction, so only a requester
    # that skips it (a raw frame) can send them; the worker still answers.
    ctx = zmq.Context()
    try:
        sock = ctx.socket(zmq.DEALER)
        secure_client(sock, AUTH)
        sock.linger = 0
        sock.connect(worker.endpoint)
        rid = f"bad-{message}"
        frame = {"type": "generate", "rid": rid, "prompt_ids": [3, 4], "sampling": sampling}
        sock.send(msgspec.msgpack.encode(frame))
        assert sock.poll(10_000)
        deltas = to_gateway.decoder.decode(sock.recv()).deltas
        sock.close()
    finally:
        ctx.term()
    assert [(d.rid, d.finish_reason, d.token_ids) for d in deltas] == [(rid, "error", [])]
    assert message in (deltas[0].error or ""), deltas[0].error


def test_prefill_message_to_role_both_is_an_error(worker: Worker) -> None:
    async def go() -> list[TokenDelta]:
        async with WorkerClient(worker.endpoint, timeout_s=30, auth=AUTH) as client:
            msg = Prefill("pf-1", [3, 4, 5], greedy(4), "room-1", "tcp://127.0.0.1:1")
            return await collect(client, msg)

    deltas = run(go())
    assert [d.finish_reason for d in deltas] == ["error"]
    assert "Prefill" in (deltas[0].error or "")


def test_duplicate_rid_while_running(worker: Worker) -> None:
    async def go() -> tuple[list[TokenDelta], list[TokenDelta]]:
        async with (
            WorkerClient(worker.endpoint, timeout_s=30, auth=AUTH) as a,
            WorkerClient(worker.endpoint, timeout_s=30, auth=AUTH) as b,
        ):
            first: list[TokenDelta] = []
            second: list[TokenDelta] = []
            async for d in a.generate(Generate("dup-1", [3, 4, 5, 6], greedy(40))):
                first.append(d)
                if len(first) == 1:
                    second = await collect(b, Generate("dup-1", [7, 8], greedy(4)))
            # The client itself refuses a rid it already has in flight.
            stream = a.generate(Generate("dup-2", [3], greedy(30)))
            async with contextlib.aclosing(stream):
                await anext(stream)
                with pytest.raises(ValueError, match="already in flight"):
                    await anext(a.generate(Generate("dup-2", [3], greedy(4))))
            return first, second

    first, second = run(go())
    assert [d.finish_reason for d in second] == ["error"]
    assert "already in use" in (second[0].error or "")
    assert first[-1].finish_reason == "length"
    assert len(tokens_of(first)) == 40


def test_malformed_frames_are_ignored_or_answered(worker: Worker) -> None:
    ctx = zmq.Context()
    try:
        sock = ctx.socket(zmq.DEALER)
        secure_client(sock, AUTH)
        sock.linger = 0
        sock.connect(worker.endpoint)
        sock.send(b"\x00not msgpack at all")
        bad = {
            "type": "generate",
            "rid": "mal-1",
            "prompt_ids": [3],
            "sampling": {"max_tokens": "x"},
        }
        sock.send(msgspec.msgpack.encode(bad))
        assert sock.poll(10_000)
        tokens = to_gateway.decoder.decode(sock.recv())
        assert [d.rid for d in tokens.deltas] == ["mal-1"]
        assert tokens.deltas[0].finish_reason == "error"
        assert "malformed request" in (tokens.deltas[0].error or "")
        sock.close()
    finally:
        ctx.term()
    assert worker.stats()["bad_frames_total"] >= 2
    assert httpx.get(f"{worker.url}/health", timeout=5).status_code == 200


def test_client_timeout_when_nobody_answers() -> None:
    """Connected to a peer that never answers: the request times out."""
    ctx = zmq.Context()
    router = ctx.socket(zmq.ROUTER)
    port = router.bind_to_random_port("tcp://127.0.0.1")

    async def go() -> None:
        async with WorkerClient(f"tcp://127.0.0.1:{port}", timeout_s=0.3) as client:
            with pytest.raises(WorkerTimeout):
                await collect(client, Generate("t-1", [3], greedy(2)))
            assert client.in_flight == 0

    try:
        run(go())
    finally:
        router.close(linger=0)
        ctx.term()


def test_client_unreachable_when_nobody_listens() -> None:
    """No connection: the request is refused before it is sent, within the
    connect timeout (a caller may send it elsewhere)."""

    async def go() -> None:
        endpoint = f"tcp://127.0.0.1:{free_port()}"
        async with WorkerClient(endpoint, timeout_s=30, connect_timeout_s=0.3) as client:
            t0 = time.monotonic()
            with pytest.raises(WorkerUnreachable):
                await collect(client, Generate("t-1", [3], greedy(2)))
            assert time.monotonic() - t0 < 5
            assert client.in_flight == 0 and not client.connected

    run(go())


# -- process life ------------------------------------------------------------------


def test_startup_failure_exits_with_the_error(tmp_path: Path) -> None:
    cmd = worker_cmd("prefill_server", str(tmp_path / "nope"), free_port())
    out = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=120)
    assert out.returncode != 0
    last = out.stderr.strip().splitlines()[-1]
    assert last.startswith("worker failed: ModelNotFound: --model"), out.stderr
    assert "Traceback" not in out.stderr, out.stderr


def test_engine_death_stops_the_front(model_dir: str, tmp_path: Path) -> None:
    port = free_port()
    cmd = worker_cmd("prefill_server", model_dir, port, page_size=4, num_pages=64)
    with launch_worker(cmd, port, tmp_path / "worker.log") as w:
        engine_pid = w.info()["engine_pid"]

        async def go() -> None:
            async with WorkerClient(w.endpoint, timeout_s=30) as client:
                with pytest.raises(WorkerDisconnected):
                    async for d in client.generate(Generate("die-1", [3, 4], greedy(200))):
                        if d.token_ids:
                            os.kill(engine_pid, signal.SIGKILL)

        run(go())
        assert w.proc.wait(30) != 0
        with contextlib.suppress(httpx.HTTPError):
            assert httpx.get(f"{w.url}/health", timeout=2).status_code == 503
    log = log_tail(tmp_path / "worker.log")
    assert "engine process exited with code -9" in log, log


def test_sigterm_fails_in_flight_requests_and_exits_cleanly(model_dir: str, tmp_path: Path) -> None:
    # No drain (--shutdown-timeout-s 0): SIGTERM stops at once; the drain is
    # tested in test_worker_lifecycle.py. Eight streams as long as the context
    # allows keep the engine busy for seconds, far longer than a stop takes,
    # so none can finish normally in between.
    port = free_port()
    settings = {**ENGINE, "num_pages": 1200}
    cmd = worker_cmd("decode_server", model_dir, port, shutdown_timeout_s=0.0, **settings)
    with launch_worker(cmd, port, tmp_path / "worker.log") as w:
        engine_pid = w.info()["engine_pid"]

        async def one(client: WorkerClient, i: int, first: asyncio.Event) -> list[TokenDelta] | str:
            got: list[TokenDelta] = []
            try:
                async for d in client.generate(Generate(f"term-{i}", [3, 4, 5 + i], greedy(500))):
                    got.append(d)
                    if len(got) == 2:
                        first.set()
            except WorkerDisconnected:
                return "disconnected"
            return got

        async def go() -> list[list[TokenDelta] | str]:
            first = asyncio.Event()
            async with WorkerClient(w.endpoint, timeout_s=30) as client:
                tasks = [asyncio.create_task(one(client, i, first)) for i in range(8)]
                await first.wait()
                w.proc.send_signal(signal.SIGTERM)
                return list(await asyncio.gather(*tasks))

        for result in run(go()):
            assert result == "disconnected" or (
                result[-1].finish_reason == "error" and "shutting down" in (result[-1].error or "")
            ), result[-1]
        assert w.proc.wait(30) == 0
    with pytest.raises(ProcessLookupError):
        os.kill(engine_pid, 0)
