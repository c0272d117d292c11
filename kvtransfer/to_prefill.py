"""KV-plane messages a prefill engine receives (from decode engines)."""

from __future__ import annotations

import msgspec


class RankAgent(msgspec.Struct, frozen=True):
    """The transfer agent of one tensor-parallel rank of the decode engine."""

    agent: str
    metadata: bytes


class Handshake(msgspec.Struct, tag="handshake", frozen=True):
    decode_name: str
    """The decode engine's bootstrap endpoint: its name on the KV plane."""
    compat: dict[str, str]
    nonce: str
    mac: str
    """HMAC of (decode_name, compat hash, nonce) under the cluster token."""
    agent: str
    """Transfer-backend agent name of the decode engine."""
    metadata: bytes
    """Transfer-backend metadata of the decode engine's KV buffer."""
    ranks: list[RankAgent] = []
    """Agents of the decode engine's tensor-parallel ranks 1..N-1 (``agent``
    is rank 0's), each over its own pool."""


class Reserve(msgspec.Struct, tag="reserve", frozen=True):
    """Decode has pages for ``room``: prompt positions from ``decode_prefix_len``
    on go to ``dst_pages`` (``dst_pages[i]`` holds page ``prefix_pages + i``)."""

    room: str
    dst_pages: list[int]
    decode_prefix_len: int
    prompt_len: int


class AbortRoom(msgspec.Struct, tag="abort_room", frozen=True):
    """Decode gives up on ``room``; prefill must stop writing and confirm."""

    room: str
    reason: str = ""


ToPrefill = Handshake | Reserve | AbortRoom
decoder = msgspec.msgpack.Decoder(ToPrefill)
encoder = msgspec.msgpack.Encoder()
