"""Failures the gateway reports for what they are, with worker processes
(tiny model, CPU, tcp KV transfer): a worker it cannot use says why (no
tokenizer, a cluster token that differs) in /health, /metrics, one log line
and a 503, instead of a gateway that exits or looks healthy; a decode worker
killed mid-request is a failed worker, not one "shutting down"; a prompt
that fits the context but not the workers' KV pools is a 400, and
/v1/models reports the limit that holds. Without workers: the engine's
refusal of a prompt is a 400, a stopped worker's error names the worker,
and a tool call cut by the length limit leaves no markup in the content.

One prefill and one decode worker (the decode worker's KV pool holds fewer
tokens than the context) and a gateway over them are started once for the
module; other gateways and workers are per test. Tests that ran requests end
with every worker's KV pool back to its starting free-page count; worker and
gateway logs are printed when a test fails.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import AsyncIterator, Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
from test_gateway_dispatch import FakeWorker, router_with
from test_gateway_start_order import wait_answering
from workers import (
    REPO,
    Worker,
    dump_log,
    free_port,
    launch_workers,
    stop,
    worker_cmd,
)

from gateway.dispatch import Dispatcher
from gateway.openai.choices import ChoiceEvent, choice_stream
from gateway.openai.errors import APIError
from gateway.openai.tools import tool_call_events
from gateway.text import Tokenizer
from gateway.text.tool_parsers import (
    ForcedToolParser,
    HermesToolParser,
    Llama3JsonToolParser,
    ToolCall,
    ToolCallParser,
)
from protocol.client import WorkerDisconnected
from protocol.finish import WORKER_STOPPED
from protocol.sampling import SamplingParams
from protocol.to_gateway import TokenDelta
from worker.config import CLUSTER_TOKEN_ENV

TOKEN = "fail-loudly-cluster-secret"
WORKER_ENV = {CLUSTER_TOKEN_ENV: TOKEN, "OMP_NUM_THREADS": "1"}
CONTEXT = 1024
PAGE_SIZE = 4
DECODE_PAGES = 32
"""The decode worker's pool: 31 allocatable pages of 4 tokens, far below the context."""
ENGINE: dict[str, Any] = dict(
    page_size=PAGE_SIZE, context_length=CONTEXT, transfer_backend="tcp", transfer_timeout_s=10
)
HEALTH_INTERVAL_S = 0.2
DRAIN_TIMEOUT_S = 20.0
LOGS: list[Path] = []
"""Logs of this module's live processes, printed when a test fails."""


@pytest.fixture(autouse=True)
def _dump_logs_on_failure(request: pytest.FixtureRequest) -> Iterator[None]:
    failed = request.session.testsfailed
    yield
    if request.session.testsfailed > failed:
        for path in LOGS:
            dump_log(request.config, path, 80)


# -- processes ------------------------------------------------------------------------


@dataclass
class Gateway:
    url: str
    proc: subprocess.Popen[bytes]
    log_path: Path

    def health(self) -> tuple[int, dict[str, Any]]:
        resp = httpx.get(f"{self.url}/health", timeout=10)
        return resp.status_code, resp.json()

    def worker_view(self, url: str) -> dict[str, Any]:
        _, body = self.health()
        (entry,) = [w for w in body["workers"] if w["url"] == url]
        return entry

    def client(self) -> openai.OpenAI:
        return openai.OpenAI(base_url=f"{self.url}/v1", api_key="unused", max_retries=0, timeout=60)

    def log_lines(self, text: str) -> list[str]:
        return [line for line in self.log_path.read_text().splitlines() if text in line]


@contextlib.contextmanager
def gateway(
    log_path: Path, args: Sequence[str], token: str | None, ready: bool = True
) -> Iterator[Gateway]:
    """``python -m gateway ARGS`` on a free port (``token``: its cluster token),
    up once /health answers at all (``ready``: answers 200); always stopped."""
    port = free_port()
    cmd = [sys.executable, "-m", "gateway", "--host", "127.0.0.1", "--port", str(port)]
    cmd += ["--health-interval-s", str(HEALTH_INTERVAL_S), "--log-level", "info", *args]
    env = {k: v for k, v in os.environ.items() if k != CLUSTER_TOKEN_ENV}
    if token:
        env[CLUSTER_TOKEN_ENV] = token
    with open(log_path, "wb") as log:
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, cwd=REPO, env=env)
    LOGS.append(log_path)
    gw = Gateway(f"http://127.0.0.1:{port}", proc, log_path)
    try:
        wait_answering(proc, f"{gw.url}/health", log_path, ready=ready, timeout=10)
        yield gw
    finally:
        stop(proc)
        LOGS.remove(log_path)


def _spec(log_dir: Path, name: str, module: str, role: str, model: str, **settings: Any) -> Any:
    port = free_port()
    cmd = worker_cmd(module, model, port, role=role, **{**ENGINE, **settings})
    return cmd, port, log_dir / f"{name}.log", WORKER_ENV


@contextlib.contextmanager
def logged_worker(spec: Any, new_session: bool = False) -> Iterator[Worker]:
    """The worker of ``spec`` (``launch_workers``), its log in ``LOGS`` while it runs."""
    with launch_workers([spec], new_session=new_session) as (w,):
        LOGS.append(w.log_path)
        try:
            yield w
        finally:
            LOGS.remove(w.log_path)


@dataclass
class Cluster:
    prefill: Worker
    decode: Worker
    gw: Gateway

    @property
    def workers(self) -> list[Worker]:
        return [self.prefill, self.decode]


@pytest.fixture(scope="module")
def cluster(model_dir: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cluster]:
    log_dir = tmp_path_factory.mktemp("fail-loudly")
    specs = [
        _spec(log_dir, "prefill", "prefill_server", "prefill", model_dir, num_pages=256),
        _spec(log_dir, "decode", "decode_server", "decode", model_dir, num_pages=DECODE_PAGES),
    ]
    with launch_workers(specs) as (p, d):
        LOGS.extend([p.log_path, d.log_path])
        try:
            args = ["--prefill", p.url, "--decode", d.url]
            with gateway(log_dir / "gateway.log", args, TOKEN) as gw:
                yield Cluster(p, d, gw)
        finally:
            LOGS.clear()


def free_pages(workers: Sequence[Worker]) -> dict[str, int]:
    return {w.name: w.stats()["available_pages"] for w in workers}


def assert_pools_back(workers: Sequence[Worker], start: dict[str, int]) -> None:
    """Every worker idle, its KV pool back to its starting free-page count."""
    deadline = time.monotonic() + DRAIN_TIMEOUT_S
    while True:
        stats = {w.name: w.stats() for w in workers}
        now = {name: s["available_pages"] for name, s in stats.items()}
        busy = {n: s for n, s in stats.items() if s["running"] or s.get("in_flight")}
        if now == start and not busy:
            return
        assert time.monotonic() < deadline, f"pools not back: {now} != {start}; busy {busy}"
        time.sleep(0.05)


def prompt_ids(n: int) -> list[int]:
    """``n`` token ids of the tiny model (in [3, 500): no special tokens)."""
    return [3 + (7 * i) % 497 for i in range(n)]


# -- a prompt that fits the context but not the KV pool ----------------------------


def test_max_model_len_is_what_the_pools_hold(cluster: Cluster) -> None:
    gw = cluster.gw
    limits = [w.info()["max_model_len"] for w in cluster.workers]
    limit = min(limits)
    assert limit == (DECODE_PAGES - 1) * PAGE_SIZE < CONTEXT
    model = gw.client().models.list().data[0]
    assert model.model_extra and model.model_extra["max_model_len"] == limit
    start = free_pages(cluster.workers)

    client = gw.client()
    # A prompt the decode pool cannot hold: a 400 that says why, not a
    # retryable 502.
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model=model.id, prompt=prompt_ids(limit + 6), max_tokens=1)
    err = e.value
    assert err.status_code == 400 and err.type == "invalid_request_error"
    assert err.param == "prompt" and str(limit) in err.message and "KV pool" in err.message
    # Prompt plus max_tokens beyond the limit: max_tokens is at fault.
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model=model.id, prompt=prompt_ids(limit - 20), max_tokens=40)
    assert e.value.param == "max_tokens" and str(limit) in e.value.message
    # One that fits runs, on both workers.
    resp = client.completions.create(
        model=model.id,
        prompt=prompt_ids(limit - 20),
        max_tokens=8,
        temperature=0,
        extra_body={"ignore_eos": True},
    )
    assert resp.choices[0].finish_reason == "length" and resp.usage.completion_tokens == 8
    assert_pools_back(cluster.workers, start)


def test_engine_refusal_of_a_prompt_is_a_400(model_dir: str) -> None:
    """A prompt the engine refuses for itself can never succeed anywhere: its
    refusal names the prompt (``error_param``), and the gateway answers a 400
    naming the request's field, not a retryable 502. The refusal is the
    engine's own, carried as a worker carries it."""
    from engine.llm import LLM
    from engine.request import EngineRequestError
    from worker.loop import error_delta

    tokenizer = Tokenizer.from_dir(model_dir)
    llm = LLM(model_dir, device="cpu", page_size=4, num_pages=32)
    with pytest.raises(EngineRequestError) as refused:
        llm.engine.build_request("r", [5] * 300, SamplingParams(max_tokens=2))
    assert refused.value.param == "prompt"
    delta = error_delta("r", str(refused.value), refused.value.param)

    class Refusing:
        async def stream(self, *_: Any, **__: Any) -> AsyncIterator[TokenDelta]:
            yield delta

    async def go() -> APIError:
        spec = SamplingParams(max_tokens=2)
        stream = choice_stream(
            Refusing(), tokenizer, [5] * 300, spec, [], "r", None, {"prompt": "messages"}
        )  # type: ignore[arg-type]
        with pytest.raises(APIError) as e:
            async for _ in stream:
                pass
        return e.value

    err = asyncio.run(go())
    assert err.status == 400 and err.type == "invalid_request_error"
    assert err.param == "messages" and err.message == f"messages: {refused.value}"
    assert "KV pool holds at most 124 tokens" in err.message


# -- a worker the gateway cannot use says why ----------------------------------------


def test_cluster_token_mismatch_is_an_unhealthy_worker(cluster: Cluster, tmp_path: Path) -> None:
    """A gateway without the workers' cluster token: /health and /metrics
    show the workers unusable with the reason, logged once however many
    health rounds pass; a request is a 503 that says why, at once."""
    p, d = cluster.prefill, cluster.decode
    args = ["--prefill", p.url, "--decode", d.url, "--connect-timeout-s", "3"]
    with gateway(tmp_path / "gateway-no-token.log", args, None, ready=False) as gw:
        status, body = gw.health()
        assert status == 503 and body["status"] == "unavailable"
        for w in (p, d):
            view = gw.worker_view(w.url)
            assert view["healthy"] is False
            assert "cluster token" in view["last_error"], view
        metrics = httpx.get(f"{gw.url}/metrics", timeout=10).text
        assert f'gateway_worker_healthy{{url="{d.url}",role="decode"}} 0' in metrics
        t0 = time.monotonic()
        resp = httpx.post(
            f"{gw.url}/v1/completions",
            json={"model": "m", "prompt": "Hello", "max_tokens": 2},
            timeout=30,
        )
        assert time.monotonic() - t0 < 2.0, "the request waited for a worker that cannot serve"
        assert resp.status_code == 503, resp.text
        assert "cluster token" in resp.json()["error"]["message"]
        # Rounds of checks (every 0.5 s while a worker is down): one line each.
        time.sleep(2.0)
        assert gw.proc.poll() is None
        for w in (p, d):
            lines = gw.log_lines(f"worker {w.url} is not usable")
            assert len(lines) == 1, lines
            assert "cluster token" in lines[0]


def test_worker_without_tokenizer_is_refused_with_the_fix(
    model_dir: str, tmp_path: Path, request: pytest.FixtureRequest
) -> None:
    """A worker whose checkpoint has no tokenizer.json: the gateway keeps
    serving, logs one line naming the worker and the fix, and answers 503
    with that reason."""
    bare = tmp_path / "no-tokenizer"
    bare.mkdir()
    for name in ("config.json", "generation_config.json", "model.safetensors"):
        shutil.copy(Path(model_dir) / name, bare / name)
    spec = _spec(tmp_path, "no-tokenizer", "decode_server", "both", str(bare), num_pages=64)
    with (
        logged_worker(spec) as w,
        gateway(tmp_path / "gateway.log", ["--decode", w.url], TOKEN, ready=False) as gw,
    ):
        status, _ = gw.health()
        assert status == 503
        view = gw.worker_view(w.url)
        assert view["healthy"] is False and "tokenizer.json" in view["last_error"]
        resp = httpx.post(
            f"{gw.url}/v1/chat/completions",
            json={"model": "m", "messages": [{"role": "user", "content": "Hi"}]},
            timeout=30,
        )
        assert resp.status_code == 503, resp.text
        error = resp.json()["error"]
        assert error["type"] == "server_error" and "tokenizer.json" in error["message"]
        time.sleep(1.5)
        assert gw.proc.poll() is None
        (line,) = gw.log_lines(f"worker {w.url} is not usable")
        assert "serves no tokenizer files" in line and "--load-format dummy" in line
        assert "Traceback" not in gw.log_path.read_text()


# -- a crashed decode worker ---------------------------------------------------------


def stream_until_error(gw: Gateway, on_chunk3: Callable[[], object]) -> str:
    """A long streamed completion through ``gw`` that calls ``on_chunk3`` when
    its third chunk comes and must then end in an API error: that error's
    message. (Long: about a second of the tiny model's decode on a fast CPU,
    so it is still running when a short drain started at its third chunk ends.)"""
    client = gw.client()
    model = client.models.list().data[0].id
    stream = client.completions.create(
        model=model,
        prompt="Hello there",
        max_tokens=1000,
        stream=True,
        extra_body={"ignore_eos": True},
    )
    chunks = 0
    with pytest.raises(openai.APIError) as e:
        for _ in stream:
            chunks += 1
            if chunks == 3:
                on_chunk3()
    return str(e.value.message)


def test_killed_decode_worker_is_a_failed_worker(
    cluster: Cluster, model_dir: str, tmp_path: Path
) -> None:
    """A decode worker whose process is SIGKILLed mid-stream: the client reads
    that the decode worker failed, naming it, not that it is shutting down."""
    p = cluster.prefill
    spec = _spec(tmp_path, "decode-killed", "decode_server", "decode", model_dir, num_pages=256)
    with logged_worker(spec, new_session=True) as d:
        try:
            start = free_pages([p])
            args = ["--prefill", p.url, "--decode", d.url]
            with gateway(tmp_path / "gateway.log", args, TOKEN) as gw:
                # The worker's own process, as a crash takes it: its engine
                # process is left to notice.
                message = stream_until_error(gw, lambda: os.kill(d.proc.pid, signal.SIGKILL))
                assert f"decode worker {d.url} failed" in message, message
                # The engine process, left without its front, says so itself.
                assert "front process exited" in message, message
                assert "shutting down" not in message
            assert_pools_back([p], start)
        finally:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(d.proc.pid, signal.SIGKILL)


def test_draining_decode_worker_is_shutting_down(
    cluster: Cluster, model_dir: str, tmp_path: Path
) -> None:
    """A decode worker stopped with SIGTERM drains (its /health says so) and
    then ends what is still running: that request reads that the worker is
    shutting down."""
    p = cluster.prefill
    spec = _spec(
        tmp_path, "decode-drained", "decode_server", "decode", model_dir,
        num_pages=256, shutdown_timeout_s=0.2,
    )  # fmt: skip
    with logged_worker(spec) as d:
        start = free_pages([p])
        args = ["--prefill", p.url, "--decode", d.url]
        with gateway(tmp_path / "gateway.log", args, TOKEN) as gw:
            message = stream_until_error(gw, lambda: d.proc.send_signal(signal.SIGTERM))
            assert f"decode worker {d.url} is shutting down" in message, message
        assert_pools_back([p], start)


class StoppingWorker(FakeWorker):
    """Answers one token, then the error an engine process sends when it stops."""

    def replies(self, rid: str) -> list[TokenDelta]:
        return [TokenDelta(rid, [10], [-0.5]), TokenDelta(rid, [], [], "error", 0, WORKER_STOPPED)]


def test_stopped_worker_errors_name_the_worker() -> None:
    """The error a stopping engine sends is a failure of that worker unless
    the worker said it was draining; a dropped connection is a failure of
    the worker (named by its URL, not its request-plane endpoint)."""
    spec = SamplingParams(max_tokens=3, temperature=0.0)

    async def last_error(worker: FakeWorker, stopping: bool) -> str:
        router, (w,) = router_with(worker.endpoint)
        w.stopping = stopping
        d = Dispatcher(router, timeout_s=10, connect_timeout_s=1)
        try:
            deltas = [x async for x in d.stream([1, 2], spec)]
        finally:
            await d.close()
        assert deltas[-1].finish_reason == "error"
        assert w.breaker.failures == 1
        return deltas[-1].error or ""

    async def go() -> None:
        async with StoppingWorker() as worker:
            crashed = await last_error(worker, stopping=False)
            assert crashed.startswith("both worker http://worker-0 failed"), crashed
            assert "shutting down" not in crashed
            drained = await last_error(worker, stopping=True)
            assert drained.startswith("both worker http://worker-0 is shutting down"), drained
        async with FakeWorker(tokens=3, die_after=1) as dying:
            router, _ = router_with(dying.endpoint)
            d = Dispatcher(router, timeout_s=10, connect_timeout_s=1)
            try:
                with pytest.raises(WorkerDisconnected) as e:
                    async for _ in d.stream([1, 2], spec):
                        pass
            finally:
                await d.close()
            assert str(e.value) == "both worker http://worker-0 failed (connection lost)"

    asyncio.run(go())


# -- a tool call cut by the length limit ----------------------------------------------


CUT_CASES: dict[str, tuple[type[ToolCallParser], str, str, list[ToolCall]]] = {
    # Each: the parser, an output cut by max_tokens, its content and its calls.
    "forced-list": (
        ForcedToolParser,
        '[{"name": "add", "arguments": {"a": 1}}, {"name": "get_time", "arguments',
        "",
        [ToolCall("add", '{"a": 1}')],
    ),
    "forced-name": (ForcedToolParser, '{"name": "get_ti', "", []),
    "hermes": (
        HermesToolParser,
        'Let me check.\n<tool_call>\n{"name": "get_time", "argu',
        "Let me check.\n",
        [],
    ),
    "hermes-tag": (HermesToolParser, "Let me check. <tool_c", "Let me check. ", []),
    "hermes-after-call": (
        HermesToolParser,
        '<tool_call>{"name": "add", "arguments": {}}</tool_call>\n<tool_call>{"arguments": {',
        "",
        [ToolCall("add", "{}")],
    ),
    "llama3": (Llama3JsonToolParser, '<|python_tag|>{"name": "get_time", "param', "", []),
    "llama3-second": (
        Llama3JsonToolParser,
        '{"name": "add", "parameters": {}}; {"parameters": {"a"',
        "",
        [ToolCall("add", "{}")],
    ),
}


@pytest.mark.parametrize("case", sorted(CUT_CASES))
def test_tool_call_cut_by_length_leaves_no_markup(case: str) -> None:
    cls, text, content, calls = CUT_CASES[case]
    assert cls().parse(text, cut=True) == (content, calls)
    # Streamed in pieces of every size: the same.
    for size in range(1, len(text) + 1):
        parser = cls()
        got = ""
        for i in range(0, len(text), size):
            got += parser.feed(text[i : i + size])[0]
        got += parser.finish(cut=True)[0]
        assert got == content, size
    # Not cut (the model stopped there): the text is kept, as before.
    assert cls().parse(text)[0] != content


def test_cut_tool_call_in_the_choice_events() -> None:
    """Through ``tool_call_events``, streamed as a response writes it: the
    text before the cut call is content, the call is gone, and the choice
    ends with "length"."""
    text = 'Sure.\n<tool_call>\n{"name": "get_time", "arguments'

    async def events() -> AsyncIterator[ChoiceEvent]:
        pieces = [text[i : i + 5] for i in range(0, len(text), 5)]
        for k, piece in enumerate(pieces):
            last = k == len(pieces) - 1
            yield ChoiceEvent(piece, [k], [0.0], "length" if last else None, 0)

    async def collect() -> list[ChoiceEvent]:
        return [ev async for ev in tool_call_events(events(), HermesToolParser())]

    out = asyncio.run(collect())
    assert "".join(ev.text for ev in out) == "Sure.\n"
    assert all(ev.tool_calls is None for ev in out)
    assert out[-1].finish_reason == "length"
