"""The prefill engine's end of the KV plane: a ROUTER that decode engines
connect to; handshakes, reservations, and pushes of KV pages."""

from __future__ import annotations

import logging
import secrets
from collections.abc import Sequence

import msgspec
import zmq

from kvtransfer import to_decode, to_prefill
from kvtransfer.backend import TransferBackend, TransferState
from kvtransfer.compat import compat_hash, describe_mismatch, verify
from kvtransfer.endpoint import bind_router
from kvtransfer.layout import page_ranges

log = logging.getLogger(__name__)


class PrefillKVPlane:
    def __init__(
        self,
        host: str,
        port: int,
        backend: TransferBackend,
        compat: dict[str, str],
        cluster_token: str,
        page_bytes: int,
    ) -> None:
        self.backend = backend
        self.compat = compat
        self.cluster_token = cluster_token
        self.page_bytes = page_bytes
        self._sock, self.endpoint = bind_router(host, port)
        self._identity: dict[str, bytes] = {}
        """Handshaken decode engines: name -> ZMQ identity."""
        self._names: dict[bytes, str] = {}
        self._agents: dict[str, str] = {}
        """Decode engine name -> its transfer-backend agent name."""
        self.rejected: dict[str, str] = {}
        """Decode engines whose handshake failed, with the reason."""

    def poll(self) -> list[tuple[str, to_prefill.Reserve | to_prefill.AbortRoom]]:
        """Handle pending messages; returns reservations and aborts with the
        name of the decode engine that sent them."""
        events: list[tuple[str, to_prefill.Reserve | to_prefill.AbortRoom]] = []
        while True:
            try:
                ident, payload = self._sock.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                return events
            except ValueError:
                continue
            try:
                msg = to_prefill.decoder.decode(payload)
            except msgspec.DecodeError as e:
                log.warning("dropping malformed KV-plane frame: %s", e)
                continue
            if isinstance(msg, to_prefill.Handshake):
                self._handshake(ident, msg)
            elif ident in self._names:
                events.append((self._names[ident], msg))
            else:
                log.warning("dropping %s from a peer without a handshake", type(msg).__name__)

    def has_pending(self) -> bool:
        """True when a KV-plane message waits to be handled by ``poll``."""
        return bool(self._sock.getsockopt(zmq.EVENTS) & zmq.POLLIN)

    def _handshake(self, ident: bytes, msg: to_prefill.Handshake) -> None:
        reason = None
        if not verify(
            self.cluster_token, msg.mac, msg.decode_name, compat_hash(msg.compat), msg.nonce
        ):
            reason = "KV plane refused the peer: cluster token mismatch"
        else:
            reason = describe_mismatch(self.compat, msg.compat)
        if reason is None:
            try:
                self.backend.connect(msg.agent, msg.metadata)
            except Exception as e:  # noqa: BLE001 (any backend failure is reported to the peer)
                reason = f"transfer backend could not connect: {e}"
        if reason is not None:
            log.warning("handshake from %s rejected: %s", msg.decode_name, reason)
            self.rejected[msg.decode_name] = reason
            self._send_ident(ident, to_decode.HandshakeRejected(reason))
            return
        self.rejected.pop(msg.decode_name, None)
        self._identity[msg.decode_name] = ident
        self._names[ident] = msg.decode_name
        self._agents[msg.decode_name] = msg.agent
        log.info("KV plane connected to decode engine %s", msg.decode_name)
        self._send_ident(ident, to_decode.HandshakeOk(self.endpoint))

    def is_connected(self, decode_name: str) -> bool:
        return decode_name in self._identity

    def write(self, decode_name: str, src_pages: Sequence[int], dst_pages: Sequence[int]) -> int:
        ranges = page_ranges(src_pages, dst_pages, self.page_bytes)
        return self.backend.write(self._agents[decode_name], ranges)

    def poll_write(self, handle: int) -> TransferState:
        return self.backend.poll(handle)

    def send(self, decode_name: str, msg: to_decode.ToDecode) -> None:
        ident = self._identity.get(decode_name)
        if ident is not None:
            self._send_ident(ident, msg)

    def _send_ident(self, ident: bytes, msg: to_decode.ToDecode) -> None:
        try:
            self._sock.send_multipart([ident, to_decode.encoder.encode(msg)], zmq.NOBLOCK)
        except zmq.ZMQError as e:
            log.warning("KV-plane send failed: %s", e)

    def close(self) -> None:
        self._sock.close(0)
        self.backend.close()


def new_nonce() -> str:
    return secrets.token_hex(8)
