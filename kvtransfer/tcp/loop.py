"""The I/O thread of the tcp backend: one loop that owns every socket, serves
the receiving ROUTER (handshake and transfer messages) and drives the writes to
each peer: it keeps at most ``window`` chunks per peer unacknowledged, fails
writes and peers that make no progress for ``timeout`` seconds (see the package
docstring), and applies the fault hook's drops and delays.

The API thread (``kvtransfer.tcp.backend``) hands work over as commands on a
queue, with a wake-up message on an inproc socket; transfer outcomes go back
through ``TcpBackend._finish`` under the backend's lock.
"""

from __future__ import annotations

import contextlib
import logging
import queue
import time
from collections import deque
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import msgspec
import zmq

from kvtransfer.backend import TransferState
from kvtransfer.tcp.auth import _answer_challenge, _ReceiverAuth
from kvtransfer.tcp.frames import (
    TcpMetadata,
    _Auth,
    _Begin,
    _Challenge,
    _Data,
    _decode_msg,
    _decode_reply,
    _encode,
    _Hello,
    _Reply,
    _Welcome,
)
from kvtransfer.tcp.receiver import _Receiver
from kvtransfer.tcp.transfer import _Xfer

if TYPE_CHECKING:
    from kvtransfer.tcp.backend import TcpBackend

logger = logging.getLogger(__name__)


@dataclass(eq=False)
class _Peer:
    """Writer-side state of one peer; owned by the I/O thread."""

    meta: TcpMetadata
    sock: zmq.Socket | None = None
    xfers: deque[_Xfer] = field(default_factory=deque)
    deadline: float = 0.0
    authed: bool = False
    """The connection passed the cluster-token handshake (or none is needed)."""


class _IoLoop:
    """Everything the background thread owns: sockets, receiver and sender state."""

    def __init__(self, backend: TcpBackend) -> None:
        self.b = backend
        self.poller = zmq.Poller()
        self.poller.register(backend._wake_rx, zmq.POLLIN)
        self.router: zmq.Socket | None = None
        # receiver side
        self.receiver = _Receiver(backend.agent_name)
        self.auth = _ReceiverAuth(backend.agent_name, backend.cluster_token)
        # writer side
        self.peers: dict[str, _Peer] = {}
        self.by_sock: dict[zmq.Socket, _Peer] = {}
        self.active: dict[int, _Xfer] = {}
        self.stopping = False
        self.faults = backend._faults
        self.held: dict[int, tuple[int, float]] = {}
        """xfer handle -> (chunk, when it may go): chunks the fault hook delays."""

    def run(self) -> None:
        while not self.stopping:
            events = dict(self.poller.poll(self._poll_timeout_ms()))
            if self.b._wake_rx in events:
                self._drain_commands()
            if self.router is not None and self.router in events:
                self._serve_router()
            for sock, peer in list(self.by_sock.items()):
                if sock in events:
                    self._read_replies(peer)
            for name, peer in list(self.peers.items()):
                self._pump(name, peer)
            self._check_deadlines()

    def shutdown(self) -> None:
        self.fail_all("backend closed")
        for peer in self.peers.values():
            self._drop_socket(peer)
        if self.router is not None:
            self.router.close(linger=0)
        self.b._wake_rx.close(linger=0)

    def fail_all(self, why: str) -> None:
        for xfer in list(self.active.values()):
            self.b._finish(xfer, TransferState.FAILED, f"write to {xfer.peer!r} failed: {why}")
        self.active.clear()
        for peer in self.peers.values():
            peer.xfers.clear()

    def _poll_timeout_ms(self) -> int:
        busy = [p.deadline for p in self.peers.values() if p.xfers]
        busy += [at for _, at in self.held.values()]
        busy += [x.deadline for x in self.active.values() if x.inflight]
        if not busy:
            return 1000
        return max(0, min(1000, int((min(busy) - time.monotonic()) * 1000) + 1))

    # commands from the API thread

    def _drain_commands(self) -> None:
        while True:
            try:
                self.b._wake_rx.recv(zmq.NOBLOCK)
            except zmq.Again:
                break
        while True:
            try:
                cmd = self.b._cmds.get_nowait()
            except queue.Empty:
                return
            kind = cmd[0]
            if kind == "write":
                self._start(cmd[1])
            elif kind == "connect":
                _, name, meta = cmd
                old = self.peers.get(name)
                if old is not None:
                    self._fail_peer(name, old, "peer metadata was replaced")
                    self._drop_socket(old)
                self.peers[name] = _Peer(meta)
            elif kind == "disconnect":
                peer = self.peers.pop(cmd[1], None)
                if peer is not None:
                    self._fail_peer(cmd[1], peer, "peer was disconnected")
                    self._drop_socket(peer)
            elif kind == "router":
                self.router = cmd[1]
                self.poller.register(self.router, zmq.POLLIN)
            elif kind == "buffer":
                self.receiver.register(cmd[1], cmd[2])
            elif kind == "stop":
                self.stopping = True

    # receiver side

    def _serve_router(self) -> None:
        assert self.router is not None
        for _ in range(256):  # bounded, so the sender side gets its turn
            try:
                frames = self.router.recv_multipart(zmq.NOBLOCK, copy=False)
            except zmq.Again:
                return
            ident = frames[0].bytes
            try:
                msg = _decode_msg(frames[1].bytes)
            except (msgspec.DecodeError, IndexError):
                logger.warning("%s: dropped a malformed transfer message", self.b.agent_name)
                continue
            if isinstance(msg, (_Hello, _Auth)):
                reply = self.auth.answer(ident, msg)
            elif not self.auth.admits(ident):
                logger.warning(
                    "%s: refused a transfer message from an unauthenticated connection",
                    self.b.agent_name,
                )
                reply = _Reply(msg.xfer, 0, "refused: the connection has not authenticated", True)
            else:
                reply = self.receiver.receive(msg, [f.buffer for f in frames[2:]])
            if reply is not None:
                self.router.send_multipart([ident, _encode(reply)], zmq.NOBLOCK)

    # writer side

    def _start(self, xfer: _Xfer) -> None:
        peer = self.peers.get(xfer.peer)
        if peer is None:
            self.b._finish(xfer, TransferState.FAILED, f"peer {xfer.peer!r} was disconnected")
            return
        if not peer.xfers:
            peer.deadline = time.monotonic() + self.b.timeout
        peer.xfers.append(xfer)
        self.active[xfer.handle] = xfer

    def _socket(self, peer: _Peer) -> zmq.Socket:
        if peer.sock is None:
            sock = self.b._ctx.socket(zmq.DEALER)
            sock.setsockopt(zmq.LINGER, 0)
            sock.setsockopt(zmq.SNDHWM, 0)  # the window bounds what is queued
            sock.setsockopt(zmq.RCVHWM, 0)
            sock.connect(peer.meta.endpoint)
            self.poller.register(sock, zmq.POLLIN)
            self.by_sock[sock] = peer
            peer.sock = sock
            peer.authed = self.b.cluster_token is None
            if not peer.authed:
                sock.send(_encode(_Hello(self.b._writer_id)), zmq.NOBLOCK)
        return peer.sock

    def _drop_socket(self, peer: _Peer) -> None:
        if peer.sock is not None:
            self.poller.unregister(peer.sock)
            self.by_sock.pop(peer.sock, None)
            peer.sock.close(linger=0)
            peer.sock = None
            peer.authed = False

    def _pump(self, name: str, peer: _Peer) -> None:
        if not peer.xfers:
            return
        sock = self._socket(peer)
        if not peer.authed:
            return  # nothing goes out before the handshake is through
        window = self.b.window
        inflight = sum(x.inflight for x in peer.xfers)
        writer, token = self.b._writer_id, peer.meta.token
        for xfer in peer.xfers:
            try:
                if not xfer.begun:
                    begin = _Begin(writer, xfer.handle, token, xfer.ranges)
                    sock.send(_encode(begin), zmq.NOBLOCK)
                    xfer.begun = True
                    xfer.deadline = time.monotonic() + self.b.timeout
                while inflight < window and xfer.next_chunk < len(xfer.chunks):
                    fault = None if self.faults is None else self._fault(xfer)
                    if fault == "hold":
                        return
                    pieces = xfer.chunks[xfer.next_chunk]
                    header = _Data(writer, xfer.handle, token, [(p[1], p[2]) for p in pieces])
                    frames = [_encode(header), *xfer.src.frames(pieces)]
                    if fault != "drop":
                        sock.send_multipart(frames, zmq.NOBLOCK, copy=False)
                    xfer.next_chunk += 1
                    xfer.inflight += 1
                    inflight += 1
            except zmq.Again:
                return  # queue full; retried on the next loop turn
            if inflight >= window:
                return

    def _fault(self, xfer: _Xfer) -> str | None:
        """The fault hook's verdict on ``xfer``'s next chunk: "drop" (counted
        as sent, never delivered), "hold" (not yet) or None (send it)."""
        assert self.faults is not None
        now = time.monotonic()
        held = self.held.get(xfer.handle)
        if held is None or held[0] != xfer.next_chunk:
            fault = self.faults.next_message()
            if fault.drop:
                return "drop"
            if fault.delay_s <= 0:
                return None
            held = self.held[xfer.handle] = (xfer.next_chunk, now + fault.delay_s)
        if now < held[1]:
            return "hold"
        del self.held[xfer.handle]
        return None

    def _read_replies(self, peer: _Peer) -> None:
        assert peer.sock is not None
        while peer.sock is not None:
            try:
                raw = peer.sock.recv(zmq.NOBLOCK)
            except zmq.Again:
                return
            try:
                reply = _decode_reply(raw)
            except msgspec.DecodeError:
                continue
            if isinstance(reply, _Challenge):
                auth = _answer_challenge(self.b.cluster_token, reply, self.b._writer_id)
                peer.sock.send(_encode(auth), zmq.NOBLOCK)
                peer.deadline = time.monotonic() + self.b.timeout
                continue
            if isinstance(reply, _Welcome):
                peer.authed = True
                peer.deadline = time.monotonic() + self.b.timeout
                continue
            if reply.unauthenticated:
                name = next((n for n, p in self.peers.items() if p is peer), "?")
                self._fail_peer(name, peer, reply.error or "refused")
                self._drop_socket(peer)  # the next write authenticates anew
                return
            xfer = self.active.get(reply.xfer)
            if xfer is None or self.peers.get(xfer.peer) is not peer:
                continue  # a transfer that already ended
            peer.deadline = time.monotonic() + self.b.timeout
            if reply.error is not None:
                self._end(
                    xfer, peer, TransferState.FAILED, f"write to {xfer.peer!r}: {reply.error}"
                )
                continue
            xfer.inflight -= 1
            xfer.acked += reply.nbytes
            xfer.deadline = peer.deadline
            if xfer.acked >= xfer.total:
                self._end(xfer, peer, TransferState.DONE)

    def _end(
        self, xfer: _Xfer, peer: _Peer, state: TransferState, error: str | None = None
    ) -> None:
        self.active.pop(xfer.handle, None)
        self.held.pop(xfer.handle, None)
        with contextlib.suppress(ValueError):
            peer.xfers.remove(xfer)
        self.b._finish(xfer, state, error)

    def _fail_peer(self, name: str, peer: _Peer, why: str) -> None:
        for xfer in list(peer.xfers):
            self._end(xfer, peer, TransferState.FAILED, f"write to {name!r} failed: {why}")

    def _check_deadlines(self) -> None:
        now = time.monotonic()
        for name, peer in self.peers.items():
            for xfer in [x for x in peer.xfers if x.inflight and now > x.deadline]:
                self._end(
                    xfer,
                    peer,
                    TransferState.FAILED,
                    f"write to {name!r} failed: no progress of this transfer for "
                    f"{self.b.timeout:g}s (a message lost on the way)",
                )
            if peer.xfers and now > peer.deadline:
                self._fail_peer(
                    name,
                    peer,
                    f"no progress from {peer.meta.endpoint} for {self.b.timeout:g}s "
                    "(peer dead or unreachable)",
                )
                # Drop whatever is still queued so it cannot land later.
                self._drop_socket(peer)
