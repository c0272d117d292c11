"""The decode engine's end of the KV plane: one DEALER per prefill engine,
opened on first use with a handshake; messages wait until it succeeds.

Each connection is watched: ZMTP heartbeats drop it when the prefill engine
stops answering (killed, paused, cut off) and a socket monitor reports the
drop, so rooms waiting for that engine's KV fail within
``PEER_HEARTBEAT_TIMEOUT_S`` instead of at their transfer deadline."""

from __future__ import annotations

import logging
import secrets
import time
from dataclasses import dataclass, field

import msgspec
import zmq
from zmq.utils.monitor import recv_monitor_message

from kvtransfer import to_decode, to_prefill
from kvtransfer.backend import TransferBackend
from kvtransfer.compat import compat_hash, sign
from kvtransfer.endpoint import PEER_HEARTBEAT_IVL_S, PEER_HEARTBEAT_TIMEOUT_S, bind_router

log = logging.getLogger(__name__)


class PeerFailed(msgspec.Struct, frozen=True):
    """A prefill engine is unusable: handshake refused, unreachable, or silent."""

    reason: str
    writes_possible: bool = False
    """The engine may still be alive (its connection dropped: paused, cut off)
    and write pages it was sent, so they stay held for one more timeout."""


@dataclass
class _Peer:
    sock: zmq.Socket
    monitor: zmq.Socket
    started: float
    ok: bool = False
    queued: list[bytes] = field(default_factory=list)


class DecodeKVPlane:
    def __init__(
        self,
        host: str,
        port: int,
        backend: TransferBackend,
        compat: dict[str, str],
        cluster_token: str,
        handshake_timeout_s: float,
        rank_agents: list[to_prefill.RankAgent] | None = None,
    ) -> None:
        """``rank_agents``: with tensor parallelism, the agents of ranks 1..N-1
        (``backend`` is rank 0's); prefill ranks write into each."""
        self.backend = backend
        self.rank_agents = list(rank_agents or [])
        self.compat = compat
        self.cluster_token = cluster_token
        self.handshake_timeout_s = handshake_timeout_s
        self._ctx = zmq.Context.instance()
        # Bound only to claim a unique, reachable name on the KV plane.
        self._own, self.endpoint = bind_router(host, port)
        self._peers: dict[str, _Peer] = {}
        self._failed: list[tuple[str, PeerFailed]] = []

    def send(self, prefill_endpoint: str, msg: to_prefill.ToPrefill) -> None:
        peer = self._peers.get(prefill_endpoint) or self._connect(prefill_endpoint)
        payload = to_prefill.encoder.encode(msg)
        if peer.ok:
            peer.sock.send(payload, zmq.NOBLOCK)
        else:
            peer.queued.append(payload)

    def _connect(self, endpoint: str) -> _Peer:
        sock = self._ctx.socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.IDENTITY, self.endpoint.encode())
        sock.setsockopt(zmq.HEARTBEAT_IVL, int(PEER_HEARTBEAT_IVL_S * 1000))
        sock.setsockopt(zmq.HEARTBEAT_TIMEOUT, int(PEER_HEARTBEAT_TIMEOUT_S * 1000))
        monitor = sock.get_monitor_socket(zmq.EVENT_DISCONNECTED)
        sock.connect(endpoint)
        nonce = secrets.token_hex(8)
        hs = to_prefill.Handshake(
            decode_name=self.endpoint,
            compat=self.compat,
            nonce=nonce,
            mac=sign(self.cluster_token, self.endpoint, compat_hash(self.compat), nonce),
            agent=self.backend.agent_name,
            metadata=self.backend.metadata(),
            ranks=self.rank_agents,
        )
        sock.send(to_prefill.encoder.encode(hs), zmq.NOBLOCK)
        peer = _Peer(sock, monitor, time.monotonic())
        self._peers[endpoint] = peer
        return peer

    def poll(
        self,
    ) -> list[tuple[str, to_decode.Done | to_decode.RoomFailed | to_decode.AbortAck | PeerFailed]]:
        events: list = list(self._failed)
        self._failed.clear()
        now = time.monotonic()
        for endpoint, peer in list(self._peers.items()):
            while True:
                try:
                    payload = peer.sock.recv(zmq.NOBLOCK)
                except zmq.Again:
                    break
                try:
                    msg = to_decode.decoder.decode(payload)
                except msgspec.DecodeError as e:
                    log.warning("dropping malformed KV-plane frame from %s: %s", endpoint, e)
                    continue
                if isinstance(msg, to_decode.HandshakeOk):
                    peer.ok = True
                    for q in peer.queued:
                        peer.sock.send(q, zmq.NOBLOCK)
                    peer.queued.clear()
                elif isinstance(msg, to_decode.HandshakeRejected):
                    self._drop(endpoint)
                    events.append((endpoint, PeerFailed(msg.reason)))
                    break
                else:
                    events.append((endpoint, msg))
            if endpoint in self._peers and self._disconnected(peer):
                # The handshake state lives with the connection: the next use
                # reconnects and shakes hands afresh (a restarted engine at
                # the same address serves it).
                self._drop(endpoint)
                reason = f"the KV-plane connection to {endpoint} dropped"
                events.append((endpoint, PeerFailed(reason, writes_possible=True)))
                continue
            if (
                not peer.ok
                and endpoint in self._peers
                and now - peer.started > self.handshake_timeout_s
            ):
                self._drop(endpoint)
                events.append(
                    (
                        endpoint,
                        PeerFailed(
                            f"no KV-plane handshake answer from {endpoint} "
                            f"within {self.handshake_timeout_s:g}s"
                        ),
                    )
                )
        return events

    def sockets(self) -> list[zmq.Socket]:
        """The sockets whose messages ``poll`` reads (each peer's connection
        and its monitor)."""
        return [s for peer in self._peers.values() for s in (peer.sock, peer.monitor)]

    def has_pending(self) -> bool:
        """True when ``poll`` has something to report now."""
        return bool(self._failed) or any(
            s.getsockopt(zmq.EVENTS) & zmq.POLLIN for s in self.sockets()
        )

    @staticmethod
    def _disconnected(peer: _Peer) -> bool:
        dropped = False
        while True:
            try:
                event = recv_monitor_message(peer.monitor, zmq.NOBLOCK)
            except zmq.Again:
                return dropped
            dropped = dropped or event["event"] == zmq.EVENT_DISCONNECTED

    def _drop(self, endpoint: str) -> None:
        peer = self._peers.pop(endpoint, None)
        if peer is not None:
            peer.sock.disable_monitor()
            peer.monitor.close(0)
            peer.sock.close(0)

    def drop_peer(self, endpoint: str, reason: str) -> None:
        """Forget a prefill engine (e.g. it stopped answering); reconnects on next use."""
        if endpoint in self._peers:
            self._drop(endpoint)
            self._failed.append((endpoint, PeerFailed(reason)))

    def close(self) -> None:
        for endpoint in list(self._peers):
            self._drop(endpoint)
        self._own.close(0)
        self.backend.close()
