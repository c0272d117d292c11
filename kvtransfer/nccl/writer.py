"""The writing end of one pair: a thread that opens the control connection,
authenticates, builds the communicator with the receiver and then runs the
pair's writes one after the other.

Failure contract: any failure (no answer to the handshake, a refused pair, a
write not landed by its deadline, the control connection dropping) aborts the
communicator, tells the receiver (``Unpair``) where it can still be reached,
and fails the write in progress and every write queued behind it. The pair is
then dead; the backend builds a new one on the next write.
"""

from __future__ import annotations

import contextlib
import logging
import queue
import threading
import time
from dataclasses import dataclass, field
from typing import Any

import torch
import zmq
from zmq.utils.monitor import recv_monitor_message

from kvtransfer.backend import ByteRange, TransferState
from kvtransfer.endpoint import PEER_HEARTBEAT_IVL_S, PEER_HEARTBEAT_TIMEOUT_S
from kvtransfer.faults import FaultHook
from kvtransfer.nccl.channel import Channel, ChannelError, Span
from kvtransfer.nccl.frames import (
    Begin,
    Landed,
    NcclMetadata,
    Pair,
    Paired,
    Ping,
    Refused,
    Unpair,
    decode_from_receiver,
    encode,
)
from kvtransfer.tcp.auth import _answer_challenge
from kvtransfer.tcp.frames import _Challenge, _Hello, _Reply, _Welcome

logger = logging.getLogger(__name__)

_IDLE_CHECK_S = 0.2
"""How often an idle pair looks at its control connection."""


class PairError(RuntimeError):
    """The pair cannot go on; the message says why."""


@dataclass(eq=False)
class Xfer:
    """One write, shared by the backend (``poll``) and the pair's thread."""

    handle: int
    peer: str
    ranges: list[ByteRange]
    state: TransferState = TransferState.PENDING
    error: str | None = None
    started: float = field(default_factory=time.monotonic)

    def end(self, state: TransferState, error: str | None = None) -> None:
        if self.state is TransferState.PENDING:
            self.error = error
            self.state = state


@dataclass(frozen=True)
class WriterContext:
    """What every pair of one backend shares."""

    agent_name: str
    writer_id: str
    ctx: zmq.Context
    buf: torch.Tensor
    channel_cls: type[Channel]
    host: str
    cluster_token: str | None
    timeout_s: float
    faults: FaultHook | None


class SendPair:
    """The pair from this agent to one receiver (``peer`` at ``meta``)."""

    def __init__(self, wc: WriterContext, peer: str, meta: NcclMetadata, pair_id: int) -> None:
        self.wc = wc
        self.peer = peer
        self.meta = meta
        self.pair_id = pair_id
        self.jobs: queue.SimpleQueue[Xfer | None] = queue.SimpleQueue()
        self.dead: str | None = None
        """Why the pair ended (None while it lives)."""
        self.channel: Channel | None = None
        self._sock: zmq.Socket | None = None
        self._monitor: zmq.Socket | None = None
        self._seq = 0
        self._sent = 0.0
        self.thread = threading.Thread(
            target=self._main, name=f"kvnccl-send-{peer}-{pair_id}", daemon=True
        )
        self.thread.start()

    def submit(self, xfer: Xfer) -> None:
        if self.dead is not None:
            xfer.end(TransferState.FAILED, f"write to {self.peer!r} failed: {self.dead}")
        else:
            self.jobs.put(xfer)

    def close(self, reason: str) -> None:
        """End the pair (from the backend's thread); queued writes fail."""
        if self.dead is None:
            self.dead = reason
        if self.channel is not None:
            self.channel.abort()  # wakes a write waiting on it
        self.jobs.put(None)

    # ---------------------------------------------------------------- thread

    def _main(self) -> None:
        xfer: Xfer | None = None
        try:
            self._open()
            while self.dead is None:
                try:
                    xfer = self.jobs.get(timeout=_IDLE_CHECK_S)
                except queue.Empty:
                    self._check_link()
                    self._ping()
                    continue
                if xfer is None:
                    break
                self._write(xfer)
                xfer = None
        except (PairError, ChannelError) as e:
            self.dead = self.dead or str(e)
        except Exception as e:  # noqa: BLE001 (a crash must still fail the writes)
            logger.exception("%s: pair to %s crashed", self.wc.agent_name, self.peer)
            self.dead = self.dead or f"the pair's thread crashed: {e}"
        finally:
            self._end(xfer)

    def _end(self, current: Xfer | None) -> None:
        reason = self.dead or "the pair was closed"
        self.dead = reason
        if self.channel is not None:
            self.channel.abort()
        if self._sock is not None:
            with contextlib.suppress(zmq.ZMQError):
                self._sock.send(encode(Unpair(self.pair_id, reason)), zmq.NOBLOCK)
            self._sock.disable_monitor()
            assert self._monitor is not None
            self._monitor.close(0)
            self._sock.close(0)
        failed = f"write to {self.peer!r} failed: {reason}"
        if current is not None:
            current.end(TransferState.FAILED, failed)
        while True:
            try:
                xfer = self.jobs.get_nowait()
            except queue.Empty:
                break
            if xfer is not None:
                xfer.end(TransferState.FAILED, failed)
        if reason != "the pair was closed":
            logger.warning("%s: pair to %s ended: %s", self.wc.agent_name, self.peer, reason)

    def _open(self) -> None:
        wc = self.wc
        deadline = time.monotonic() + wc.timeout_s
        sock = wc.ctx.socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.HEARTBEAT_IVL, int(PEER_HEARTBEAT_IVL_S * 1000))
        sock.setsockopt(zmq.HEARTBEAT_TIMEOUT, int(PEER_HEARTBEAT_TIMEOUT_S * 1000))
        self._monitor = sock.get_monitor_socket(zmq.EVENT_DISCONNECTED)
        sock.connect(self.meta.endpoint)
        self._sock = sock
        self._send(_Hello(wc.writer_id))
        reply = self._recv(deadline, "the handshake")
        if isinstance(reply, _Challenge):
            self._send(_answer_challenge(wc.cluster_token, reply, wc.writer_id))
            reply = self._recv(deadline, "the handshake")
        if not isinstance(reply, _Welcome):
            why = reply.error if isinstance(reply, _Reply) else type(reply).__name__
            raise PairError(f"the receiver refused the handshake: {why}")
        rendezvous, kept = wc.channel_cls.offer(wc.host)
        self._send(Pair(self.pair_id, self.meta.token, rendezvous, wc.timeout_s))
        reply = self._recv(deadline, "the pairing")
        if not isinstance(reply, Paired):
            raise PairError(self._why(reply))
        channel = wc.channel_cls.join(rendezvous, 0, wc.buf, wc.host, wc.timeout_s, kept)
        self.channel = channel
        if self.dead is not None:  # closed while joining
            raise PairError(self.dead)
        self._send(Ping())  # joined: from now on silence means this end is gone

    def _write(self, xfer: Xfer) -> None:
        wc = self.wc
        deadline = time.monotonic() + wc.timeout_s
        self._seq += 1
        seq = self._seq
        assert self._sock is not None and self.channel is not None
        self._send(Begin(self.pair_id, seq, [(r.dst_offset, r.nbytes) for r in xfer.ranges]))
        fault = wc.faults.next_message() if wc.faults is not None else None
        if fault is not None and fault.delay_s:
            time.sleep(min(fault.delay_s, max(0.0, deadline - time.monotonic())))
        if fault is None or not fault.drop:
            op = self.channel.post([Span(r.src_offset, r.nbytes) for r in xfer.ranges], (), peer=1)
            self.channel.wait(op, deadline)
        reply = self._recv(deadline, f"write {seq} to land")
        if not isinstance(reply, Landed) or reply.seq != seq:
            raise PairError(self._why(reply))
        xfer.end(TransferState.DONE)

    @staticmethod
    def _why(reply: Any) -> str:
        if isinstance(reply, Refused):
            return f"the receiver refused: {reply.reason}"
        return f"unexpected {type(reply).__name__} from the receiver"

    def _recv(self, deadline: float, what: str) -> Any:
        """The receiver's next message; ``PairError`` at ``deadline``, when
        the connection drops or the pair is closed."""
        assert self._sock is not None
        while True:
            if self.dead is not None:
                raise PairError(self.dead)
            left = deadline - time.monotonic()
            if left <= 0:
                raise PairError(f"timed out after {self.wc.timeout_s:g}s waiting for {what}")
            if self._sock.poll(min(left, _IDLE_CHECK_S) * 1000):
                try:
                    return decode_from_receiver(self._sock.recv())
                except Exception as e:  # noqa: BLE001
                    raise PairError(f"malformed message from the receiver: {e}") from None
            self._check_link()
            self._ping()

    def _send(self, msg: Any) -> None:
        assert self._sock is not None
        self._sock.send(encode(msg))
        self._sent = time.monotonic()

    def _ping(self) -> None:
        """Tell the receiver this idle pair is alive."""
        if time.monotonic() - self._sent >= PEER_HEARTBEAT_IVL_S:
            self._send(Ping())

    def _check_link(self) -> None:
        assert self._monitor is not None
        while True:
            try:
                event = recv_monitor_message(self._monitor, zmq.NOBLOCK)
            except zmq.Again:
                return
            if event["event"] == zmq.EVENT_DISCONNECTED:
                raise PairError("the control connection to the receiver dropped")
