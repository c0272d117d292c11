"""The tcp ``TransferBackend``: the API a scheduler thread calls (register,
metadata, connect, write, poll, disconnect, close). It owns the zmq context,
the table of writes and their outcomes, and the I/O thread
(``kvtransfer.tcp.loop``) it hands every socket operation to. A caller must
leave the source pages of a write alone until ``poll`` reports DONE or FAILED
(see the package docstring).
"""

from __future__ import annotations

import contextlib
import itertools
import logging
import os
import queue
import threading
import time
from collections.abc import Sequence

import msgspec
import torch
import zmq

from kvtransfer.backend import ByteRange, TransferBackend, TransferError, TransferState
from kvtransfer.faults import FaultHook
from kvtransfer.layout import check_ranges
from kvtransfer.tcp.buffer import _ByteBuffer
from kvtransfer.tcp.frames import TcpMetadata, _decode_meta, _encode
from kvtransfer.tcp.loop import _IoLoop
from kvtransfer.tcp.transfer import _split, _Xfer

logger = logging.getLogger(__name__)

DEFAULT_CHUNK_BYTES = 4 << 20
DEFAULT_WINDOW = 8
DEFAULT_TIMEOUT_S = 10.0


class TcpBackend(TransferBackend):
    """KV transfer over TCP with pyzmq; see the ``kvtransfer.tcp`` package
    docstring for the protocol.

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
            _split(ranges, self.chunk_bytes),
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
