"""The control messages of the nccl backend and the receiver's metadata.

A writer reads ``FromReceiver`` messages; a receiver reads ``FromWriter``
ones. The cluster-token handshake reuses the tcp backend's messages
(``kvtransfer.tcp.auth``). What each message does is in the package docstring.
"""

from __future__ import annotations

import msgspec

from kvtransfer.tcp.frames import _Auth, _Challenge, _Hello, _Reply, _Welcome


class NcclMetadata(msgspec.Struct, frozen=True):
    agent: str
    endpoint: str
    """The receiver's control socket (ZMQ ROUTER)."""
    token: str
    """Receiver incarnation: new on every ``register``; a pair offered with
    another token is refused (the receiver restarted or re-registered)."""
    nbytes: int
    device: str
    """"cuda" or "cpu": the channel both ends must use."""


class Pair(msgspec.Struct, tag="pair", frozen=True, array_like=True):
    pair: int
    token: str
    rendezvous: bytes
    """What the receiver needs to join the writer's new communicator."""
    timeout_s: float


class Paired(msgspec.Struct, tag="paired", frozen=True, array_like=True):
    pair: int


class Begin(msgspec.Struct, tag="begin", frozen=True, array_like=True):
    """The writer is about to send ``ranges`` ((dst_offset, nbytes), in order)."""

    pair: int
    seq: int
    ranges: list[tuple[int, int]]


class Landed(msgspec.Struct, tag="landed", frozen=True, array_like=True):
    """Every byte of write ``seq`` is in the receiver's buffer."""

    pair: int
    seq: int


class Refused(msgspec.Struct, tag="refused", frozen=True, array_like=True):
    """The receiver gave up on ``pair`` (its communicator is aborted)."""

    pair: int
    reason: str


class Unpair(msgspec.Struct, tag="unpair", frozen=True, array_like=True):
    """The writer gave up on ``pair`` (its communicator is aborted)."""

    pair: int
    reason: str


class Ping(msgspec.Struct, tag="ping", frozen=True, array_like=True):
    """An idle writer is alive (sent every ``PEER_HEARTBEAT_IVL_S``)."""


FromWriter = _Hello | _Auth | Pair | Begin | Unpair | Ping
FromReceiver = _Challenge | _Welcome | _Reply | Paired | Landed | Refused

encode = msgspec.msgpack.Encoder().encode
decode_meta = msgspec.msgpack.Decoder(NcclMetadata).decode
decode_from_writer = msgspec.msgpack.Decoder(FromWriter).decode
decode_from_receiver = msgspec.msgpack.Decoder(FromReceiver).decode
