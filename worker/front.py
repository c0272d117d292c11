"""The front process of a worker: HTTP (FastAPI on uvicorn) for /health,
/metrics and /server_info, in front of the engine process it spawns.

The front never runs the model and never imports torch. It talks to the engine
process only over the IPC control socket (see ``engine_proc``), asynchronously,
so an HTTP request waits at most for the engine's current step, never blocks
the event loop, and fails with 503 if the engine does not answer in time.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import multiprocessing
import os
import re
import shutil
import signal
import socket
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import httpx
import uvicorn
import zmq
import zmq.asyncio
from fastapi import FastAPI
from fastapi.responses import JSONResponse, PlainTextResponse

from protocol import tokenizer_files
from protocol.aio import cancel_and_wait
from protocol.health import HealthStatus
from protocol.prometheus import HistogramFamily
from worker.config import WorkerConfig
from worker.engine_proc import CtrlOp, decode_ctrl, encode_ctrl, engine_main, setup_logging
from worker.roles import Role

log = logging.getLogger("worker.front")

ASK_TIMEOUT_S = 5.0
"""How long /health, /metrics and /server_info wait for the engine process."""
STOP_GRACE_S = 15.0
"""After asking the engine process to stop, wait this long before SIGTERM."""
REGISTER_REFUSALS = 3
"""Refusals (a 4xx: wrong key, bad role) after which a worker gives up
registering and exits; an unreachable or failing gateway is retried for as
long as the worker runs (it may start first)."""
REGISTER_MAX_DELAY_S = 5.0
REREGISTER_S = 10.0
"""How often a registered worker registers again with every address of the
gateway's name (a replica that started or restarted since learns of it)."""
LIVENESS_POLL_S = 0.2


class EngineUnavailable(RuntimeError):
    """The engine process is dead or did not answer in time."""


class StartupError(RuntimeError):
    """The engine process failed to start; the message says why."""


class EngineHandle:
    """The engine process as seen from the front: spawn it, ask it, stop it."""

    def __init__(self, config: WorkerConfig, role: Role, ctrl_endpoint: str) -> None:
        self.ctrl_endpoint = ctrl_endpoint
        self.proc = multiprocessing.get_context("spawn").Process(
            target=engine_main, args=(config, role, ctrl_endpoint), name=f"{config.role}-engine"
        )
        self._ctx: zmq.asyncio.Context | None = None
        self._sock: zmq.asyncio.Socket | None = None
        self._reader: asyncio.Task[None] | None = None
        self._ids = itertools.count(1)
        self._pending: dict[int, asyncio.Future[dict[str, Any]]] = {}
        self.ready = False

    @property
    def alive(self) -> bool:
        return self.proc.is_alive()

    @property
    def pid(self) -> int | None:
        return self.proc.pid

    def start(self) -> None:
        self.proc.start()
        self._ctx = zmq.asyncio.Context()
        self._sock = self._ctx.socket(zmq.DEALER)
        self._sock.linger = 0
        self._sock.connect(self.ctrl_endpoint)
        self._reader = asyncio.create_task(self._read())

    async def _read(self) -> None:
        assert self._sock is not None
        while True:
            frame = await self._sock.recv()
            try:
                reply = decode_ctrl(frame)
            except Exception as e:
                log.warning("ignoring a malformed control reply: %s", e)
                continue
            fut = self._pending.pop(reply.get("id"), None)  # type: ignore[arg-type]
            if fut is not None and not fut.done():
                fut.set_result(reply)

    async def _send(self, op: CtrlOp) -> asyncio.Future[dict[str, Any]]:
        assert self._sock is not None
        req_id = next(self._ids)
        fut: asyncio.Future[dict[str, Any]] = asyncio.get_running_loop().create_future()
        self._pending[req_id] = fut
        await self._sock.send(encode_ctrl({"id": req_id, "op": op}))
        return fut

    async def ask(self, op: CtrlOp, timeout: float = ASK_TIMEOUT_S) -> dict[str, Any]:
        """Send a control request and return the engine's reply."""
        if not self.alive:
            raise EngineUnavailable(f"engine process exited with code {self.proc.exitcode}")
        fut = await self._send(op)
        deadline = time.monotonic() + timeout
        try:
            while not fut.done():
                left = deadline - time.monotonic()
                if left <= 0:
                    raise EngineUnavailable(f"engine did not answer {op} within {timeout:g}s")
                if not self.alive:
                    raise EngineUnavailable(f"engine process exited with code {self.proc.exitcode}")
                with contextlib.suppress(asyncio.TimeoutError):
                    await asyncio.wait_for(asyncio.shield(fut), min(left, LIVENESS_POLL_S))
            reply = fut.result()
        finally:
            self._drop(fut)
        if not reply.get("ok"):
            raise EngineUnavailable(str(reply.get("error")))
        return reply

    def _drop(self, fut: asyncio.Future[dict[str, Any]]) -> None:
        for key, value in list(self._pending.items()):
            if value is fut:
                del self._pending[key]

    async def wait_ready(self, stop: asyncio.Event) -> dict[str, Any] | None:
        """The engine's ready reply (endpoints and static info); None if ``stop``
        was set first. Raises ``StartupError`` if the engine failed to start."""
        fut = await self._send(CtrlOp.READY)
        try:
            while not fut.done():
                if stop.is_set():
                    return None
                if not self.alive:
                    raise StartupError(
                        f"engine process exited with code {self.proc.exitcode} before it "
                        "was ready (its log is above)"
                    )
                with contextlib.suppress(asyncio.TimeoutError):
                    await asyncio.wait_for(asyncio.shield(fut), LIVENESS_POLL_S)
            reply = fut.result()
        finally:
            self._drop(fut)
        if not reply.get("ok"):
            raise StartupError(str(reply.get("error")))
        self.ready = True
        return reply

    async def stop(self, grace_s: float = STOP_GRACE_S) -> None:
        """Ask the engine process to stop (SIGTERM at once if it is not ready yet);
        SIGTERM, then SIGKILL, if it lingers."""
        if self.proc.pid is not None and self.alive and self.ready:
            try:
                await self.ask(CtrlOp.SHUTDOWN, timeout=2.0)
            except EngineUnavailable as e:
                log.warning("engine did not take the shutdown request: %s", e)
            await asyncio.to_thread(self.proc.join, grace_s)
        if self.proc.pid is not None:
            if self.alive:
                log.warning("stopping the engine process with SIGTERM")
                self.proc.terminate()
                await asyncio.to_thread(self.proc.join, 5.0)
            if self.alive:
                log.warning("engine process ignored SIGTERM; killing it")
                self.proc.kill()
                await asyncio.to_thread(self.proc.join, 5.0)
        await cancel_and_wait(self._reader)
        for fut in self._pending.values():
            if not fut.done():
                fut.cancel()
        self._pending.clear()
        if self._sock is not None:
            self._sock.close(linger=0)
        if self._ctx is not None:
            self._ctx.term()


# -- metrics -------------------------------------------------------------------

COUNTER_STATS = frozenset(
    {
        "prefix_cache_hit_tokens",
        "prefix_cache_query_tokens",
        "transfers_ok",
        "transfers_failed",
        "bytes_sent",
        "bytes_received",
        "transfer_tail_seconds",
    }
)
"""Stats that are counters although their names do not end in ``_total``."""
METRIC_NAMES = {"running": "running_requests", "waiting": "waiting_requests"}
METRIC_HELP = {
    "free_pages": "KV pages on the allocator's free list",
    "total_pages": "KV pages the allocator can hand out (pool capacity)",
    "cached_pages": "KV pages held by the prefix cache",
    "evictable_pages": "prefix-cache pages no request uses (evictable)",
    "locked_pages": "prefix-cache pages in use by requests",
    "available_pages": "free plus evictable KV pages",
    "running": "requests holding KV pages",
    "waiting": "requests queued for admission",
    "in_flight": "requests accepted on the request plane and not finished",
    "prefix_cache_hit_tokens": "prompt tokens served from the prefix cache",
    "prefix_cache_query_tokens": "prompt tokens looked up in the prefix cache",
    "transfers_ok": "rooms whose KV reached the decode worker",
    "transfers_failed": "rooms whose KV transfer failed or was aborted",
    "bytes_sent": "KV bytes written to decode workers",
    "transfer_tail_seconds": "time from the end of a prompt's prefill until all of its KV "
    "had landed, summed over transferred rooms (divide by transfers_ok for the mean)",
}
_METRIC_KEY = re.compile(r"[a-zA-Z_][a-zA-Z0-9_]*")


def _label(value: object) -> str:
    return str(value).replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")


def _labels(values: dict[str, Any], keys: tuple[str, ...]) -> str:
    return ",".join(f'{k}="{_label(values.get(k, ""))}"' for k in keys)


def format_metrics(
    stats: dict[str, Any],
    info: dict[str, Any],
    engine_up: bool,
    stages: dict[str, Any] | None = None,
) -> str:
    """Prometheus text exposition (format 0.0.4) of the engine's stats and, when
    given, its stage histograms (``HistogramFamily.snapshot``)."""
    lines = [
        "# HELP worker_engine_up 1 when the engine process answers the front",
        "# TYPE worker_engine_up gauge",
        f"worker_engine_up {int(engine_up)}",
        "# HELP worker_info static facts about this worker",
        "# TYPE worker_info gauge",
        "worker_info{" + _labels(info, ("role", "model", "served_model_name")) + "} 1",
    ]
    for key in sorted(stats):
        value = stats[key]
        if isinstance(value, bool):
            value = int(value)
        if not isinstance(value, (int, float)) or not _METRIC_KEY.fullmatch(key):
            continue
        base = METRIC_NAMES.get(key, key)
        counter = key in COUNTER_STATS or base.endswith("_total")
        if counter and not base.endswith("_total"):
            base += "_total"
        name = f"worker_{base}"
        lines.append(f"# HELP {name} {METRIC_HELP.get(key, key.replace('_', ' '))}")
        lines.append(f"# TYPE {name} {'counter' if counter else 'gauge'}")
        lines.append(f"{name} {value}")
    if stages:
        lines += HistogramFamily.from_snapshot(stages).render()
    return "\n".join(lines) + "\n"


# -- HTTP ----------------------------------------------------------------------


@dataclass
class FrontState:
    config: WorkerConfig
    engine: EngineHandle
    info: dict[str, Any]
    """The engine's ready reply: endpoints and static facts."""
    stopping: asyncio.Event = field(default_factory=asyncio.Event)
    """Set once a stop was requested (signal); engine exit is then expected."""
    started: float = field(default_factory=time.time)
    failure: str | None = None
    """Why the worker stopped, when it did not stop on request."""
    draining: bool = False
    """A drain has begun (a second signal then stops at once)."""
    refusing: bool = False
    """The engine has acknowledged the drain and refuses new requests: only
    from then on does /health answer 503, so a client that sees 503 and then
    sends is refused, never served."""


def build_app(state: FrontState) -> FastAPI:
    app = FastAPI(
        title=f"disagg-serve {state.config.role} worker",
        docs_url=None,
        redoc_url=None,
        openapi_url=None,
    )

    def unavailable(e: Exception) -> JSONResponse:
        return JSONResponse({"status": HealthStatus.UNAVAILABLE, "reason": str(e)}, status_code=503)

    @app.get("/health")
    async def health() -> Any:
        if state.refusing:
            return JSONResponse({"status": HealthStatus.DRAINING}, status_code=503)
        try:
            await state.engine.ask(CtrlOp.PING)
        except EngineUnavailable as e:
            return unavailable(e)
        return {"status": HealthStatus.OK}

    @app.get("/server_info")
    async def server_info() -> Any:
        try:
            reply = await state.engine.ask(CtrlOp.SERVER_INFO)
        except EngineUnavailable as e:
            return unavailable(e)
        return {
            **reply["info"],
            "url": state.config.url,
            "front_pid": os.getpid(),
            "engine_pid": state.engine.pid,
            "started_at": state.started,
        }

    @app.get("/tokenizer")
    async def tokenizer() -> Any:
        model = state.info.get("model")
        if not model or not Path(model).is_dir():
            return JSONResponse({"error": "this worker has no tokenizer files"}, status_code=404)
        return tokenizer_files.pack(model)

    @app.get("/metrics")
    async def metrics() -> PlainTextResponse:
        try:
            reply = await state.engine.ask(CtrlOp.STATS)
            stats, stages, up = reply["stats"], reply.get("stages"), True
        except EngineUnavailable:
            stats, stages, up = {}, None, False
        return PlainTextResponse(
            format_metrics(stats, state.info, up, stages), media_type="text/plain; version=0.0.4"
        )

    return app


class _Server(uvicorn.Server):
    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:
        # The front owns SIGINT/SIGTERM: it stops the engine process before
        # exiting, so uvicorn must neither handle nor re-raise them.
        yield


def _bind_http(host: str, port: int) -> socket.socket:
    """Reserve the HTTP port now (fail before loading the model); uvicorn starts
    listening on it once the engine is ready."""
    family, kind, proto, _, addr = socket.getaddrinfo(
        host or None, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE
    )[0]
    sock = socket.socket(family, kind, proto)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind(addr)
    except OSError:
        sock.close()
        raise
    return sock


async def _watch_engine(state: FrontState, server: uvicorn.Server) -> None:
    while state.engine.alive:
        await asyncio.sleep(0.25)
    if state.stopping.is_set():
        return
    state.failure = f"engine process exited with code {state.engine.proc.exitcode}"
    log.error("%s; stopping the worker", state.failure)
    server.should_exit = True


DRAIN_POLL_S = 0.1


async def _drain(state: FrontState, server: uvicorn.Server) -> None:
    """Refuse new requests (the engine answers them as retryable), let the
    in-flight ones finish for up to ``shutdown_timeout_s``, then stop (the
    engine's shutdown aborts what is left)."""
    limit = state.config.shutdown_timeout_s
    state.draining = True
    t0 = time.monotonic()
    try:
        reply = await state.engine.ask(CtrlOp.DRAIN)
        state.refusing = True
        log.info(
            "draining: no new requests; %d in flight may finish within %gs, then the rest "
            "are aborted",
            reply["in_flight"],
            limit,
        )
        while not reply["idle"]:
            if time.monotonic() - t0 >= limit:
                log.warning(
                    "%d request(s) still in flight after %gs; aborting them",
                    reply["in_flight"],
                    limit,
                )
                break
            await asyncio.sleep(DRAIN_POLL_S)
            reply = await state.engine.ask(CtrlOp.DRAIN)
        else:
            log.info("drained in %.2fs", time.monotonic() - t0)
    except EngineUnavailable as e:
        log.warning("drain ended early: %s", e)
    finally:
        state.stopping.set()
        server.should_exit = True


def register_targets(url: str) -> list[str]:
    """The gateways behind ``url``: one per address its host name resolves to
    (a headless Kubernetes Service names every gateway replica), or ``url``
    itself when it names one address (or cannot be resolved now)."""
    parts = urlsplit(url.rstrip("/"))
    host = parts.hostname
    if not host:
        return [url.rstrip("/")]
    port = parts.port or (443 if parts.scheme == "https" else 80)
    try:
        # IPv4 where the name has IPv4 addresses: "localhost" is 127.0.0.1
        # and ::1, one gateway behind both.
        infos = socket.getaddrinfo(host, port, socket.AF_INET, socket.SOCK_STREAM)
    except OSError:
        try:
            infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)
        except OSError:
            return [url.rstrip("/")]
    addresses = sorted({info[4][0] for info in infos})
    if len(addresses) <= 1:
        return [url.rstrip("/")]
    return [f"{parts.scheme}://{f'[{a}]' if ':' in a else a}:{port}{parts.path}" for a in addresses]


async def _register(
    config: WorkerConfig, server: uvicorn.Server, engine: EngineHandle, state: FrontState
) -> None:
    """Tell the gateways at ``config.register`` about this worker: every
    address the name resolves to, looked up and told again every
    ``REREGISTER_S``, so that a gateway replica that starts later, or one
    that restarted, learns of this worker too. A
    gateway that is not up (yet) is retried for as long as the worker runs;
    refusals (wrong key, role) ``REGISTER_REFUSALS`` times in a row stop the
    worker with that reason: a worker nobody routes to must not look healthy."""
    assert config.register is not None
    while not server.started:
        await asyncio.sleep(0.05)
    body = {"url": config.url, "role": config.role}
    key = config.register_key or config.cluster_token
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    delay, refusals, attempt = 0.5, 0, 0
    registered: set[str] = set()
    async with httpx.AsyncClient(timeout=5.0) as client:
        while True:
            # Every round posts to every address again: a gateway that
            # restarted (same name, maybe the same address) has forgotten us.
            targets = register_targets(config.register)
            registered &= set(targets)  # an address that left may come back
            for target in targets:
                attempt += 1
                url = f"{target}/admin/workers"
                try:
                    await engine.ask(CtrlOp.PING)
                    resp = await client.post(url, json=body, headers=headers)
                    if resp.is_success:
                        if target not in registered:
                            log.info("registered with %s as %s (%s)", url, config.url, config.role)
                        registered.add(target)
                        refusals = 0
                        continue
                    why = f"{url} answered {resp.status_code}: {resp.text[:200]}"
                    if 400 <= resp.status_code < 500 and resp.status_code not in (408, 429):
                        refusals += 1
                        log.error(
                            "registration refused (%d of %d): %s",
                            refusals,
                            REGISTER_REFUSALS,
                            why,
                        )
                        if refusals >= REGISTER_REFUSALS:
                            state.failure = f"the gateway refused the registration: {why}"
                            server.should_exit = True
                            return
                    else:
                        log.warning("registration attempt %d: %s", attempt, why)
                except (httpx.HTTPError, EngineUnavailable) as e:
                    (log.info if attempt == 1 else log.warning)(
                        "registration attempt %d with %s failed (retrying): %s", attempt, url, e
                    )
            if len(registered) == len(targets):
                delay = 0.5
                await asyncio.sleep(REREGISTER_S)
            else:
                await asyncio.sleep(delay)
                delay = min(delay * 2, REGISTER_MAX_DELAY_S)


async def _serve(config: WorkerConfig, role: Role) -> str | None:
    """Run the worker until stopped; the failure message, or None on a requested stop."""
    try:
        http_sock = _bind_http(config.host, config.port)
    except OSError as e:
        return f"cannot bind HTTP {config.host}:{config.port}: {e}"
    tmpdir = tempfile.mkdtemp(prefix="disagg-worker-")
    engine = EngineHandle(config, role, f"ipc://{tmpdir}/ctrl")
    stop = asyncio.Event()
    server: _Server | None = None
    state: FrontState | None = None
    tasks: list[asyncio.Task[None]] = []

    def on_signal(sig: signal.Signals) -> None:
        drain = state is not None and not state.draining and config.shutdown_timeout_s > 0
        if drain and server is not None and server.started and not stop.is_set():
            log.info("received %s; draining (a second signal stops at once)", sig.name)
            tasks.append(asyncio.create_task(_drain(state, server)))
            return
        log.info("received %s; stopping", sig.name)
        stop.set()
        if server is not None:
            server.should_exit = True

    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, on_signal, sig)
    try:
        engine.start()
        log.info("started engine process %d (role %s); loading the model", engine.pid, config.role)
        try:
            ready = await engine.wait_ready(stop)
        except StartupError as e:
            return str(e)
        if ready is None:
            return None
        info = {k: v for k, v in ready.items() if k not in ("id", "ok")}
        state = FrontState(config, engine, info, stopping=stop)
        uv_config = uvicorn.Config(
            build_app(state),
            log_config=None,
            log_level=config.log_level.lower(),
            access_log=config.log_level.lower() == "debug",
            lifespan="off",
            timeout_graceful_shutdown=5,
        )
        server = _Server(uv_config)
        server.should_exit = stop.is_set()
        tasks.append(asyncio.create_task(_watch_engine(state, server)))
        if config.register:
            tasks.append(asyncio.create_task(_register(config, server, engine, state)))
        log.info(
            "serving HTTP on %s; request plane %s; bootstrap %s",
            config.url,
            info.get("request_endpoint"),
            info.get("bootstrap_endpoint"),
        )
        await server.serve(sockets=[http_sock])
        if not server.started and state.failure is None and not stop.is_set():
            return f"HTTP server on {config.host}:{config.port} failed to start"
        return state.failure
    finally:
        await cancel_and_wait(*tasks)
        await engine.stop()
        http_sock.close()
        shutil.rmtree(tmpdir, ignore_errors=True)
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.remove_signal_handler(sig)


def run_worker(config: WorkerConfig, role: Role) -> None:
    """Run a worker (front plus engine process) until SIGINT/SIGTERM.

    Raises ``SystemExit`` with the reason when the engine fails to start or
    dies, so ``python -m ...`` exits non-zero with that message."""
    setup_logging(config.log_level, f"{config.role}-front")
    failure = asyncio.run(_serve(config, role))
    if failure is not None:
        log.error("worker failed: %s", failure)
        raise SystemExit(f"worker failed: {failure}")
    log.info("worker stopped")
