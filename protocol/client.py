"""Asyncio client of a worker's request plane (the gateway's side). Torch-free.

One DEALER socket carries any number of concurrent requests: a background
task reads ``Tokens`` frames and hands each ``TokenDelta`` to the queue of its
request id; a background sender writes outgoing messages in order.

Failure contract of ``generate``:

- ``WorkerUnreachable`` is raised, before anything is sent, when there is
  no connection to the worker and none comes up within ``connect_timeout_s``,
  or at once when an established connection dropped and has not come back
  (the request never reached a worker: safe to send elsewhere);
- request-level failures (bad prompt, invalid sampling, duplicate id in the
  worker, worker shutting down) arrive as a final delta with
  ``finish_reason`` ERROR and ``error`` set;
- ``WorkerTimeout`` is raised when no delta for the request arrives within
  ``timeout_s`` (the request is aborted on the worker);
- ``WorkerDisconnected`` is raised when the connection to the worker drops
  while the request is in flight (its deltas can no longer reach us);
- ``WorkerClientClosed`` is raised when the client is closed under it.

Leaving the iterator early (``break``, ``aclose()``, cancellation, the
timeout above, closing the client) sends ``Abort(rid)`` to the worker.

Liveness, both ways: libzmq exchanges ZMTP heartbeats on the connection, so a
worker that stops answering (killed, paused, cut off) drops the connection
within ``heartbeat_timeout_s`` even while requests wait for their next token;
and the client sends ``Heartbeat`` messages every ``heartbeat_interval_s``, by
which the worker tells that its requester is gone and aborts its requests.
A connection counts as up once the ZMTP handshake succeeded (with CURVE keys
from ``auth``: once both sides proved they hold the cluster token), not when
the TCP connection opens: a paused worker still accepts TCP connections.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections import deque
from collections.abc import AsyncIterator, Callable
from typing import Any

import msgspec
import zmq
import zmq.asyncio
from zmq.utils.monitor import parse_monitor_message

from protocol import to_gateway, to_worker
from protocol.aio import cancel_and_wait
from protocol.auth import ClusterKeys, secure_client
from protocol.finish import FAILED, FinishReason
from protocol.kv_events import SNAPSHOT_PLEASE, KvEvents
from protocol.stages import FIRST_TOKEN_RECEIVED, StageClock
from protocol.to_gateway import TokenDelta
from protocol.to_worker import Abort, Generate, Heartbeat, Prefill

log = logging.getLogger(__name__)

DEFAULT_TIMEOUT_S = 120.0
DEFAULT_CONNECT_TIMEOUT_S = 3.0
DEFAULT_HEARTBEAT_INTERVAL_S = 0.5
DEFAULT_HEARTBEAT_TIMEOUT_S = 1.5
_HANDSHAKE_FAILED = (
    zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL
    | zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL
    | zmq.EVENT_HANDSHAKE_FAILED_AUTH
)

ConnectionListener = Callable[[bool, str], None]
"""Called with (up, reason) when the connection comes up or drops."""


class WorkerError(RuntimeError):
    """The request could not be completed by this worker (retry elsewhere)."""


class WorkerTimeout(WorkerError, TimeoutError):
    """No delta arrived for the request within the client's ``timeout_s``."""


class WorkerUnreachable(WorkerError, ConnectionError):
    """No connection to the worker; the request was not sent."""


class WorkerHandshakeFailed(WorkerUnreachable):
    """The connection opens but its handshake fails: the worker and this client
    do not hold the same cluster token (or one of them holds none)."""

    def __init__(self, endpoint: str, detail: str) -> None:
        # The message leaves ``detail`` out: libzmq reports the same mismatch
        # in more than one way, attempt after attempt (the client logs each).
        super().__init__(
            f"the request-plane handshake with {endpoint} fails: the worker and the "
            "gateway do not hold the same cluster token (DISAGG_CLUSTER_TOKEN or "
            "--cluster-token on both sides, or on neither)"
        )
        self.endpoint, self.detail = endpoint, detail


class WorkerDisconnected(WorkerError, ConnectionError):
    """The connection to the worker dropped while the request was in flight."""


class WorkerClientClosed(WorkerError):
    """The client was closed while the request was in flight."""


_Item = TokenDelta | WorkerError


class _Inbox:
    """The deltas of one request in flight, in arrival order, and its waiter.

    The request's timeout needs no timer per delta: one timer per request,
    which, when it fires early (a delta came, or the consumer was busy), is
    set again for the remaining time."""

    __slots__ = ("items", "waiter", "timer", "last_at", "wait_from", "stages")

    def __init__(self, now: float, stages: StageClock | None) -> None:
        self.items: deque[_Item] = deque()
        self.waiter: asyncio.Future[None] | None = None
        self.timer: asyncio.TimerHandle | None = None
        self.last_at = now
        """Loop time of the last delta (or of the request's start)."""
        self.wait_from = now
        """Loop time the consumer last started to wait."""
        self.stages = stages
        """Stamped with FIRST_TOKEN_RECEIVED by the first delta with tokens; then None."""

    def put(self, item: _Item) -> None:
        self.items.append(item)
        waiter = self.waiter
        if waiter is not None and not waiter.done():
            waiter.set_result(None)


def merge_deltas(first: TokenDelta, rest: deque[_Item]) -> TokenDelta:
    """``first`` and the deltas of the same request already queued behind it
    (taken from ``rest``), as one delta: the tokens in order, the last one's
    finish reason. Stops before an error or abort, so that the tokens ahead of
    it are handed over first, and where top logprobs come and go."""
    if first.finish_reason is not None or not rest:
        return first
    parts = [first]
    with_tops = first.top_logprobs is not None
    while rest:
        nxt = rest[0]
        if (
            isinstance(nxt, WorkerError)
            or nxt.finish_reason in FAILED
            or (nxt.top_logprobs is not None) != with_tops
        ):
            break
        parts.append(nxt)
        rest.popleft()
        if nxt.finish_reason is not None:
            break
    if len(parts) == 1:
        return first
    last = parts[-1]
    return TokenDelta(
        first.rid,
        [t for p in parts for t in p.token_ids],
        [x for p in parts for x in p.logprobs],
        last.finish_reason,
        max(p.num_cached_tokens for p in parts),
        last.error,
        [t for p in parts for t in p.top_logprobs or ()] if with_tops else None,
        last.stages,
        # Only a request's first delta carries them.
        prompt_logprobs=first.prompt_logprobs,
        prompt_top_logprobs=first.prompt_top_logprobs,
    )


class WorkerClient:
    def __init__(
        self,
        request_endpoint: str,
        *,
        timeout_s: float = DEFAULT_TIMEOUT_S,
        connect_timeout_s: float = DEFAULT_CONNECT_TIMEOUT_S,
        context: zmq.asyncio.Context | None = None,
        auth: ClusterKeys | None = None,
        heartbeat_interval_s: float = DEFAULT_HEARTBEAT_INTERVAL_S,
        heartbeat_timeout_s: float = DEFAULT_HEARTBEAT_TIMEOUT_S,
        on_connection: ConnectionListener | None = None,
        on_kv_events: Callable[[KvEvents | None], None] | None = None,
    ) -> None:
        """``on_kv_events``: subscribe to the worker's KV events
        (``protocol.kv_events``); called with each batch in order (a snapshot
        replaces what came before), and with None when the view is lost (a
        gap, a new epoch, a dropped connection) until the snapshot asked for
        comes."""
        if timeout_s <= 0 or connect_timeout_s <= 0:
            raise ValueError("timeout_s and connect_timeout_s must be > 0")
        if heartbeat_interval_s <= 0 or heartbeat_timeout_s <= heartbeat_interval_s:
            raise ValueError("heartbeats need 0 < heartbeat_interval_s < heartbeat_timeout_s")
        self.endpoint = request_endpoint
        self.timeout_s = timeout_s
        self.connect_timeout_s = connect_timeout_s
        self.auth = auth
        self.heartbeat_interval_s = heartbeat_interval_s
        self.heartbeat_timeout_s = heartbeat_timeout_s
        self.on_connection = on_connection
        self.on_kv_events = on_kv_events
        self._kv_epoch = ""
        self._kv_seq = SNAPSHOT_PLEASE
        self._connected = asyncio.Event()
        self._lost = False
        """An established connection dropped and has not come back: requests
        fail at once instead of waiting ``connect_timeout_s`` for it."""
        self._loss = asyncio.Event()
        """Set when the current connection drops (a new one per connection)."""
        self._handshake_error: str | None = None
        """Why the last handshake failed (None once one succeeds)."""
        self._handshake_failed: asyncio.Event = asyncio.Event()
        """Set when a handshake fails (a new one per ``ready`` wait)."""
        self._declared = False
        """A heartbeat went out on this connection: the worker watches us."""
        self._ctx = context
        self._sock: zmq.asyncio.Socket | None = None
        self._monitor: zmq.asyncio.Socket | None = None
        self._inboxes: dict[str, _Inbox] = {}
        self._unsent: dict[str, asyncio.Future[None]] = {}
        """Requests waiting for the connection; set by ``abort``."""
        self._outbox: asyncio.Queue[bytes] = asyncio.Queue()
        self._queued = 0
        """Frames not yet handed to ZMQ (in the outbox, or a direct send that
        waits for the socket): a new one goes behind them, never before."""
        self._tasks: list[asyncio.Task[None]] = []
        self._closed = False

    # -- lifecycle -------------------------------------------------------------

    async def start(self) -> None:
        if self._sock is not None:
            return
        if self._closed:
            raise WorkerClientClosed("client is closed")
        ctx = self._ctx or zmq.asyncio.Context.instance()
        sock = ctx.socket(zmq.DEALER)
        sock.linger = 0
        sock.sndhwm = 0
        sock.rcvhwm = 0
        # ZMTP heartbeats, answered by the peer's libzmq I/O thread (never by a
        # busy engine loop): only a peer that is really gone stops answering.
        sock.heartbeat_ivl = int(self.heartbeat_interval_s * 1000)
        sock.heartbeat_timeout = int(self.heartbeat_timeout_s * 1000)
        sock.heartbeat_ttl = int(self.heartbeat_timeout_s * 4000)
        sock.reconnect_ivl = 100
        sock.reconnect_ivl_max = 1000
        secure_client(sock, self.auth)
        self._monitor = sock.get_monitor_socket(
            zmq.EVENT_HANDSHAKE_SUCCEEDED | zmq.EVENT_DISCONNECTED | _HANDSHAKE_FAILED
        )
        sock.connect(self.endpoint)
        self._sock = sock
        self._tasks = [
            asyncio.create_task(self._receive(), name=f"worker-recv {self.endpoint}"),
            asyncio.create_task(self._send_loop(), name=f"worker-send {self.endpoint}"),
            asyncio.create_task(self._watch(), name=f"worker-watch {self.endpoint}"),
            asyncio.create_task(self._heartbeat(), name=f"worker-heartbeat {self.endpoint}"),
        ]

    async def close(self) -> None:
        """Abort every in-flight request on the worker, then close the socket.
        In-flight iterators raise ``WorkerClientClosed``."""
        if self._closed:
            return
        self._closed = True
        self._connected.set()  # wakes requests waiting for a connection; they see _closed
        self._loss.set()
        for rid in list(self._inboxes):
            self._post(Abort(rid))
        if self._sock is not None:
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(self._flush(), 1.0)
        self._fail_all(WorkerClientClosed("client closed"))
        await cancel_and_wait(*self._tasks)
        self._tasks = []
        if self._sock is not None:
            if self._monitor is not None:
                self._sock.disable_monitor()
                self._monitor.close(linger=0)
            # The aborts are written; give them a moment to reach the wire.
            self._sock.close(linger=500)
            self._sock = None

    async def __aenter__(self) -> WorkerClient:
        await self.start()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    @property
    def connected(self) -> bool:
        return self._connected.is_set() and not self._closed

    @property
    def lost(self) -> bool:
        """An established connection dropped and has not come back."""
        return self._lost

    def loss(self) -> asyncio.Event:
        """Set when the current connection drops (or the client closes): a
        caller that still depends on the worker after its request ended (the
        prefill side of a room whose KV is moving) waits on it."""
        return self._loss

    @property
    def in_flight(self) -> int:
        return len(self._inboxes)

    async def ready(self, timeout_s: float | None = None) -> None:
        """Until the connection is up: the ZMTP handshake succeeded (with
        ``auth``: both sides proved they hold the cluster token). Raises
        ``WorkerHandshakeFailed`` as soon as libzmq reports a failed handshake
        (the peer holds another cluster token, or one side has none), also one
        reported before this call while no connection is up, and
        ``WorkerUnreachable`` when neither comes within ``timeout_s``
        (default ``connect_timeout_s``). Sends nothing."""
        if self._sock is None:
            await self.start()
        if self._up():
            return
        timeout_s = self.connect_timeout_s if timeout_s is None else timeout_s
        self._handshake_failed = failed = asyncio.Event()
        waits = [
            asyncio.ensure_future(self._connected.wait()),
            asyncio.ensure_future(failed.wait()),
        ]
        try:
            await asyncio.wait(waits, timeout=timeout_s, return_when=asyncio.FIRST_COMPLETED)
        finally:
            await cancel_and_wait(*waits)
        if self._up():
            return
        raise WorkerUnreachable(f"no connection to {self.endpoint} within {timeout_s:g}s")

    def _up(self) -> bool:
        """Whether the connection is up (for ``ready``). Raises
        ``WorkerClientClosed`` once the client is closed and
        ``WorkerHandshakeFailed`` when a handshake failed while none is up."""
        if self._closed:
            raise WorkerClientClosed("client is closed")
        if self._connected.is_set():
            return True
        if self._handshake_error is not None:
            raise WorkerHandshakeFailed(self.endpoint, self._handshake_error)
        return False

    # -- requests --------------------------------------------------------------

    async def generate(
        self,
        msg: Generate | Prefill,
        *,
        stages: StageClock | None = None,
        merge: bool = False,
    ) -> AsyncIterator[TokenDelta]:
        """Send ``msg`` and yield its deltas until the final one (finish_reason
        set). See the module docstring for the failure contract. Raises
        ``ValueError`` if ``msg.rid`` is already in flight on this client.

        ``stages``: stamped with ``FIRST_TOKEN_RECEIVED`` when the frame with
        the request's first token is read. ``merge``: deltas of the request
        that are already here when the consumer asks for the next one come as
        one (``merge_deltas``); nothing is ever held back to wait for more."""
        if self._sock is None:
            await self.start()
        if self._closed:
            raise WorkerClientClosed("client is closed")
        rid = msg.rid
        if rid in self._inboxes or rid in self._unsent:
            raise ValueError(f"request id {rid!r} is already in flight on this client")
        if not self._connected.is_set():
            # Invariant: a request is only handed to ZMQ while a connection is
            # up. ZMQ would queue it for a peer that may never come back (a
            # killed worker), and the caller could only learn that by timing out.
            if self._lost:
                # Known dead: no request waits a connect timeout for it.
                raise WorkerUnreachable(f"the connection to {self.endpoint} is down")
            if await self._wait_connected(rid):
                # Aborted before it was sent: the worker never hears of it.
                yield TokenDelta(rid, [], [], FinishReason.ABORT)
                return
            if self._closed:
                raise WorkerClientClosed("client is closed")
        loop = asyncio.get_running_loop()
        inbox = _Inbox(loop.time(), stages)
        self._inboxes[rid] = inbox
        items = inbox.items
        finished = False
        try:
            if not self._declared:
                # Before the first request: a requester killed right after
                # sending it is then known to send heartbeats, and is missed.
                self._declared = True
                self._post(self._heartbeat_msg())
            self._post(msg)
            timeout_s = self.timeout_s
            while True:
                if not items:
                    # Until an item comes, or ``_expire`` fails the wait with
                    # WorkerTimeout: no delta within timeout_s of the last one
                    # or of the start of this wait. Inline (no coroutine of its
                    # own): it runs once per token.
                    inbox.wait_from = now = loop.time()
                    if inbox.timer is None:
                        inbox.timer = loop.call_at(
                            max(inbox.last_at, now) + timeout_s, self._expire, inbox, rid
                        )
                    waiter = inbox.waiter = loop.create_future()
                    try:
                        await waiter
                    finally:
                        inbox.waiter = None
                item = items.popleft()
                if isinstance(item, WorkerError):
                    if not isinstance(item, WorkerDisconnected):
                        finished = True
                    raise item
                if merge and items:
                    item = merge_deltas(item, items)
                if item.finish_reason is not None:
                    finished = True
                yield item
                if finished:
                    return
        finally:
            if inbox.timer is not None:
                inbox.timer.cancel()
            if self._inboxes.get(rid) is inbox:
                del self._inboxes[rid]
            if not finished and not self._closed:
                self._post(Abort(rid))

    async def _wait_connected(self, rid: str) -> bool:
        """Until the connection is up (False) or ``abort(rid)`` is called
        (True); ``WorkerUnreachable`` after ``connect_timeout_s``."""
        aborted = self._unsent[rid] = asyncio.get_running_loop().create_future()
        connected = asyncio.ensure_future(self._connected.wait())
        try:
            async with asyncio.timeout(self.connect_timeout_s):
                await asyncio.wait((connected, aborted), return_when=asyncio.FIRST_COMPLETED)
        except TimeoutError:
            why = f" (handshake failed: {self._handshake_error})" if self._handshake_error else ""
            raise WorkerUnreachable(
                f"no connection to {self.endpoint} within {self.connect_timeout_s:g}s{why}"
            ) from None
        finally:
            connected.cancel()
            del self._unsent[rid]
        return aborted.done()

    def _expire(self, inbox: _Inbox, rid: str) -> None:
        inbox.timer = None
        waiter = inbox.waiter
        if waiter is None or waiter.done():
            return  # the consumer is busy; its next wait sets the timer again
        loop = asyncio.get_running_loop()
        due = max(inbox.last_at, inbox.wait_from) + self.timeout_s
        if loop.time() < due:
            inbox.timer = loop.call_at(due, self._expire, inbox, rid)
            return
        waiter.set_exception(
            WorkerTimeout(
                f"no reply for request {rid!r} from {self.endpoint} within {self.timeout_s:g}s"
            )
        )

    async def abort(self, rid: str) -> None:
        """Ask the worker to stop ``rid``; its iterator then gets an ABORT delta.
        A request still waiting for the connection is never sent."""
        unsent = self._unsent.get(rid)
        if unsent is not None:
            if not unsent.done():
                unsent.set_result(None)
            return
        if self._sock is None:
            await self.start()
        self._post(Abort(rid))

    # -- internals -------------------------------------------------------------

    def _post(self, msg: Any) -> None:
        # Synchronous so it works from a generator's finally during cancellation.
        frame = to_worker.encoder.encode(msg)
        if self._queued == 0 and self._sock is not None:
            # Nothing ahead of it: written now (pyzmq sends at once when it can,
            # else keeps its sends in order), not a task switch later, when the
            # loop gets to the send task (a request's TTFT waits for it).
            sent = self._sock.send(frame)
            if not sent.done():
                self._queued += 1
                sent.add_done_callback(self._sent)
            elif sent.exception() is not None:
                log.warning("send to %s failed: %s", self.endpoint, sent.exception())
            return
        self._queued += 1
        self._outbox.put_nowait(frame)

    def _sent(self, sent: asyncio.Future[Any]) -> None:
        self._queued -= 1
        if not sent.cancelled() and sent.exception() is not None:
            log.warning("send to %s failed: %s", self.endpoint, sent.exception())

    async def _flush(self) -> None:
        await self._outbox.join()
        while self._queued:  # a direct send still waiting for the socket
            await asyncio.sleep(0.01)

    async def _heartbeat(self) -> None:
        while True:
            await asyncio.sleep(self.heartbeat_interval_s)
            if self._connected.is_set():
                self._post(self._heartbeat_msg())

    def _heartbeat_msg(self) -> Heartbeat:
        if self.on_kv_events is None:
            return Heartbeat()
        return Heartbeat(self._kv_epoch, self._kv_seq)

    def _on_kv(self, batch: KvEvents) -> None:
        """Apply ``batch`` in order; on a gap or a new epoch, ask for a
        snapshot at once (and report the view lost until it comes)."""
        if batch.snapshot or (batch.epoch == self._kv_epoch and batch.seq == self._kv_seq + 1):
            self._kv_epoch, self._kv_seq = batch.epoch, batch.seq
            self._kv_report(batch)
        elif batch.epoch == self._kv_epoch and batch.seq <= self._kv_seq:
            return  # already applied (a repair resent it)
        elif self._kv_seq != SNAPSHOT_PLEASE:
            self._kv_seq = SNAPSHOT_PLEASE
            self._kv_report(None)
            self._post(self._heartbeat_msg())

    def _kv_report(self, batch: KvEvents | None) -> None:
        assert self.on_kv_events is not None
        try:
            self.on_kv_events(batch)
        except Exception:  # a listener's bug must not stop the receiver
            log.exception("KV-event listener of %s failed", self.endpoint)

    async def _send_loop(self) -> None:
        assert self._sock is not None
        while True:
            frame = await self._outbox.get()
            try:
                await self._sock.send(frame)
            except zmq.ZMQError as e:
                log.warning("send to %s failed: %s", self.endpoint, e)
            finally:
                self._queued -= 1
                self._outbox.task_done()

    async def _receive(self) -> None:
        assert self._sock is not None
        loop = asyncio.get_running_loop()
        while True:
            try:
                frame = await self._sock.recv()
            except zmq.ZMQError as e:
                log.error("receive from %s failed: %s", self.endpoint, e)
                self._fail_all(WorkerDisconnected(f"receive from {self.endpoint} failed: {e}"))
                return
            try:
                tokens = to_gateway.decoder.decode(frame)
            except (msgspec.DecodeError, msgspec.ValidationError) as e:
                log.warning("ignoring a malformed frame from %s: %s", self.endpoint, e)
                continue
            if type(tokens) is KvEvents:
                if self.on_kv_events is not None:
                    self._on_kv(tokens)
                continue
            now = loop.time()
            inboxes = self._inboxes
            for delta in tokens.deltas:
                inbox = inboxes.get(delta.rid)
                if inbox is None:
                    continue
                inbox.last_at = now
                if inbox.stages is not None and delta.token_ids:
                    inbox.stages.mark(FIRST_TOKEN_RECEIVED, time.monotonic())
                    inbox.stages = None
                # ``inbox.put``, inline (once per token).
                inbox.items.append(delta)
                waiter = inbox.waiter
                if waiter is not None and not waiter.done():
                    waiter.set_result(None)

    async def _watch(self) -> None:
        assert self._monitor is not None
        while True:
            try:
                event = parse_monitor_message(await self._monitor.recv_multipart())
            except (zmq.ZMQError, ValueError, KeyError) as e:
                log.warning("socket monitor of %s stopped: %s", self.endpoint, e)
                return
            kind = event["event"]
            if kind == zmq.EVENT_HANDSHAKE_SUCCEEDED:
                self._handshake_error = None
                if self._lost:
                    log.info("the connection to worker %s is back", self.endpoint)
                self._lost = False
                self._declared = False
                self._loss = asyncio.Event()
                self._connected.set()
                self._notify(True, "connected")
                if self.on_kv_events is not None:
                    self._post(self._heartbeat_msg())  # subscribe now, not in 0.5 s
            elif kind & _HANDSHAKE_FAILED:
                error = _HANDSHAKE_ERRORS.get(kind, "handshake failed")
                if self._handshake_error != error:
                    log.warning(
                        "handshake with worker %s failed (%s): does it hold the same "
                        "cluster token?",
                        self.endpoint,
                        error,
                    )
                self._handshake_error = error
                self._handshake_failed.set()
            elif kind == zmq.EVENT_DISCONNECTED and self._connected.is_set():
                self._connected.clear()
                self._lost = True
                self._loss.set()
                log.warning("lost the connection to worker %s", self.endpoint)
                self._fail_all(WorkerDisconnected(f"connection to {self.endpoint} dropped"))
                self._notify(False, f"request-plane connection to {self.endpoint} dropped")
                if self.on_kv_events is not None and self._kv_seq != SNAPSHOT_PLEASE:
                    self._kv_seq = SNAPSHOT_PLEASE
                    self._kv_report(None)

    def _notify(self, up: bool, reason: str) -> None:
        if self.on_connection is not None:
            try:
                self.on_connection(up, reason)
            except Exception:  # a listener's bug must not stop the watcher
                log.exception("connection listener of %s failed", self.endpoint)

    def _fail_all(self, error: WorkerError) -> None:
        """End every in-flight request with ``error`` (they can get no more deltas)."""
        for inbox in self._inboxes.values():
            inbox.put(error)


_HANDSHAKE_ERRORS = {
    zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL: "no detail",
    zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL: "protocol error: one side uses the cluster token, "
    "the other does not",
    zmq.EVENT_HANDSHAKE_FAILED_AUTH: "authentication refused",
}
