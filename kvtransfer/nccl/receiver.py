"""The receiving end of the nccl backend: one control thread that owns the
ROUTER socket writers connect to, and one thread per pair that joins the
pair's communicator and receives its writes in order.

Failure contract: a pair is aborted (its communicator ended, its memory
released) when its writer asks (``Unpair``), when the writer's connection
falls silent while its pairs are idle (it pings every
``PEER_HEARTBEAT_IVL_S``; silence for longer than the pair's timeout means it
exited, was paused or was cut off), when a write does not
complete within the pair's timeout, or when a write names ranges outside the
buffer. Nothing is written into the buffer by an aborted pair.
"""

from __future__ import annotations

import contextlib
import logging
import queue
import threading
import time
from typing import Any

import torch
import zmq

from kvtransfer.backend import ByteRange
from kvtransfer.endpoint import PEER_HEARTBEAT_IVL_S, PEER_HEARTBEAT_TIMEOUT_S
from kvtransfer.layout import check_ranges
from kvtransfer.nccl.channel import Channel, ChannelError, Span
from kvtransfer.nccl.frames import (
    Begin,
    Landed,
    Pair,
    Paired,
    Ping,
    Refused,
    Unpair,
    decode_from_writer,
    encode,
)
from kvtransfer.tcp.auth import _ReceiverAuth
from kvtransfer.tcp.frames import _Auth, _Hello

logger = logging.getLogger(__name__)

_Key = tuple[bytes, int]
"""A pair: the writer's connection (ZMQ routing id) and the writer's pair id."""


class RecvPair:
    """One writer's communicator and the writes it receives, in order."""

    def __init__(self, owner: Receiver, key: _Key, offer: Pair, channel_cls: type[Channel]) -> None:
        self.owner = owner
        self.key = key
        self.offer = offer
        self.channel_cls = channel_cls
        self.channel: Channel | None = None
        self.jobs: queue.SimpleQueue[Begin | None] = queue.SimpleQueue()
        self.dead = False
        self._busy = 1
        self._busy_lock = threading.Lock()
        self.thread = threading.Thread(
            target=self._main, name=f"kvnccl-recv-{offer.pair}", daemon=True
        )
        self.thread.start()

    @property
    def busy(self) -> bool:
        """A join or a write has not ended (the pair waits on its writer)."""
        return self._busy > 0

    def add_busy(self, n: int) -> None:
        with self._busy_lock:
            self._busy += n

    def abort(self) -> None:
        """End the pair (from any thread)."""
        self.dead = True
        if self.channel is not None:
            self.channel.abort()
        self.jobs.put(None)

    def _reply(self, msg: Any) -> None:
        self.owner.reply(self.key[0], msg)

    def _main(self) -> None:
        owner, offer = self.owner, self.offer
        try:
            self.channel = self.channel_cls.join(
                offer.rendezvous, 1, owner.buf, owner.host, offer.timeout_s, None
            )
        except ChannelError as e:
            self.dead = True
            self._reply(Refused(offer.pair, f"could not join the communicator: {e}"))
            return
        if self.dead:  # aborted while joining
            self.channel.abort()
            return
        owner.heard(self.key[0])  # the join's time counts as contact
        self.add_busy(-1)
        while (begin := self.jobs.get()) is not None:
            spans = [Span(o, n) for o, n in begin.ranges]
            try:
                op = self.channel.post((), spans, peer=0)
                self.channel.wait(op, time.monotonic() + offer.timeout_s)
            except ChannelError as e:
                self.dead = True
                self.channel.abort()
                logger.warning("%s: pair %d failed: %s", owner.agent_name, offer.pair, e)
                self._reply(Refused(offer.pair, f"write {begin.seq} was not received: {e}"))
                return
            self.add_busy(-1)
            owner.heard(self.key[0])  # the write's time counts as contact
            self._reply(Landed(offer.pair, begin.seq))


class Receiver:
    """The control socket and the pairs of one receiving agent."""

    def __init__(
        self,
        agent_name: str,
        host: str,
        advertise_host: str,
        cluster_token: str | None,
        buf: torch.Tensor,
        token: str,
        channel_cls: type[Channel],
    ) -> None:
        self.agent_name = agent_name
        self.host = advertise_host
        self.buf = buf
        self.token = token
        self.channel_cls = channel_cls
        self.auth = _ReceiverAuth(agent_name, cluster_token)
        self.pairs: dict[_Key, RecvPair] = {}
        self._heard: dict[bytes, float] = {}
        """Writer connection -> when it last sent anything."""
        self._ctx = zmq.Context()
        self._router = self._ctx.socket(zmq.ROUTER)
        self._router.setsockopt(zmq.LINGER, 0)
        self._router.setsockopt(zmq.HEARTBEAT_IVL, int(PEER_HEARTBEAT_IVL_S * 1000))
        self._router.setsockopt(zmq.HEARTBEAT_TIMEOUT, int(PEER_HEARTBEAT_TIMEOUT_S * 1000))
        port = self._router.bind_to_random_port(f"tcp://{host}")
        shown = f"[{advertise_host}]" if ":" in advertise_host else advertise_host
        self.endpoint = f"tcp://{shown}:{port}"
        self._outbox: queue.SimpleQueue[tuple[bytes, bytes]] = queue.SimpleQueue()
        wake = f"inproc://kvnccl-wake-{id(self):x}"
        self._wake_rx = self._ctx.socket(zmq.PAIR)
        self._wake_rx.bind(wake)
        self._wake_tx = self._ctx.socket(zmq.PAIR)
        self._wake_tx.setsockopt(zmq.LINGER, 0)
        self._wake_tx.connect(wake)
        self._wake_lock = threading.Lock()
        self._stop = False
        self._thread = threading.Thread(target=self._main, name=f"kvnccl-{agent_name}", daemon=True)
        self._thread.start()

    def heard(self, ident: bytes) -> None:
        """Connection ``ident`` counts as alive now."""
        self._heard[ident] = time.monotonic()

    def reply(self, ident: bytes, msg: Any) -> None:
        """Send ``msg`` to connection ``ident`` (from any thread)."""
        self._outbox.put((ident, encode(msg)))
        with self._wake_lock, contextlib.suppress(zmq.Again):
            self._wake_tx.send(b"", zmq.NOBLOCK)

    def close(self) -> None:
        self._stop = True
        self.reply(b"", b"")
        self._thread.join(timeout=5.0)
        for pair in list(self.pairs.values()):
            pair.abort()
        for pair in list(self.pairs.values()):
            pair.thread.join(timeout=5.0)
        self.pairs.clear()
        self._wake_tx.close(0)
        if not self._thread.is_alive():
            self._ctx.term()

    # ------------------------------------------------------- the control thread

    def _main(self) -> None:
        poller = zmq.Poller()
        poller.register(self._router, zmq.POLLIN)
        poller.register(self._wake_rx, zmq.POLLIN)
        try:
            while not self._stop:
                ready = dict(poller.poll(int(PEER_HEARTBEAT_IVL_S * 1000)))
                if self._wake_rx in ready:
                    while self._wake_rx.poll(0):
                        self._wake_rx.recv()
                self._flush()
                if self._router in ready:
                    self._read()
                self._reap()
        except Exception:
            logger.exception("%s: nccl control thread crashed", self.agent_name)
        finally:
            self._router.close(0)
            self._wake_rx.close(0)

    def _flush(self) -> None:
        while True:
            try:
                ident, payload = self._outbox.get_nowait()
            except queue.Empty:
                return
            if ident:
                with contextlib.suppress(zmq.ZMQError):
                    self._router.send_multipart([ident, payload], zmq.NOBLOCK)

    def _read(self) -> None:
        while True:
            try:
                frames = self._router.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                return
            if len(frames) != 2:
                continue
            ident, payload = frames
            self._heard[ident] = time.monotonic()
            try:
                msg = decode_from_writer(payload)
            except Exception as e:  # noqa: BLE001 (a malformed frame is dropped)
                logger.warning("%s: dropping a malformed control frame: %s", self.agent_name, e)
                continue
            self._handle(ident, msg)

    def _handle(self, ident: bytes, msg: Any) -> None:
        if isinstance(msg, Ping):
            return
        if isinstance(msg, _Hello | _Auth):
            self._router.send_multipart([ident, encode(self.auth.answer(ident, msg))])
            return
        if not self.auth.admits(ident):
            self.reply(ident, Refused(getattr(msg, "pair", -1), "not authenticated"))
            return
        key = (ident, msg.pair)
        if isinstance(msg, Pair):
            if msg.token != self.token:
                self.reply(ident, Refused(msg.pair, "stale metadata: the receiver re-registered"))
                return
            old = self.pairs.pop(key, None)
            if old is not None:
                old.abort()
            self.reply(ident, Paired(msg.pair))
            self.pairs[key] = RecvPair(self, key, msg, self.channel_cls)
            return
        pair = self.pairs.get(key)
        if isinstance(msg, Unpair):
            if pair is not None:
                del self.pairs[key]
                pair.abort()
            return
        assert isinstance(msg, Begin)
        if pair is None or pair.dead:
            self.reply(ident, Refused(msg.pair, "no such pair"))
            return
        nbytes = self.buf.numel()
        error = check_ranges([ByteRange(o, o, n) for o, n in msg.ranges], nbytes, nbytes)
        if error is not None:
            # The writer is sending already: the pair cannot go on.
            del self.pairs[key]
            pair.abort()
            self.reply(ident, Refused(msg.pair, f"write {msg.seq} refused: {error}"))
            return
        pair.add_busy(1)
        pair.jobs.put(msg)

    def _reap(self) -> None:
        """Abort the idle pairs of writers silent for longer than their
        timeout. Writers ping every ``PEER_HEARTBEAT_IVL_S``, but from a
        Python thread, which a busy process may hold back for seconds (the
        GIL): so silence is judged against the pair's timeout, not the
        heartbeat timeout."""
        now = time.monotonic()
        for ident, heard in list(self._heard.items()):
            keys = [k for k in self.pairs if k[0] == ident]
            limit = max([PEER_HEARTBEAT_TIMEOUT_S, *(self.pairs[k].offer.timeout_s for k in keys)])
            if now - heard <= limit:
                continue
            if any(self.pairs[k].busy and not self.pairs[k].dead for k in keys):
                continue  # a join or a write in progress has its own deadline
            del self._heard[ident]
            self._drop(ident, f"the writer was silent for over {limit:g}s")

    def _drop(self, ident: bytes, reason: str) -> None:
        for key in [k for k in self.pairs if k[0] == ident]:
            logger.info("%s: pair %d ended: %s", self.agent_name, key[1], reason)
            self.pairs.pop(key).abort()
