"""``NcclBackend``: the ``TransferBackend`` API over pairs (``writer``) and
the receiving control thread (``receiver``)."""

from __future__ import annotations

import itertools
import logging
import os
import time
from collections.abc import Sequence

import msgspec
import torch
import zmq

from kvtransfer.backend import ByteRange, TransferBackend, TransferError, TransferState
from kvtransfer.faults import FaultHook
from kvtransfer.layout import buffer_nbytes, check_ranges
from kvtransfer.nccl.channel import channel_class
from kvtransfer.nccl.frames import NcclMetadata, decode_meta, encode
from kvtransfer.nccl.receiver import Receiver
from kvtransfer.nccl.writer import SendPair, WriterContext, Xfer

logger = logging.getLogger(__name__)

DEFAULT_TIMEOUT_S = 10.0
_WILDCARD_HOSTS = ("0.0.0.0", "::", "")


class NcclBackend(TransferBackend):
    """KV transfer over two-rank communicators: NCCL between CUDA buffers, its
    gloo twin between CPU buffers (see the ``kvtransfer.nccl`` docstring).

    Args:
        agent_name: this agent's name (peers ``connect`` to it under this name).
        host: address the control socket and the communicators bind to.
        advertise_host: address peers reach this agent at (default: ``host``,
            or 127.0.0.1 when ``host`` is a wildcard).
        timeout: seconds a write (and a pair's creation) may take before it
            fails and its communicator is aborted.
        cluster_token: writers must prove they hold it before they may pair.
    """

    name = "nccl"

    def __init__(
        self,
        agent_name: str,
        host: str = "127.0.0.1",
        advertise_host: str | None = None,
        timeout: float = DEFAULT_TIMEOUT_S,
        cluster_token: str | None = None,
    ) -> None:
        super().__init__(agent_name)
        if timeout <= 0:
            raise ValueError("timeout must be > 0")
        self.host = host
        self.advertise_host = advertise_host or ("127.0.0.1" if host in _WILDCARD_HOSTS else host)
        self.timeout = float(timeout)
        self.cluster_token = cluster_token or None
        self.last_error: str | None = None
        """Why the most recent FAILED write failed."""
        self._writer_id = f"{agent_name}/{os.getpid()}/{os.urandom(4).hex()}"
        self._ctx = zmq.Context()
        self._faults = FaultHook.from_env()
        self._buf: torch.Tensor | None = None
        self._meta: NcclMetadata | None = None
        self._receiver: Receiver | None = None
        self._peers: dict[str, tuple[bytes, NcclMetadata]] = {}
        self._pairs: dict[str, SendPair] = {}
        self._pair_ids = itertools.count(1)
        self._handles = itertools.count(1)
        self._xfers: dict[int, Xfer] = {}
        self._closed = False

    # ------------------------------------------------------------ public API

    def register(self, buffer: torch.Tensor) -> None:
        self._check_open()
        if not buffer.is_contiguous():
            raise TransferError("the registered buffer must be contiguous")
        if buffer.device.type not in ("cpu", "cuda"):
            raise TransferError(f"the nccl backend cannot register {buffer.device} memory")
        buf = buffer.view(torch.uint8).reshape(-1)
        assert buf.numel() == buffer_nbytes(buffer)
        if self._receiver is not None:
            self._receiver.close()
        for pair in self._pairs.values():
            pair.close("the buffer was re-registered")
        self._pairs.clear()
        self._buf = buf
        token = os.urandom(8).hex()
        self._receiver = Receiver(
            self.agent_name,
            self.host,
            self.advertise_host,
            self.cluster_token,
            buf,
            token,
            channel_class(buf),
        )
        self._meta = NcclMetadata(
            agent=self.agent_name,
            endpoint=self._receiver.endpoint,
            token=token,
            nbytes=buf.numel(),
            device=buf.device.type,
        )

    def metadata(self) -> bytes:
        if self._meta is None:
            raise TransferError("register() a buffer before publishing metadata")
        return encode(self._meta)

    def connect(self, peer: str, metadata: bytes) -> None:
        self._check_open()
        metadata = bytes(metadata)
        known = self._peers.get(peer)
        if known is not None and known[0] == metadata:
            return
        try:
            meta = decode_meta(metadata)
        except msgspec.DecodeError as e:
            raise TransferError(f"bad nccl metadata for peer {peer!r}: {e}") from None
        if meta.agent != peer:
            raise TransferError(f"metadata is for agent {meta.agent!r}, not {peer!r}")
        if self._buf is not None and meta.device != self._buf.device.type:
            raise TransferError(
                f"peer {peer!r} registered {meta.device} memory and this agent "
                f"{self._buf.device.type} memory: both ends of an nccl pair must be on "
                "the same kind of device"
            )
        self._drop_pair(peer, "the peer re-registered")  # a restart is a new pair
        self._peers[peer] = (metadata, meta)

    def write(self, peer: str, ranges: Sequence[ByteRange]) -> int:
        self._check_open()
        if self._buf is None or self._meta is None:
            raise TransferError("register() a buffer before writing")
        known = self._peers.get(peer)
        if known is None:
            raise TransferError(f"unknown peer {peer!r}: connect() it first")
        ranges = [ByteRange(*map(int, r)) for r in ranges if r[2] != 0]
        handle = next(self._handles)
        xfer = Xfer(handle, peer, ranges)
        self._xfers[handle] = xfer
        error = check_ranges(ranges, self._buf.numel(), known[1].nbytes)
        if error is not None:
            xfer.end(TransferState.FAILED, f"write to {peer!r} refused: {error}")
        elif not ranges:
            xfer.end(TransferState.DONE)
        else:
            self._pair(peer, known[1]).submit(xfer)
        return handle

    def poll(self, handle: int) -> TransferState:
        xfer = self._xfers.get(handle)
        if xfer is None:
            raise TransferError(f"unknown transfer handle {handle}")
        state = xfer.state
        if state is TransferState.PENDING:
            pair = self._pairs.get(xfer.peer)
            if pair is not None and not pair.thread.is_alive():
                xfer.end(TransferState.FAILED, f"write to {xfer.peer!r} failed: {pair.dead}")
                state = xfer.state
            else:
                # Let the pair's thread take the GIL (a caller spinning on
                # poll would otherwise delay it by a switch interval).
                time.sleep(0)
                return state
        del self._xfers[handle]
        if state is TransferState.FAILED:
            self.last_error = xfer.error
            logger.warning("%s: %s", self.agent_name, xfer.error)
        return state

    def disconnect(self, peer: str) -> None:
        if self._closed:
            return
        self._peers.pop(peer, None)
        self._drop_pair(peer, f"peer {peer!r} was disconnected")

    def prune(self) -> list[str]:
        """Forget pairs that ended (their communicators are already aborted)."""
        gone = [peer for peer, pair in self._pairs.items() if not pair.thread.is_alive()]
        for peer in gone:
            del self._pairs[peer]
        return []

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        pairs = list(self._pairs.values())
        for pair in pairs:
            pair.close("backend closed")
        for pair in pairs:
            pair.thread.join(timeout=5.0)
        self._pairs.clear()
        for xfer in self._xfers.values():
            xfer.end(TransferState.FAILED, "backend closed")
        if self._receiver is not None:
            self._receiver.close()
        self._ctx.term()

    # ------------------------------------------------------------- internals

    def _check_open(self) -> None:
        if self._closed:
            raise TransferError("backend is closed")

    def _pair(self, peer: str, meta: NcclMetadata) -> SendPair:
        """The live pair to ``peer``; a new one (lazily, on first use or after
        the last one ended) with its own communicator."""
        pair = self._pairs.get(peer)
        if pair is not None and pair.dead is None:
            return pair
        assert self._buf is not None
        context = WriterContext(
            agent_name=self.agent_name,
            writer_id=self._writer_id,
            ctx=self._ctx,
            buf=self._buf,
            channel_cls=channel_class(self._buf),
            host=self.advertise_host,
            cluster_token=self.cluster_token,
            timeout_s=self.timeout,
            faults=self._faults,
        )
        pair = SendPair(context, peer, meta, next(self._pair_ids))
        self._pairs[peer] = pair
        return pair

    def _drop_pair(self, peer: str, reason: str) -> None:
        pair = self._pairs.pop(peer, None)
        if pair is not None:
            pair.close(reason)
