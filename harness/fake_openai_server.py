"""A fake OpenAI-compatible streaming server whose timing is known.

Every streamed request gets its first chunk with text ``--ttft-ms`` after its
request arrived, then one chunk (one token) every ``--gap-ms``, scheduled at
absolute times so that a late wake-up does not shift the rest of the stream.
It measures how late it actually wrote each chunk: ``GET /stats`` returns (and
resets) the TTFT and inter-chunk gaps as the server itself produced them, so a
benchmark client's numbers can be compared with what was really on the wire
(``GET /stats?detail=1`` adds each request's first write, keyed by the first
token or word of its prompt).

    python -m harness.fake_openai_server --port 8123 --ttft-ms 60 --gap-ms 12

The chunks look like vLLM's (id, object, created, model, choices, usage), so a
client parses as much JSON per token as it would against a real server. Markers
in a text prompt change one request: ``@slow`` doubles its TTFT, ``@fail500``
answers HTTP 500, ``@failchunk`` sends one early chunk with text and then an
``error`` chunk, ``@nousage`` leaves out the final usage chunk.

The server is plain asyncio protocol callbacks, no web framework and no task
per request: a framework's own latency, and its jitter on a loaded machine,
would land in the timings that it exists to pin down.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import functools
import itertools
import json
import multiprocessing
import selectors
import socket
import statistics
import sys
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

MODEL = "fake-model"
CREATED = 1_700_000_000
FAIL_TTFT_S = 0.05
"""First chunk of a ``@failchunk`` request: early, so that a failed request
leaking into a benchmark's averages moves them far from the configured TTFT."""


@dataclass(frozen=True)
class Timing:
    ttft_s: float = 0.06
    gap_s: float = 0.012


@dataclass
class ServerStats:
    """What the server actually did, in seconds of its own clock."""

    ttft: list[float] = field(default_factory=list)
    """Per request: request arrival to the write of its first chunk with text."""
    gaps: list[float] = field(default_factory=list)
    """Between consecutive writes of chunks with text, pooled."""
    lateness: list[float] = field(default_factory=list)
    """Per chunk with text: the write time minus its scheduled time."""
    first_writes: list[tuple[Any, float]] = field(default_factory=list)
    """Per request: (its prompt's first token or word, when its first chunk
    with text was written): a client's TTFT can be checked request by request
    against what was on the wire, the server's own delays included."""

    def reset(self) -> None:
        for values in (self.ttft, self.gaps, self.lateness, self.first_writes):
            values.clear()

    def summary(self, detail: bool = False) -> dict[str, Any]:
        def ms(values: list[float]) -> dict[str, float | None]:
            if not values:
                return {"median": None, "mean": None, "max": None}
            return {
                "median": statistics.median(values) * 1e3,
                "mean": statistics.fmean(values) * 1e3,
                "max": max(values) * 1e3,
            }

        return {
            "requests": len(self.ttft),
            "ttft_ms": ms(self.ttft),
            "itl_ms": ms(self.gaps),
            "lateness_ms": ms(self.lateness),
        } | ({"first_writes": self.first_writes} if detail else {})


# -- events -------------------------------------------------------------------------


def sse(obj: Any) -> bytes:
    return b"data: " + json.dumps(obj, separators=(",", ":")).encode() + b"\n\n"


def text_event(request_id: str, chat: bool, k: int, last: bool) -> bytes:
    return b"%b%b%b" % (_EVENT_HEAD, request_id.encode(), _text_event_tail(chat, k, last))


_EVENT_HEAD = b'data: {"id":"'


@functools.lru_cache(maxsize=65536)
def _text_event_tail(chat: bool, k: int, last: bool) -> bytes:
    """All of a token's event after its request id, encoded once: at hundreds
    of concurrent streams, JSON encoding per chunk would make the server late."""
    finish = "length" if last else None
    if chat:
        choice = {"index": 0, "delta": {"content": f" w{k}"}, "logprobs": None}
        kind = "chat.completion.chunk"
    else:
        choice = {"index": 0, "text": f" w{k}", "logprobs": None, "stop_reason": None}
        kind = "text_completion"
    choice["finish_reason"] = finish
    obj = {"id": "", "object": kind, "created": CREATED, "model": MODEL}
    event = sse({**obj, "choices": [choice], "usage": None})
    assert event.startswith(_EVENT_HEAD + b'"')
    return event[len(_EVENT_HEAD) :]


def role_event(request_id: str) -> bytes:
    """The chat stream's opening chunk: a role and empty content, not a token."""
    delta = {"role": "assistant", "content": ""}
    choice = {"index": 0, "delta": delta, "logprobs": None, "finish_reason": None}
    obj = {"id": request_id, "object": "chat.completion.chunk", "created": CREATED}
    return sse({**obj, "model": MODEL, "choices": [choice]})


def usage_event(request_id: str, prompt_tokens: int, completion_tokens: int) -> bytes:
    usage = {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
    }
    return sse(
        {"id": request_id, "created": CREATED, "model": MODEL, "choices": [], "usage": usage}
    )


def error_event() -> bytes:
    return sse({"error": {"message": "injected failure", "type": "server_error", "code": 500}})


DONE = b"data: [DONE]\n\n"
_ids = itertools.count()


def http_chunk(data: bytes) -> bytes:
    return b"%x\r\n%b\r\n" % (len(data), data)


def response_head(status: int, content_type: str, length: int | None = None) -> bytes:
    size = f"Content-Length: {length}" if length is not None else "Transfer-Encoding: chunked"
    return f"HTTP/1.1 {status} X\r\nContent-Type: {content_type}\r\n{size}\r\n\r\n".encode()


def json_response(status: int, obj: Any) -> bytes:
    payload = json.dumps(obj).encode()
    return response_head(status, "application/json", len(payload)) + payload


# -- one stream ---------------------------------------------------------------------


class Stream:
    """The timed chunks of one streamed request, written by loop callbacks."""

    def __init__(
        self,
        conn: Connection,
        body: dict[str, Any],
        chat: bool,
        arrived: float,
        timing: Timing,
    ) -> None:
        self.conn, self.chat, self.arrived = conn, chat, arrived
        prompt = body["messages"][-1]["content"] if chat else body["prompt"]
        self.text = prompt if isinstance(prompt, str) else ""
        words = prompt if isinstance(prompt, list) else self.text.split()
        self.prompt_tokens = len(words)
        self.key = words[0] if words else None
        self.n = int(body.get("max_tokens") or 16)
        self.fail = "@failchunk" in self.text
        ttft = FAIL_TTFT_S if self.fail else timing.ttft_s * (2 if "@slow" in self.text else 1)
        self.start, self.gap = arrived + ttft, timing.gap_s
        self.id = f"{'chatcmpl' if chat else 'cmpl'}-{next(_ids):016x}"
        self.k = 0
        self.last_write = 0.0
        self.timer: asyncio.TimerHandle | None = None
        self.pending = b""

    def begin(self) -> None:
        # The head (and the chat role chunk) go out with the first token: one
        # write instead of two per request when a burst of requests arrives.
        self.pending = response_head(200, "text/event-stream")
        if self.chat:
            self.pending += http_chunk(role_event(self.id))
        self.schedule()

    def schedule(self) -> None:
        self.timer = self.conn.loop.call_at(self.start + self.k * self.gap, self.send_next)

    def send_next(self) -> None:
        now = self.conn.loop.time()
        out, self.pending = self.pending, b""
        if self.fail and self.k == 1:
            self.finish(out + http_chunk(error_event()))
            return
        last = self.k == self.n - 1
        out += http_chunk(text_event(self.id, self.chat, self.k, last))
        if not self.fail:
            self.record(now)
        self.last_write = now
        self.k += 1
        if not last:
            self.conn.transport.write(out)
            self.schedule()
        elif "@nousage" in self.text:
            self.finish(out)
        else:
            self.finish(out + http_chunk(usage_event(self.id, self.prompt_tokens, self.n)))

    def record(self, now: float) -> None:
        stats = self.conn.stats
        stats.lateness.append(now - (self.start + self.k * self.gap))
        if self.k == 0:
            stats.ttft.append(now - self.arrived)
            stats.first_writes.append((self.key, now))
        else:
            stats.gaps.append(now - self.last_write)

    def finish(self, out: bytes) -> None:
        self.conn.transport.write(out + http_chunk(DONE) + b"0\r\n\r\n")
        self.timer = None
        self.conn.stream_done()

    def cancel(self) -> None:
        if self.timer is not None:
            self.timer.cancel()


# -- connections --------------------------------------------------------------------


class Connection(asyncio.Protocol):
    """One keep-alive HTTP/1.1 connection; requests are answered one at a time."""

    def __init__(self, timing: Timing, stats: ServerStats) -> None:
        self.timing, self.stats = timing, stats
        self.loop = asyncio.get_running_loop()
        self.buf = bytearray()
        self.stream: Stream | None = None
        self.arrived = 0.0

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        assert isinstance(transport, asyncio.Transport)
        self.transport = transport
        # asyncio turns Nagle's algorithm off only for sockets that say they
        # are TCP: with it on, a token written while the previous one waits
        # for its (delayed) ACK is held back for up to 40 ms.
        sock = transport.get_extra_info("socket")
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)

    def connection_lost(self, exc: Exception | None) -> None:
        if self.stream is not None:
            self.stream.cancel()
            self.stream = None

    def data_received(self, data: bytes) -> None:
        # The arrival of the bytes that complete a request starts its clock.
        self.arrived = self.loop.time()
        self.buf += data
        self.next_request()

    def stream_done(self) -> None:
        self.stream = None
        # A request that came in behind this one starts its clock now.
        self.arrived = self.loop.time()
        self.next_request()

    def next_request(self) -> None:
        while self.stream is None and not self.transport.is_closing():
            end = self.buf.find(b"\r\n\r\n")
            if end < 0:
                return
            request_line, *lines = self.buf[:end].decode("latin-1").split("\r\n")
            headers = dict(line.lower().split(":", 1) for line in lines if ":" in line)
            length = int(headers.get("content-length", "0"))
            if len(self.buf) < end + 4 + length:
                return
            raw = bytes(self.buf[end + 4 : end + 4 + length])
            del self.buf[: end + 4 + length]
            self.handle(request_line.split(" ")[1], raw)

    def handle(self, target: str, raw: bytes) -> None:
        path, _, query = target.partition("?")
        if path == "/v1/models":
            models = [{"id": MODEL, "object": "model", "max_model_len": 4096}]
            self.transport.write(json_response(200, {"object": "list", "data": models}))
        elif path == "/stats":
            summary = self.stats.summary(detail="detail=1" in query)
            self.transport.write(json_response(200, summary))
            self.stats.reset()
        elif path in ("/v1/completions", "/v1/chat/completions"):
            self.completion(raw, path == "/v1/chat/completions")
        else:
            self.transport.write(json_response(404, {"error": {"message": f"no {path}"}}))

    def completion(self, raw: bytes, chat: bool) -> None:
        body = json.loads(raw)
        last = body["messages"][-1]["content"] if chat else body["prompt"]
        if isinstance(last, str) and "@fail500" in last:
            self.transport.write(json_response(500, {"error": {"message": "injected 500"}}))
            return
        self.stream = Stream(self, body, chat, self.arrived, self.timing)
        self.stream.begin()


# -- running it ---------------------------------------------------------------------


async def serve(sock: socket.socket, timing: Timing) -> None:
    stats = ServerStats()
    loop = asyncio.get_running_loop()
    server = await loop.create_server(lambda: Connection(timing, stats), sock=sock)
    await server.serve_forever()


def listening_socket(host: str = "127.0.0.1", port: int = 0) -> socket.socket:
    sock = socket.socket()
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind((host, port))
    # Deep enough for a burst of connects from a high-concurrency benchmark.
    sock.listen(1024)
    return sock


def _run(sock: socket.socket, timing: Timing) -> None:
    # select() rather than epoll: epoll waits in whole milliseconds (rounded
    # up), so every chunk would go out up to 1 ms late. select() is limited to
    # file descriptors below 1024, plenty for a benchmark of a few hundred streams.
    loop = asyncio.SelectorEventLoop(selectors.SelectSelector())
    with contextlib.suppress(KeyboardInterrupt), asyncio.Runner(loop_factory=lambda: loop) as r:
        r.run(serve(sock, timing))


@contextlib.contextmanager
def serve_in_process(timing: Timing) -> Iterator[str]:
    """Serve in a process of its own and yield its base URL.

    Not a thread of the caller: the server and a benchmark client in one
    process would take turns on the GIL (5 ms switch interval), blurring the
    timing under test. The socket listens before the fork, so clients can
    connect at once (queued in the backlog): no start-up wait.
    """
    sock = listening_socket()
    proc = multiprocessing.get_context("fork").Process(
        target=_run, args=(sock, timing), daemon=True
    )
    proc.start()
    try:
        yield f"http://127.0.0.1:{sock.getsockname()[1]}"
    finally:
        sock.close()
        proc.terminate()
        proc.join(10)
        if proc.is_alive():
            proc.kill()
            proc.join(10)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(
        prog="python -m harness.fake_openai_server",
        description=__doc__,
        formatter_class=argparse.RawTextHelpFormatter,
    )
    ap.add_argument("--host", default="127.0.0.1")
    ap.add_argument("--port", type=int, default=8123)
    ap.add_argument("--ttft-ms", type=float, default=60.0, help="(default: %(default)s)")
    ap.add_argument("--gap-ms", type=float, default=12.0, help="(default: %(default)s)")
    args = ap.parse_args(argv)
    sock = listening_socket(args.host, args.port)
    print(f"serving on http://{args.host}:{sock.getsockname()[1]}", file=sys.stderr)
    _run(sock, Timing(args.ttft_ms / 1e3, args.gap_ms / 1e3))


if __name__ == "__main__":
    main()
