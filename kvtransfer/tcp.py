"""Pure-ZeroMQ transfer backend: KV bytes travel over TCP.

Wire protocol (msgpack headers, one ZMQ DEALER per peer on the writer side, one
ROUTER on the receiver side; both served by one background I/O thread):

* ``Begin(writer, xfer, token, ranges)`` announces every ``(dst_offset, nbytes)``
  of a transfer. The receiver checks the token (its incarnation, from its
  metadata) and every range against its buffer size *before* writing anything;
  a rejected transfer gets an error reply and none of its bytes are written.
* ``Data(writer, xfer, token, pieces)`` + payload frames: a chunk of at most
  ``chunk_bytes`` bytes made of ``(dst_offset, nbytes)`` pieces whose bytes
  follow, in order, in the payload frames (a piece never straddles two frames;
  big pieces travel zero-copy in a frame of their own, small ones are gathered
  into one). Large ranges are split over several chunks and small ones
  (scattered pages) share one. The receiver checks every piece, copies them
  into its buffer and replies ``Reply(xfer, nbytes)``.
* A write is DONE once every chunk has been acknowledged, i.e. every byte is in
  the peer buffer. At most ``window`` chunks per peer are unacknowledged, which
  bounds memory on both sides. A peer that makes no progress for ``timeout``
  seconds fails its transfers, and its socket is dropped (with whatever it still
  queued) so no stale bytes land later. A transfer with a chunk unacknowledged
  for ``timeout`` seconds fails on its own (a lost message), even while the
  peer acknowledges other transfers.

Test hook: ``kvtransfer.faults`` can drop or delay data messages (only when
its environment variable is set, by the fault matrix).

With a cluster token, every connection must first prove it holds the token
before the receiver takes a transfer message from it: the writer sends
``Hello(writer)``, the receiver answers ``Challenge(nonce)`` (fresh per
connection), the writer answers ``Auth(HMAC(token, nonce, writer))`` and gets
``Welcome``. Transfer messages of a connection that did not pass (a rogue
writer, even one that learnt the receiver's metadata) are refused unwritten.
The receiver tells connections apart by their ZMQ routing ids, which it
assigns itself per connection, so a reconnect must authenticate again.

Source bytes are read from the registered buffer by the I/O thread while the
transfer runs (zero-copy for CPU buffers): as with RDMA, the caller must leave
the source pages alone until ``poll`` reports DONE or FAILED.
"""

from __future__ import annotations

import contextlib
import itertools
import logging
import os
import queue
import threading
import time
from collections import OrderedDict, deque
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import msgspec
import numpy as np
import torch
import zmq

from kvtransfer.backend import ByteRange, TransferBackend, TransferError, TransferState
from kvtransfer.compat import sign, verify
from kvtransfer.faults import FaultHook
from kvtransfer.layout import buffer_nbytes, check_ranges

logger = logging.getLogger(__name__)

DEFAULT_CHUNK_BYTES = 4 << 20
DEFAULT_WINDOW = 8
DEFAULT_TIMEOUT_S = 10.0
_MAX_REMEMBERED_XFERS = 4096
_MAX_PIECES = 4096  # pieces in one message
_ZERO_COPY_MIN = 1 << 20  # smaller pieces are gathered into one frame (fewer frames)


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


_AUTH_LABEL = "kvtcp-auth-v1"
_encode = msgspec.msgpack.Encoder().encode
_decode_meta = msgspec.msgpack.Decoder(TcpMetadata).decode
_decode_msg = msgspec.msgpack.Decoder(_Begin | _Data | _Hello | _Auth).decode
_decode_reply = msgspec.msgpack.Decoder(_Reply | _Challenge | _Welcome).decode


class _ByteBuffer:
    """A registered tensor seen as flat bytes (numpy view when on CPU)."""

    def __init__(self, buffer: torch.Tensor) -> None:
        if not buffer.is_contiguous():
            raise TransferError("the registered buffer must be contiguous")
        self.tensor = buffer
        self.nbytes = buffer_nbytes(buffer)
        self.u8 = buffer.reshape(-1).view(torch.uint8)
        self.np = self.u8.numpy() if buffer.device.type == "cpu" else None

    def frames(self, pieces: list[tuple[int, int, int]]) -> list[Any]:
        """Payload frames carrying the ``(src, dst, nbytes)`` pieces' bytes in order."""
        if self.np is None:  # device memory: gather on the device, one copy to host
            parts = [self.u8[s : s + n] for s, _, n in pieces]
            data = parts[0] if len(parts) == 1 else torch.cat(parts)
            return [data.cpu().numpy()]
        out: list[Any] = []
        small: list[memoryview] = []
        for s, _, n in pieces:
            view = memoryview(self.np[s : s + n])
            if n >= _ZERO_COPY_MIN:
                if small:
                    out.append(b"".join(small))
                    small = []
                out.append(view)  # zero-copy: zmq reads the registered buffer
            else:
                small.append(view)  # zmq would copy these anyway: gather them
        if small:
            out.append(b"".join(small))
        return out

    def scatter(self, places: list[tuple[int, int, int, int]], frames: list[memoryview]) -> None:
        """Write ``(dst, nbytes, frame, frame_offset)`` pieces (already checked)."""
        if self.np is not None:
            arrays = [np.frombuffer(f, dtype=np.uint8) for f in frames]
            for dst, n, fi, pos in places:
                self.np[dst : dst + n] = arrays[fi][pos : pos + n]
            return
        staged = []
        for f in frames:  # one host-to-device copy per frame
            host = torch.empty(len(f), dtype=torch.uint8)
            host.numpy()[:] = np.frombuffer(f, dtype=np.uint8)
            staged.append(host.to(self.u8.device))
        for dst, n, fi, pos in places:
            self.u8[dst : dst + n].copy_(staged[fi][pos : pos + n])


@dataclass(eq=False)
class _Xfer:
    handle: int
    peer: str
    src: _ByteBuffer
    ranges: list[tuple[int, int]]  # (dst_offset, nbytes), announced by Begin
    chunks: list[list[tuple[int, int, int]]]  # one message: [(src, dst, nbytes), ...]
    total: int
    state: TransferState = TransferState.PENDING
    error: str | None = None
    begun: bool = False
    next_chunk: int = 0
    inflight: int = 0
    acked: int = 0
    deadline: float = 0.0
    """While chunks of it are unacknowledged: when it fails for lack of
    progress (a lost message), even while the peer acknowledges others."""


@dataclass(eq=False)
class _Peer:
    """Writer-side state of one peer; owned by the I/O thread."""

    meta: TcpMetadata
    sock: zmq.Socket | None = None
    xfers: deque[_Xfer] = field(default_factory=deque)
    deadline: float = 0.0
    authed: bool = False
    """The connection passed the cluster-token handshake (or none is needed)."""


class TcpBackend(TransferBackend):
    """KV transfer over TCP with pyzmq; see the module docstring for the protocol.

    Args:
        agent_name: this agent's name (peers ``connect`` to it under this name).
        host: address the receiving ROUTER binds to (a free port is picked).
        advertise_host: address put in ``metadata()`` (default: ``host``).
        timeout: seconds without progress after which a write is FAILED.
        chunk_bytes: largest payload of one message.
        window: unacknowledged chunks allowed per peer.
    """

    name = "tcp"

    def __init__(
        self,
        agent_name: str,
        host: str = "127.0.0.1",
        advertise_host: str | None = None,
        timeout: float = DEFAULT_TIMEOUT_S,
        chunk_bytes: int = DEFAULT_CHUNK_BYTES,
        window: int = DEFAULT_WINDOW,
        cluster_token: str | None = None,
    ) -> None:
        super().__init__(agent_name)
        self.cluster_token = cluster_token or None
        """Connections must prove they hold it (None: no handshake, open)."""
        if chunk_bytes <= 0 or window <= 0 or timeout <= 0:
            raise ValueError("chunk_bytes, window and timeout must be > 0")
        self.host = host
        self.advertise_host = advertise_host or host
        self.timeout = float(timeout)
        self.chunk_bytes = int(chunk_bytes)
        self.window = int(window)
        self.last_error: str | None = None
        """Why the most recent FAILED write failed."""

        self._writer_id = f"{agent_name}/{os.getpid()}/{os.urandom(4).hex()}"
        self._ctx = zmq.Context()
        self._lock = threading.Lock()
        self._cmds: queue.SimpleQueue[tuple] = queue.SimpleQueue()
        self._handles = itertools.count(1)
        self._xfers: dict[int, _Xfer] = {}
        self._peer_meta: dict[str, tuple[bytes, TcpMetadata]] = {}
        self._local: _ByteBuffer | None = None
        self._meta: TcpMetadata | None = None
        self._router: zmq.Socket | None = None
        self._closed = False
        self._faults = FaultHook.from_env()
        """Test hook of the fault matrix (None unless its env var is set)."""

        wake_addr = f"inproc://kvtcp-wake-{id(self):x}"
        self._wake_rx = self._ctx.socket(zmq.PAIR)
        self._wake_rx.bind(wake_addr)
        self._wake_tx = self._ctx.socket(zmq.PAIR)
        self._wake_tx.setsockopt(zmq.LINGER, 0)
        self._wake_tx.connect(wake_addr)
        self._thread = threading.Thread(
            target=self._io_main, name=f"kvtcp-{agent_name}", daemon=True
        )
        self._thread.start()

    # ------------------------------------------------------------ public API

    def register(self, buffer: torch.Tensor) -> None:
        self._check_open()
        local = _ByteBuffer(buffer)
        if self._router is None:
            router = self._ctx.socket(zmq.ROUTER)
            router.setsockopt(zmq.LINGER, 0)
            router.bind(f"tcp://{self.host}:0")
            endpoint = router.getsockopt_string(zmq.LAST_ENDPOINT)
            port = endpoint.rsplit(":", 1)[1]
            host = self.advertise_host
            if ":" in host and not host.startswith("["):
                host = f"[{host}]"
            self._endpoint = f"tcp://{host}:{port}"
            self._router = router
            self._send_cmd(("router", router))  # the I/O thread owns it from here
        self._local = local
        self._meta = TcpMetadata(
            agent=self.agent_name,
            endpoint=self._endpoint,
            token=os.urandom(8).hex(),
            nbytes=local.nbytes,
        )
        self._send_cmd(("buffer", local, self._meta.token))

    def metadata(self) -> bytes:
        if self._meta is None:
            raise TransferError("register() a buffer before publishing metadata")
        return _encode(self._meta)

    def connect(self, peer: str, metadata: bytes) -> None:
        self._check_open()
        metadata = bytes(metadata)
        known = self._peer_meta.get(peer)
        if known is not None and known[0] == metadata:
            return
        try:
            meta = _decode_meta(metadata)
        except msgspec.DecodeError as e:
            raise TransferError(f"bad tcp metadata for peer {peer!r}: {e}") from None
        self._peer_meta[peer] = (metadata, meta)
        self._send_cmd(("connect", peer, meta))

    def write(self, peer: str, ranges: Sequence[ByteRange]) -> int:
        self._check_open()
        if self._local is None:
            raise TransferError("register() a buffer before writing")
        known = self._peer_meta.get(peer)
        if known is None:
            raise TransferError(f"unknown peer {peer!r}: connect() it first")
        ranges = [ByteRange(*map(int, r)) for r in ranges]
        ranges = [r for r in ranges if r.nbytes != 0]
        handle = next(self._handles)
        error = check_ranges(ranges, self._local.nbytes, known[1].nbytes)
        if error is not None:
            ranges = []
        xfer = _Xfer(
            handle,
            peer,
            self._local,
            [(r.dst_offset, r.nbytes) for r in ranges],
            self._split(ranges),
            sum(r.nbytes for r in ranges),
        )
        with self._lock:
            self._xfers[handle] = xfer
        if error is not None:
            self._finish(xfer, TransferState.FAILED, f"write to {peer!r} refused: {error}")
        elif xfer.total == 0:
            xfer.state = TransferState.DONE
        else:
            self._send_cmd(("write", xfer))
        return handle

    def poll(self, handle: int) -> TransferState:
        with self._lock:
            xfer = self._xfers.get(handle)
            if xfer is None:
                raise TransferError(f"unknown transfer handle {handle}")
            if xfer.state is TransferState.PENDING and not self._thread.is_alive():
                xfer.state = TransferState.FAILED  # it crashed (logged): nothing moves
                xfer.error = "the tcp transfer I/O thread is not running"
            state = xfer.state
            if state is not TransferState.PENDING:
                del self._xfers[handle]
                if state is TransferState.FAILED:
                    self.last_error = xfer.error
        if state is TransferState.PENDING:
            # Let the I/O thread take the GIL: a caller spinning on poll() would
            # otherwise delay every reply it handles by a GIL switch interval.
            time.sleep(0)
        return state

    def disconnect(self, peer: str) -> None:
        if self._closed:
            return
        self._peer_meta.pop(peer, None)
        self._send_cmd(("disconnect", peer))

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        self._send_cmd(("stop",))
        self._thread.join(timeout=5.0)
        with self._lock:
            for xfer in self._xfers.values():
                if xfer.state is TransferState.PENDING:
                    xfer.state = TransferState.FAILED
                    xfer.error = "backend closed"
        self._wake_tx.close(linger=0)
        if self._thread.is_alive():  # should not happen; never block on term()
            logger.error("tcp transfer I/O thread did not stop; leaking its context")
            return
        self._ctx.term()

    # ------------------------------------------------------------- internals

    def _check_open(self) -> None:
        if self._closed:
            raise TransferError("backend is closed")

    def _send_cmd(self, cmd: tuple) -> None:
        self._cmds.put(cmd)
        # zmq.Again: the I/O thread already has wake-ups pending.
        with self._lock, contextlib.suppress(zmq.Again):
            self._wake_tx.send(b"", zmq.NOBLOCK)

    def _split(self, ranges: list[ByteRange]) -> list[list[tuple[int, int, int]]]:
        """Pack ranges into messages of at most ``chunk_bytes`` payload bytes
        (and ``_MAX_PIECES`` pieces): big ranges span several, small ones share."""
        step = self.chunk_bytes
        chunks: list[list[tuple[int, int, int]]] = []
        cur: list[tuple[int, int, int]] = []
        room = step
        for r in ranges:
            off = 0
            while off < r.nbytes:
                n = min(room, r.nbytes - off)
                cur.append((r.src_offset + off, r.dst_offset + off, n))
                off += n
                room -= n
                if room == 0 or len(cur) == _MAX_PIECES:
                    chunks.append(cur)
                    cur, room = [], step
        if cur:
            chunks.append(cur)
        return chunks

    def _finish(self, xfer: _Xfer, state: TransferState, error: str | None = None) -> None:
        with self._lock:
            if xfer.state is not TransferState.PENDING:
                return
            xfer.error = error
            xfer.state = state
        if error:
            logger.warning("%s: %s", self.agent_name, error)

    # --------------------------------------------------------- the I/O thread

    def _io_main(self) -> None:
        io = _IoLoop(self)
        try:
            io.run()
        except Exception:
            logger.exception("tcp transfer I/O thread crashed")
            io.fail_all("I/O thread crashed")
        finally:
            io.shutdown()


class _IoLoop:
    """Everything the background thread owns: sockets, receiver and sender state."""

    def __init__(self, backend: TcpBackend) -> None:
        self.b = backend
        self.poller = zmq.Poller()
        self.poller.register(backend._wake_rx, zmq.POLLIN)
        self.router: zmq.Socket | None = None
        # receiver side
        self.rx: _ByteBuffer | None = None
        self.rx_token: str | None = None
        # (writer, xfer) -> bytes still expected, or -1 when the transfer was refused
        self.rx_xfers: OrderedDict[tuple[str, int], int] = OrderedDict()
        # connection (routing id) -> its challenge, until it authenticates
        self.rx_nonces: OrderedDict[bytes, tuple[str, str]] = OrderedDict()
        self.rx_authed: OrderedDict[bytes, None] = OrderedDict()
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
                _, self.rx, self.rx_token = cmd
                self.rx_xfers.clear()
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
                reply = self._authenticate(ident, msg)
            elif self.b.cluster_token is not None and ident not in self.rx_authed:
                logger.warning(
                    "%s: refused a transfer message from an unauthenticated connection",
                    self.b.agent_name,
                )
                reply = _Reply(msg.xfer, 0, "refused: the connection has not authenticated", True)
            else:
                reply = self._receive(msg, [f.buffer for f in frames[2:]])
            if reply is not None:
                self.router.send_multipart([ident, _encode(reply)], zmq.NOBLOCK)

    def _authenticate(self, ident: bytes, msg: _Hello | _Auth) -> _Challenge | _Welcome | _Reply:
        token = self.b.cluster_token
        if isinstance(msg, _Hello):
            if token is None:
                return _Welcome()
            nonce = os.urandom(16).hex()
            self.rx_nonces[ident] = (nonce, msg.writer)
            while len(self.rx_nonces) > _MAX_REMEMBERED_XFERS:
                self.rx_nonces.popitem(last=False)
            return _Challenge(nonce)
        pending = self.rx_nonces.pop(ident, None)
        if token is None or (pending is not None and verify(token, msg.mac, _AUTH_LABEL, *pending)):
            self.rx_authed[ident] = None
            while len(self.rx_authed) > _MAX_REMEMBERED_XFERS:
                self.rx_authed.popitem(last=False)
            return _Welcome()
        logger.warning("%s: a writer failed the cluster-token handshake", self.b.agent_name)
        return _Reply(-1, 0, "refused: cluster token mismatch", True)

    def _receive(self, msg: _Begin | _Data, payloads: list[memoryview]) -> _Reply | None:
        key = (msg.writer, msg.xfer)
        if self.rx is None or msg.token != self.rx_token:
            why = "no buffer registered" if self.rx is None else "stale metadata"
            return _Reply(msg.xfer, 0, f"receiver {self.b.agent_name!r} refused: {why}")
        size = self.rx.nbytes
        if isinstance(msg, _Begin):
            total = 0
            for off, n in msg.ranges:
                if off < 0 or n < 0 or off + n > size:
                    self._remember(key, -1)
                    return _Reply(
                        msg.xfer,
                        0,
                        f"receiver {self.b.agent_name!r} refused range [{off}, {off + n}) "
                        f"outside its {size}-byte buffer; nothing was written",
                    )
                total += n
            self._remember(key, total)
            return None
        remaining = self.rx_xfers.get(key)
        if remaining is None or remaining < 0:
            if remaining is None:
                return _Reply(msg.xfer, 0, "data for a transfer the receiver does not know")
            return None  # refused already; the writer was told
        # Check every piece (bounds, framing, announced size) before writing any.
        places = []
        n = fi = pos = 0
        for off, length in msg.pieces:
            if off < 0 or length < 0 or off + length > size:
                self.rx_xfers[key] = -1
                return _Reply(msg.xfer, 0, f"piece [{off}, {off + length}) out of bounds")
            while fi < len(payloads) and pos == len(payloads[fi]) and length:
                fi, pos = fi + 1, 0
            if length and (fi == len(payloads) or pos + length > len(payloads[fi])):
                self.rx_xfers[key] = -1
                return _Reply(msg.xfer, 0, "malformed data message (pieces do not match frames)")
            places.append((off, length, fi, pos))
            pos += length
            n += length
        if n != sum(len(p) for p in payloads) or n > remaining:
            self.rx_xfers[key] = -1
            return _Reply(msg.xfer, 0, "data does not match the announced transfer")
        self.rx.scatter(places, payloads)
        remaining -= n
        if remaining == 0:
            del self.rx_xfers[key]
        else:
            self.rx_xfers[key] = remaining
        return _Reply(msg.xfer, n)

    def _remember(self, key: tuple[str, int], value: int) -> None:
        self.rx_xfers[key] = value
        while len(self.rx_xfers) > _MAX_REMEMBERED_XFERS:
            self.rx_xfers.popitem(last=False)

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
                token = self.b.cluster_token or ""
                mac = sign(token, _AUTH_LABEL, reply.nonce, self.b._writer_id)
                peer.sock.send(_encode(_Auth(mac)), zmq.NOBLOCK)
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
