"""A lean HTTP/1.1 client for timing streamed responses (plain http:// only).

A general HTTP client does real work per received chunk (httpx: its stream
layers, a task switch per read, line decoding), and the serving benchmark
runs hundreds of streams on one event loop: that work is paid before the
client notices the next chunk, so it inflates TTFT and ITL as concurrency
grows. Here the work per received packet is as small as it can be in Python:

- each connection is an ``asyncio.Protocol``: bytes are handled in the
  transport's read callback, without waking a task per read;
- the first thing that callback does is read the clock: every body piece is
  stored with the time it arrived;
- only the HTTP framing is decoded as data arrives (chunked transfer-encoding,
  Content-Length, or read-until-close), since the client must know where a
  response ends; SSE lines and JSON are left for later (``sse_lines``).

Connections are kept alive and reused; a request that finds its reused
connection closed by the server before any byte of the answer arrived is
retried once on a fresh one.
"""

from __future__ import annotations

import asyncio
import contextlib
import socket
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from urllib.parse import urlsplit

_HEAD, _CHUNK_SIZE, _CHUNK_DATA, _CHUNK_END, _TRAILERS, _LENGTH, _UNTIL_CLOSE, _DONE = range(8)
_MAX_HEAD = 64 * 1024


class StreamError(Exception):
    """The response could not be read: connection, framing or timeout."""


class ClosedBeforeAnswer(StreamError):
    """The server closed the connection before sending a byte of the response."""


@dataclass
class Response:
    status: int = 0
    headers: dict[str, str] = field(default_factory=dict)
    times: list[float] = field(default_factory=list)
    """perf_counter() when each body piece arrived (parallel to ``pieces``)."""
    pieces: list[bytes] = field(default_factory=list)
    """The body, de-chunked, as it arrived."""
    end: float = 0.0
    """perf_counter() when the last byte of the response arrived."""

    @property
    def body(self) -> bytes:
        return b"".join(self.pieces)

    @property
    def size(self) -> int:
        return sum(map(len, self.pieces))


def sse_lines(resp: Response) -> Iterator[tuple[float, bytes]]:
    """The body's lines, each with the arrival time of the piece that completed it."""
    rest = b""
    t = resp.end
    for t, data in zip(resp.times, resp.pieces):
        lines = (rest + data if rest else data).split(b"\n")
        rest = lines.pop()
        for line in lines:
            yield t, line.removesuffix(b"\r")
    if rest:
        yield t, rest.removesuffix(b"\r")


class _Connection(asyncio.Protocol):
    """One keep-alive connection; one request at a time."""

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self.loop = loop
        self.transport: asyncio.Transport | None = None
        self.closed = False
        self.reusable = True
        self.last_activity = 0.0
        self._begin_response(None)

    # -- asyncio callbacks (the timing path) --

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        assert isinstance(transport, asyncio.Transport)
        self.transport = transport

    def data_received(self, data: bytes) -> None:
        now = time.perf_counter()
        self.last_activity = now
        self.got_bytes = True
        try:
            self._feed(data, now)
        except (ValueError, StreamError) as e:
            self._fail(StreamError(f"bad HTTP response: {e}"))

    def connection_lost(self, exc: Exception | None) -> None:
        self.closed = True
        if self.state == _UNTIL_CLOSE:
            self._finish(time.perf_counter())
        elif self.state != _DONE:
            why = f": {exc}" if exc else ""
            error = ClosedBeforeAnswer if not self.got_bytes else StreamError
            self._fail(error(f"the server closed the connection mid-response{why}"))

    # -- requests --

    def _begin_response(self, done: asyncio.Future[Response] | None) -> None:
        self.done = done
        self.resp = Response()
        self.state = _HEAD if done is not None else _DONE
        self.buf = b""
        self.need = 0
        self.got_bytes = False

    def send(self, data: bytes) -> asyncio.Future[Response]:
        assert self.transport is not None and self.state == _DONE
        done: asyncio.Future[Response] = self.loop.create_future()
        self._begin_response(done)
        self.last_activity = time.perf_counter()
        self.transport.write(data)
        return done

    def close(self) -> None:
        if self.transport is not None and not self.closed:
            self.transport.close()
        self.closed = True

    def _finish(self, now: float) -> None:
        self.state = _DONE
        self.resp.end = now
        if self.done is not None and not self.done.done():
            self.done.set_result(self.resp)

    def _fail(self, exc: Exception) -> None:
        self.state = _DONE
        self.reusable = False
        self.close()
        if self.done is not None and not self.done.done():
            self.done.set_exception(exc)

    # -- framing --

    def _feed(self, data: bytes, now: float) -> None:
        buf = self.buf + data if self.buf else data
        pos, n = 0, len(buf)
        while pos < n:
            state = self.state
            if state == _CHUNK_DATA:
                take = min(self.need, n - pos)
                self.resp.times.append(now)
                self.resp.pieces.append(buf[pos : pos + take] if take < n else buf)
                pos += take
                self.need -= take
                if not self.need:
                    self.state = _CHUNK_END
            elif state in (_CHUNK_SIZE, _CHUNK_END, _TRAILERS):
                eol = buf.find(b"\r\n", pos)
                if eol < 0:
                    break
                line = buf[pos:eol]
                pos = eol + 2
                if state == _CHUNK_END:
                    if line:
                        raise StreamError("chunk data longer than its size")
                    self.state = _CHUNK_SIZE
                elif state == _TRAILERS:
                    if not line:
                        self._finish(now)
                else:
                    self.need = int(line.split(b";", 1)[0], 16)
                    self.state = _CHUNK_DATA if self.need else _TRAILERS
            elif state == _LENGTH:
                take = min(self.need, n - pos)
                self.resp.times.append(now)
                self.resp.pieces.append(buf[pos : pos + take])
                pos += take
                self.need -= take
                if not self.need:
                    self._finish(now)
            elif state == _UNTIL_CLOSE:
                self.resp.times.append(now)
                self.resp.pieces.append(buf[pos:])
                pos = n
            elif state == _HEAD:
                end = buf.find(b"\r\n\r\n", pos)
                if end < 0:
                    if n - pos > _MAX_HEAD:
                        raise StreamError("response head too long")
                    break
                self._head(buf[pos:end], now)
                pos = end + 4
            else:  # _DONE: bytes past the response's end, not a server to reuse
                self.reusable = False
                break
        self.buf = buf[pos:] if pos < n else b""

    def _head(self, head: bytes, now: float) -> None:
        status_line, *lines = head.decode("latin-1").split("\r\n")
        version, status = status_line.split(" ", 2)[:2]
        if 100 <= int(status) < 200:
            return  # an interim response (100 Continue): the real one follows
        headers = {}
        for line in lines:
            name, _, value = line.partition(":")
            headers[name.strip().lower()] = value.strip()
        self.resp.status, self.resp.headers = int(status), headers
        connection = headers.get("connection", "").lower()
        if connection == "close" or (version == "HTTP/1.0" and connection != "keep-alive"):
            self.reusable = False
        if "chunked" in headers.get("transfer-encoding", "").lower():
            self.state = _CHUNK_SIZE
        elif "content-length" in headers:
            self.need = int(headers["content-length"])
            self.state = _LENGTH
            if not self.need:
                self._finish(now)
        else:
            self.state = _UNTIL_CLOSE
            self.reusable = False


class StreamClient:
    """POSTs to one http:// server over a pool of keep-alive connections."""

    def __init__(self, base_url: str, timeout_s: float, headers: dict[str, str] | None = None):
        parts = urlsplit(base_url)
        if parts.scheme != "http":
            raise ValueError(f"the raw HTTP client speaks plain http:// only, not {base_url}")
        self.host = parts.hostname or "127.0.0.1"
        self.port = parts.port or 80
        self.prefix = parts.path.rstrip("/")
        self.timeout_s = timeout_s
        host_header = self.host if parts.port is None else f"{self.host}:{self.port}"
        if ":" in self.host:  # an IPv6 literal
            host_header = f"[{self.host}]" + ("" if parts.port is None else f":{self.port}")
        extra = "".join(f"{k}: {v}\r\n" for k, v in (headers or {}).items())
        self._head_tail = f"Host: {host_header}\r\n{extra}"
        self._idle: list[_Connection] = []
        self._all: set[_Connection] = set()
        self._address: tuple[str, int] | None = None

    def request_bytes(self, path: str, body: bytes) -> bytes:
        """A complete POST; build it ahead of time to keep it off the timing path."""
        head = (
            f"POST {self.prefix}{path} HTTP/1.1\r\n{self._head_tail}"
            "Content-Type: application/json\r\nAccept: text/event-stream\r\n"
            f"Content-Length: {len(body)}\r\n\r\n"
        )
        return head.encode("latin-1") + body

    async def _resolve(self) -> tuple[str, int]:
        # Once, not per connection: asyncio resolves names in a thread pool,
        # and threads in the client process would compete for the GIL.
        if self._address is None:
            loop = asyncio.get_running_loop()
            infos = await loop.getaddrinfo(self.host, self.port, type=socket.SOCK_STREAM)
            self._address = infos[0][4][:2]
        return self._address

    async def _connect(self) -> _Connection:
        loop = asyncio.get_running_loop()
        host, port = await self._resolve()
        conn = _Connection(loop)
        try:
            await asyncio.wait_for(loop.create_connection(lambda: conn, host, port), self.timeout_s)
        except TimeoutError:
            raise StreamError(f"connecting took over {self.timeout_s:g} s") from None
        self._all.add(conn)
        return conn

    def _take_idle(self) -> _Connection | None:
        while self._idle:
            conn = self._idle.pop()
            if not conn.closed:
                return conn
            self._all.discard(conn)
        return None

    async def post(self, request: bytes) -> Response:
        """Send a request from ``request_bytes`` and read its whole response."""
        conn = self._take_idle()
        if conn is not None:
            # A kept-alive connection that the server closed meanwhile: retry
            # once on a fresh one (the server cannot have started on it).
            with contextlib.suppress(ClosedBeforeAnswer):
                return await self._exchange(conn, request)
        return await self._exchange(await self._connect(), request)

    async def _exchange(self, conn: _Connection, request: bytes) -> Response:
        done = conn.send(request)
        try:
            resp = await self._wait(conn, done)
        except BaseException:
            conn.close()
            self._all.discard(conn)
            raise
        if conn.reusable and not conn.closed:
            self._idle.append(conn)
        else:
            conn.close()
            self._all.discard(conn)
        return resp

    async def _wait(self, conn: _Connection, done: asyncio.Future[Response]) -> Response:
        # One timer per request, not per read: when it fires, it checks when
        # the connection last received anything and waits again if recently.
        while True:
            left = conn.last_activity + self.timeout_s - time.perf_counter()
            if left <= 0:
                raise StreamError(f"no data for {self.timeout_s:g} s")
            await asyncio.wait([done], timeout=left)
            if done.done():
                return done.result()

    async def aclose(self) -> None:
        for conn in self._all:
            conn.close()
        self._all.clear()
        self._idle.clear()
