"""KV-plane messages a decode engine receives (from prefill engines)."""

from __future__ import annotations

import msgspec

from protocol.finish import FinishReason


class HandshakeOk(msgspec.Struct, tag="handshake_ok", frozen=True):
    prefill_name: str


class HandshakeRejected(msgspec.Struct, tag="handshake_rejected", frozen=True):
    reason: str


class Done(msgspec.Struct, tag="done", frozen=True):
    """Every page of ``room`` has landed; decoding can start."""

    room: str
    first_token: int
    logprob: float
    cached_tokens: int
    finish_reason: FinishReason | None = None
    """Set when the first token already ends the request (STOP or LENGTH)."""


class RoomFailed(msgspec.Struct, tag="room_failed", frozen=True):
    """Prefill could not complete ``room``; no write of it is in flight."""

    room: str
    reason: str


class AbortAck(msgspec.Struct, tag="abort_ack", frozen=True):
    """No write of ``room`` is in flight any more: its pages may be reused."""

    room: str


ToDecode = HandshakeOk | HandshakeRejected | Done | RoomFailed | AbortAck
decoder = msgspec.msgpack.Decoder(ToDecode)
encoder = msgspec.msgpack.Encoder()
