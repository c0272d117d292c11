r"""Gateway CPU per streamed token: ``python -m gateway`` in front of a fake worker.

    python -m benchmarks.bench_gateway_cpu --rates 10000 30000 100000 --repeat 3

The fake worker (in this process) speaks the request plane (a ZMQ ROUTER that
answers ``Generate`` with a token stream and honours ``Abort``) and serves the
HTTP endpoints the gateway probes (``/health``, ``/server_info``,
``/tokenizer`` with the built-in tiny model's tokenizer files). It steps at a
fixed cadence: every step, each live request gets one token, all of a
requester's deltas in one frame, as a real worker sends them. The step interval
is ``concurrency / rate``, so ``concurrency`` streaming clients (raw HTTP/1.1,
each reading its SSE stream to ``[DONE]`` and then sending the next request)
receive ``rate`` tokens per second in all when the gateway keeps up.

The gateway runs as its own process (pinned to one core when the machine has
more than one, this process to the others); its CPU time (user + system, from
``/proc/PID/stat``) over a run, divided by the tokens its clients received
(from each stream's usage chunk), is the CPU per streamed token. It includes
everything the gateway did in that time: accepting connections, parsing and
tokenizing requests, routing, the ZMQ receive, detokenization, JSON and SSE
encoding, and the health checks. The gateway runs with ``--busy-poll-s 0``: a
loop that spins between events would count its idle time as work.

Prints a table and writes a JSON record under ``benchmarks/results/``.
``--profile FILE`` runs the gateway under cProfile (one rate) and writes the
stats to FILE.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import re
import statistics
import sys
import time
from dataclasses import asdict, dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any, NamedTuple

import uvicorn
import zmq
import zmq.asyncio
from fastapi import FastAPI

from benchmarks.common import RESULTS_DIR, command
from gateway.text import Tokenizer
from harness.cluster import gateway_cmd
from harness.host import git_commit, host_info
from harness.procs import Proc, free_port
from protocol import to_gateway, to_worker, tokenizer_files
from protocol.finish import FinishReason
from protocol.roles import BOTH
from protocol.to_gateway import TokenDelta, Tokens
from protocol.to_worker import Abort, Generate

MODEL_NAME = "fake-tiny"
TEXT = (
    "The quick brown fox jumps over the lazy dog while the old river runs past the "
    "quiet town, and every morning the people of the valley walk to the market to sell "
    "bread, cheese and apples from their gardens before the sun is high."
)
"""What the fake worker's token stream spells, over and over (ordinary text, so
the detokenizer does ordinary work)."""
_USAGE = re.compile(rb'"completion_tokens":\s*(\d+)')
_CLK_TCK = os.sysconf("SC_CLK_TCK")


@dataclass(frozen=True)
class RunConfig:
    rate: float
    """Target aggregate tokens per second."""
    concurrency: int
    """Streaming requests in flight at once (one per client loop)."""
    max_tokens: int
    """Tokens per request."""
    duration_s: float
    """Clients start new requests for this long; the run ends when the last ends."""
    endpoint: str = "chat"

    @property
    def step_s(self) -> float:
        """The fake worker's step interval: one token per live request per step."""
        return self.concurrency / self.rate


@dataclass
class RunResult:
    rate: float
    concurrency: int
    max_tokens: int
    requests: int
    tokens: int
    events: int
    """SSE events with a choice that the clients read (usage and [DONE] excluded)."""
    wall_s: float
    gateway_cpu_s: float
    gateway_sys_s: float
    """The part of ``gateway_cpu_s`` spent in the kernel (socket writes and reads)."""
    idle_cpu_per_s: float
    """Gateway CPU seconds per second while idle (health checks), before the run."""
    load_cpu_util: float = 0.0
    """CPU seconds per second of this process (fake worker and clients): near
    1.0 (one core), the load generator, not the gateway, limits the rate."""
    failed: int = 0
    tokens_per_s: float = field(init=False)
    cpu_us_per_token: float = field(init=False)
    gateway_cpu_util: float = field(init=False)

    def __post_init__(self) -> None:
        self.tokens_per_s = self.tokens / self.wall_s if self.wall_s else 0.0
        self.cpu_us_per_token = 1e6 * self.gateway_cpu_s / self.tokens if self.tokens else 0.0
        self.gateway_cpu_util = self.gateway_cpu_s / self.wall_s if self.wall_s else 0.0


# -- the fake worker -------------------------------------------------------------------


@dataclass
class _Stream:
    client: bytes
    left: int
    pos: int


class FakeWorker:
    """A worker of role "both" that generates without a model: ``TEXT``'s token
    ids, one per live request per step, at ``step_s`` intervals."""

    def __init__(self, model_dir: Path, step_s: float) -> None:
        self.model_dir = model_dir
        self.step_s = step_s
        self.token_ids = Tokenizer.from_dir(model_dir).encode(TEXT, add_special_tokens=False)
        self.streams: dict[str, _Stream] = {}
        self.http_port = free_port()
        self.request_endpoint = ""
        self.tokens_sent = 0
        self._sock: zmq.asyncio.Socket | None = None
        self._tasks: list[asyncio.Task[Any]] = []
        self._server: uvicorn.Server | None = None
        self._started = time.time()

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.http_port}"

    def _app(self) -> FastAPI:
        app = FastAPI()

        @app.get("/health")
        async def health() -> Any:
            return {"status": "ok"}

        @app.get("/server_info")
        async def server_info() -> Any:
            return {
                "role": BOTH,
                "model": str(self.model_dir),
                "served_model_name": MODEL_NAME,
                "request_endpoint": self.request_endpoint,
                "bootstrap_endpoint": None,
                "page_size": 16,
                "context_length": 4096,
                "started_at": self._started,
                "stats": {"running": len(self.streams), "waiting": 0},
            }

        @app.get("/tokenizer")
        async def tokenizer() -> Any:
            return tokenizer_files.pack(self.model_dir)

        return app

    async def start(self) -> None:
        self._sock = zmq.asyncio.Context.instance().socket(zmq.ROUTER)
        self._sock.linger = 0
        self._sock.sndhwm = self._sock.rcvhwm = 0
        port = self._sock.bind_to_random_port("tcp://127.0.0.1")
        self.request_endpoint = f"tcp://127.0.0.1:{port}"
        config = uvicorn.Config(
            self._app(), host="127.0.0.1", port=self.http_port, log_level="warning"
        )
        self._server = uvicorn.Server(config)
        self._tasks = [
            asyncio.create_task(self._server.serve()),
            asyncio.create_task(self._receive()),
            asyncio.create_task(self._step_loop()),
        ]
        while not self._server.started:
            await asyncio.sleep(0.01)

    async def stop(self) -> None:
        if self._server is not None:
            self._server.should_exit = True
        for task in self._tasks[1:]:
            task.cancel()
        for task in self._tasks:
            with contextlib.suppress(asyncio.CancelledError):
                await task
        if self._sock is not None:
            self._sock.close(linger=0)

    async def _receive(self) -> None:
        assert self._sock is not None
        while True:
            client, frame = await self._sock.recv_multipart()
            msg = to_worker.decoder.decode(frame)
            if isinstance(msg, Generate):
                start = len(self.streams) % len(self.token_ids)
                self.streams[msg.rid] = _Stream(client, msg.sampling.max_tokens, start)
            elif isinstance(msg, Abort) and self.streams.pop(msg.rid, None) is not None:
                delta = TokenDelta(msg.rid, [], [], FinishReason.ABORT, 0)
                await self._sock.send_multipart(
                    [client, to_gateway.encoder.encode(Tokens([delta]))]
                )

    async def _step_loop(self) -> None:
        assert self._sock is not None
        loop = asyncio.get_running_loop()
        next_at = loop.time()
        ids, n = self.token_ids, len(self.token_ids)
        while True:
            next_at += self.step_s
            delay = next_at - loop.time()
            if delay > 0:
                await asyncio.sleep(delay)
            elif delay < -self.step_s:
                next_at = loop.time()  # fell behind: carry on at the cadence, no burst
            frames: dict[bytes, list[TokenDelta]] = {}
            for rid, s in list(self.streams.items()):
                s.left -= 1
                finish = FinishReason.LENGTH if s.left <= 0 else None
                frames.setdefault(s.client, []).append(
                    TokenDelta(rid, [ids[s.pos % n]], [-0.25], finish, 0)
                )
                s.pos += 1
                if finish is not None:
                    del self.streams[rid]
                self.tokens_sent += 1
            for client, deltas in frames.items():
                await self._sock.send_multipart([client, to_gateway.encoder.encode(Tokens(deltas))])


# -- the clients -------------------------------------------------------------------------


@dataclass
class ClientTally:
    requests: int = 0
    tokens: int = 0
    events: int = 0
    failed: int = 0


class _SSEReader(asyncio.Protocol):
    """Reads one streamed response to the end of its connection, counting
    events as bytes arrive (a protocol, not a stream reader: the clients must
    cost far less per event than the gateway they measure)."""

    def __init__(self, request: bytes, done: asyncio.Future[tuple[int, bytes]]) -> None:
        self.request = request
        self.done = done
        self.events = 0
        self.carry = b""
        self.head = b""
        self.tail = b""

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        transport.write(self.request)  # type: ignore[attr-defined]

    def data_received(self, data: bytes) -> None:
        if not self.head:
            self.head = data[:16]
        buf = self.carry + data
        self.events += buf.count(b'data: {"id"')
        self.carry = buf[-10:]
        self.tail = (self.tail + data)[-4096:]

    def connection_lost(self, exc: Exception | None) -> None:
        if not self.done.done():
            self.done.set_result((self.events, self.tail))


class StreamResult(NamedTuple):
    head: bytes
    """The response's status line and headers as they arrived."""
    events: int
    """SSE events read."""
    tokens: int | None
    """Completion tokens of the usage chunk (None: no usage chunk)."""


async def post_stream(port: int, body: bytes, path: str) -> StreamResult:
    """POST ``body`` to ``path`` over a connection of its own and read the
    streamed answer to the end."""
    loop = asyncio.get_running_loop()
    done: asyncio.Future[tuple[int, bytes]] = loop.create_future()
    request = (
        f"POST {path} HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
        f"Content-Length: {len(body)}\r\nConnection: close\r\n\r\n".encode()
        + body
    )
    transport, proto = await loop.create_connection(
        lambda: _SSEReader(request, done), "127.0.0.1", port
    )
    try:
        events, tail = await done
    finally:
        transport.close()
    usage = _USAGE.findall(tail)
    return StreamResult(proto.head, events, int(usage[-1]) if usage else None)


async def stream_one(port: int, body: bytes, path: str, tally: ClientTally) -> None:
    """One streamed request over its own connection, read to the end."""
    result = await post_stream(port, body, path)
    if not result.head.startswith(b"HTTP/1.1 200") or result.tokens is None:
        tally.failed += 1
        return
    tally.requests += 1
    tally.tokens += result.tokens
    tally.events += result.events - 1  # the usage chunk


def request_body(endpoint: str, max_tokens: int, i: int) -> tuple[str, bytes]:
    common = {
        "model": MODEL_NAME,
        "max_tokens": max_tokens,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    if endpoint == "chat":
        body = {**common, "messages": [{"role": "user", "content": f"Hello number {i}"}]}
        return "/v1/chat/completions", json.dumps(body).encode()
    return "/v1/completions", json.dumps({**common, "prompt": f"Hello number {i}"}).encode()


async def client_loop(port: int, cfg: RunConfig, deadline: float, tally: ClientTally) -> None:
    i = 0
    while time.monotonic() < deadline:
        path, body = request_body(cfg.endpoint, cfg.max_tokens, i)
        await stream_one(port, body, path, tally)
        i += 1


# -- the gateway process ---------------------------------------------------------------


def process_times(pid: int) -> tuple[float, float]:
    """User and system CPU seconds of process ``pid`` (all its threads) so far."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return int(fields[11]) / _CLK_TCK, int(fields[12]) / _CLK_TCK


def process_cpu_s(pid: int) -> float:
    """User plus system CPU seconds of process ``pid`` so far."""
    return sum(process_times(pid))


def pin_cores(gateway_pid: int) -> None:
    """The gateway on the last core, this process on the others (when there are
    at least two), so the clients and the fake worker do not take the
    gateway's core."""
    cores = sorted(os.sched_getaffinity(0))
    if len(cores) < 2:
        return
    os.sched_setaffinity(gateway_pid, {cores[-1]})
    os.sched_setaffinity(0, set(cores[:-1]))


def gateway_proc(worker_url: str, profile: str | None, log_path: Path) -> Proc:
    """``python -m gateway`` in front of the fake worker at ``worker_url``, under
    cProfile when ``profile`` names a file for its stats."""
    port = free_port()
    # What is measured is the work per token; a loop that spins between events
    # (on by default on hosts with cores to spare) would add its idle time to it.
    args = ["--decode", worker_url, "--log-level", "warning", "--busy-poll-s", "0"]
    python, *cmd = gateway_cmd(port, *args)
    if profile:
        cmd = ["-m", "cProfile", "-o", profile, *cmd]
    return Proc("gateway", [python, *cmd], log_path, port=port)


async def run_once(
    cfg: RunConfig, model_dir: Path, profile: str | None, pin: bool, log_path: Path
) -> RunResult:
    worker = FakeWorker(model_dir, cfg.step_s)
    await worker.start()
    gateway = gateway_proc(worker.url, profile, log_path).start()
    assert gateway.proc is not None and gateway.port is not None
    pid, port = gateway.proc.pid, gateway.port
    try:
        await asyncio.to_thread(gateway.wait_http, "/health", 60.0)
        if pin:
            pin_cores(pid)
        # Warm up: one short request (imports, first tokenization, the ZMQ connection).
        path, body = request_body(cfg.endpoint, 8, -1)
        await stream_one(port, body, path, ClientTally())
        idle0, t_idle = process_cpu_s(pid), time.monotonic()
        await asyncio.sleep(1.0)
        idle_rate = (process_cpu_s(pid) - idle0) / (time.monotonic() - t_idle)
        tally = ClientTally()
        own0 = process_cpu_s(os.getpid())
        (user0, sys0), t0 = process_times(pid), time.monotonic()
        deadline = t0 + cfg.duration_s
        await asyncio.gather(
            *(client_loop(port, cfg, deadline, tally) for _ in range(cfg.concurrency))
        )
        wall = time.monotonic() - t0
        user1, sys1 = process_times(pid)
        cpu, system = user1 + sys1 - user0 - sys0, sys1 - sys0
        own = process_cpu_s(os.getpid()) - own0
    finally:
        await asyncio.to_thread(gateway.stop)
        await worker.stop()
    return RunResult(
        rate=cfg.rate,
        concurrency=cfg.concurrency,
        max_tokens=cfg.max_tokens,
        requests=tally.requests,
        tokens=tally.tokens,
        events=tally.events,
        wall_s=wall,
        gateway_cpu_s=cpu,
        gateway_sys_s=system,
        idle_cpu_per_s=idle_rate,
        load_cpu_util=own / wall,
        failed=tally.failed,
    )


# -- report ------------------------------------------------------------------------------


def summarize(runs: list[RunResult]) -> dict[str, Any]:
    per_tok = [r.cpu_us_per_token for r in runs]
    return {
        "rate": runs[0].rate,
        "concurrency": runs[0].concurrency,
        "max_tokens": runs[0].max_tokens,
        "cpu_us_per_token_median": statistics.median(per_tok),
        "cpu_us_per_token_min": min(per_tok),
        "cpu_us_per_token_max": max(per_tok),
        "tokens_per_s_median": statistics.median(r.tokens_per_s for r in runs),
        "gateway_cpu_util_median": statistics.median(r.gateway_cpu_util for r in runs),
        "load_cpu_util_median": statistics.median(r.load_cpu_util for r in runs),
        "gateway_sys_fraction_median": statistics.median(
            r.gateway_sys_s / r.gateway_cpu_s if r.gateway_cpu_s else 0.0 for r in runs
        ),
        "events_per_token_median": statistics.median(
            r.events / r.tokens if r.tokens else 0.0 for r in runs
        ),
        "failed": sum(r.failed for r in runs),
        "runs": [asdict(r) for r in runs],
    }


def print_table(rows: list[dict[str, Any]]) -> None:
    print(
        f"{'target tok/s':>12} {'conc':>5} {'got tok/s':>10} {'gw CPU':>7} {'load CPU':>8} "
        f"{'us/token (median [min-max])':>28} {'sys':>4} {'events/tok':>10} {'failed':>6}"
    )
    for r in rows:
        spread = (
            f"{r['cpu_us_per_token_median']:.1f} "
            f"[{r['cpu_us_per_token_min']:.1f}-{r['cpu_us_per_token_max']:.1f}]"
        )
        print(
            f"{r['rate']:>12.0f} {r['concurrency']:>5} {r['tokens_per_s_median']:>10.0f} "
            f"{100 * r['gateway_cpu_util_median']:>6.0f}% "
            f"{100 * r['load_cpu_util_median']:>7.0f}% {spread:>28} "
            f"{100 * r['gateway_sys_fraction_median']:>3.0f}% "
            f"{r['events_per_token_median']:>10.2f} {r['failed']:>6}"
        )


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(
        prog="python -m benchmarks.bench_gateway_cpu",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    ap.add_argument(
        "--rates", type=float, nargs="+", default=[10_000, 30_000, 100_000], help="tokens/s"
    )
    ap.add_argument(
        "--concurrency", type=int, default=128, help="streams in flight (default: %(default)s)"
    )
    ap.add_argument(
        "--max-tokens", type=int, default=256, help="tokens per request (default: %(default)s)"
    )
    ap.add_argument("--duration-s", type=float, default=8.0, help="seconds of new requests per run")
    ap.add_argument("--repeat", type=int, default=3, help="runs per rate (default: %(default)s)")
    ap.add_argument("--endpoint", choices=["chat", "completions"], default="chat")
    ap.add_argument("--no-pin", action="store_true", help="do not pin the gateway to a core")
    ap.add_argument("--profile", metavar="FILE", help="run the gateway under cProfile (one run)")
    ap.add_argument("--label", default="", help="tag of the record (e.g. before / after)")
    ap.add_argument("--model", help="model dir with tokenizer files (default: the tiny model)")
    ap.add_argument("--output-file", type=Path, help="JSON record to write")
    return ap


def main(argv: list[str] | None = None) -> None:
    args = build_parser().parse_args(argv)
    if args.model:
        model_dir = Path(args.model)
    else:
        from engine.tiny import ensure_tiny_model

        model_dir = ensure_tiny_model()
    now = datetime.now(UTC)
    commit = git_commit()
    RESULTS_DIR.mkdir(parents=True, exist_ok=True)
    log_path = RESULTS_DIR.parent / f".gateway-cpu-{os.getpid()}.log"
    rows = []
    repeat = 1 if args.profile else args.repeat
    try:
        for rate in args.rates:
            cfg = RunConfig(rate, args.concurrency, args.max_tokens, args.duration_s, args.endpoint)
            runs = [
                asyncio.run(run_once(cfg, model_dir, args.profile, not args.no_pin, log_path))
                for _ in range(repeat)
            ]
            rows.append(summarize(runs))
            print_table(rows[-1:])
    finally:
        if log_path.exists():
            if any(r["failed"] for r in rows):
                print(log_path.read_text()[-4000:], file=sys.stderr)
            log_path.unlink()
    print()
    print_table(rows)
    record = {
        "benchmark": "gateway_cpu",
        "label": args.label,
        "date": now.isoformat(timespec="seconds"),
        "command": command("benchmarks.bench_gateway_cpu", argv),
        "git_commit": commit,
        "machine": host_info(),
        "endpoint": args.endpoint,
        "results": rows,
    }
    out = args.output_file
    if out is None:
        tag = f"-{args.label}" if args.label else ""
        out = RESULTS_DIR / f"gateway-cpu-{commit}{tag}-{now:%Y%m%d-%H%M%S}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(record, indent=2) + "\n")
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
