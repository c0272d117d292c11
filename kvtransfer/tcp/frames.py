"""The wire frames of the tcp data channel: the receiver's published metadata,
the transfer messages a writer sends (``Begin``, ``Data``), the handshake
messages (``Hello``, ``Auth``; ``Challenge``, ``Welcome``), the receiver's
``Reply``, and their msgpack codecs. What each message means in the protocol is
in the package docstring (``kvtransfer.tcp``); the handshake is in
``kvtransfer.tcp.auth``.
"""

from __future__ import annotations

import msgspec

_MAX_PIECES = 4096  # pieces in one message


class TcpMetadata(msgspec.Struct, frozen=True):
    agent: str
    endpoint: str
    token: str
    """Receiver incarnation: changes on every ``register``, so writes built from
    stale metadata (peer restarted or re-registered) are refused."""
    nbytes: int


class _Begin(msgspec.Struct, tag="b", array_like=True):
    writer: str
    xfer: int
    token: str
    ranges: list[tuple[int, int]]


class _Data(msgspec.Struct, tag="d", array_like=True):
    writer: str
    xfer: int
    token: str
    pieces: list[tuple[int, int]]  # (dst_offset, nbytes)


class _Hello(msgspec.Struct, tag="h", array_like=True):
    writer: str


class _Auth(msgspec.Struct, tag="a", array_like=True):
    mac: str
    """HMAC of (label, the receiver's nonce, the writer) under the cluster token."""


class _Reply(msgspec.Struct, tag="r", array_like=True):
    xfer: int
    nbytes: int
    error: str | None = None
    unauthenticated: bool = False
    """Refused because the connection has not authenticated: the writer drops
    its socket, and its next write starts a new handshake."""


class _Challenge(msgspec.Struct, tag="c", array_like=True):
    nonce: str


class _Welcome(msgspec.Struct, tag="w", array_like=True):
    pass


_encode = msgspec.msgpack.Encoder().encode
_decode_meta = msgspec.msgpack.Decoder(TcpMetadata).decode
_decode_msg = msgspec.msgpack.Decoder(_Begin | _Data | _Hello | _Auth).decode
"""What a receiver reads from a writer's connection."""
_decode_reply = msgspec.msgpack.Decoder(_Reply | _Challenge | _Welcome).decode
"""What a writer reads back from a receiver."""
