"""HTTP/1.1 over one raw socket, for tests that need to see the connection
itself: whether a server keeps it open after an answer (keep-alive), which an
HTTP client library would hide by opening a new connection.

Imported by test modules as ``raw_http`` (pytest puts ``tests/`` on sys.path).
"""

from __future__ import annotations

import json
import socket
from dataclasses import dataclass
from typing import Any


@dataclass
class RawResponse:
    status: int
    headers: dict[str, str]
    """Header names lower-cased."""
    body: bytes

    def json(self) -> Any:
        return json.loads(self.body)


@dataclass
class RawRequest:
    method: str
    path: str
    body: bytes | None = None
    headers: dict[str, str] | None = None

    @classmethod
    def post_json(cls, path: str, body: Any, headers: dict[str, str] | None = None) -> RawRequest:
        return cls("POST", path, json.dumps(body).encode(), headers)

    def encode(self, host: str) -> bytes:
        lines = [f"{self.method} {self.path} HTTP/1.1", f"Host: {host}"]
        for name, value in (self.headers or {}).items():
            lines.append(f"{name}: {value}")
        if self.body is not None:
            lines += ["Content-Type: application/json", f"Content-Length: {len(self.body)}"]
        return "\r\n".join(lines).encode() + b"\r\n\r\n" + (self.body or b"")


def exchange(
    host: str, port: int, requests: list[RawRequest], timeout_s: float = 30.0
) -> list[RawResponse]:
    """Send ``requests`` one after the other over one connection, each once the
    answer to the one before is complete; ``ConnectionError`` if the server
    closes the connection before an answer is complete."""
    out = []
    with socket.create_connection((host, port), timeout=timeout_s) as sock:
        reader = sock.makefile("rb")
        for req in requests:
            sock.sendall(req.encode(f"{host}:{port}"))
            out.append(_read_response(reader))
    return out


def _line(reader: Any) -> bytes:
    line = reader.readline()
    if not line:
        raise ConnectionError("the server closed the connection")
    return line.rstrip(b"\r\n")


def _exactly(reader: Any, n: int) -> bytes:
    data = reader.read(n)
    if len(data) != n:
        raise ConnectionError("the server closed the connection mid-body")
    return data


def _read_response(reader: Any) -> RawResponse:
    status = int(_line(reader).split()[1])
    headers = {}
    while line := _line(reader):
        name, _, value = line.decode("latin-1").partition(":")
        headers[name.strip().lower()] = value.strip()
    if headers.get("transfer-encoding", "").lower() == "chunked":
        parts = []
        while size := int(_line(reader).split(b";")[0], 16):
            parts.append(_exactly(reader, size))
            _line(reader)
        _line(reader)  # the empty trailer
        body = b"".join(parts)
    else:
        body = _exactly(reader, int(headers.get("content-length", "0")))
    return RawResponse(status, headers, body)
