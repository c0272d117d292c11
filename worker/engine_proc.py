"""The engine process of a worker: one ``WorkerLoop`` behind two ZMQ sockets.

- request plane: ROUTER at ``tcp://{host}:{request_port}``. Requesters (DEALER)
  send ``to_worker`` messages; each step, every requester with news gets ONE
  ``Tokens`` frame holding its deltas.
- control plane: ROUTER at an ``ipc://`` path chosen by the front, answering
  msgpack maps ``{"id": n, "op": ...}`` with ``{"id": n, "ok": bool, ...}``;
  the ops are ``CtrlOp``.

The control socket is bound before the model loads, so the front's ``ready``
request waits in the queue and is answered as soon as startup ends either way.

Module-level imports stay torch-free: the front imports this module to spawn it.
"""

from __future__ import annotations

import logging
import multiprocessing
import signal
import sys
import time
import traceback
from enum import StrEnum
from typing import Any

import msgspec
import zmq

from protocol import to_gateway, to_worker
from protocol.auth import is_loopback, keys_for, secure_server
from protocol.finish import WORKER_STOPPED, FinishReason
from protocol.kv_events import KvEvents
from protocol.to_gateway import TokenDelta, Tokens
from protocol.to_worker import Abort, Heartbeat
from worker.config import WorkerConfig
from worker.roles import Role

log = logging.getLogger("worker.engine")

IDLE_POLL_MS = 5
HOUSEKEEPING_S = 0.5
MAX_MESSAGES_PER_ITERATION = 4096
STARTUP_ERROR_LINGER_S = 30.0
"""After a failed startup, how long to wait for the front to ask for the error."""

_ctrl_encoder = msgspec.msgpack.Encoder()


class CtrlOp(StrEnum):
    """What the front asks the engine process on the control plane (``op``)."""

    READY = "ready"
    """The startup result: endpoints and static info, or the startup error."""
    PING = "ping"
    STATS = "stats"
    SERVER_INFO = "server_info"
    DRAIN = "drain"
    """Refuse new requests from now on, retryably; answers whether nothing is
    left in flight."""
    SHUTDOWN = "shutdown"


def encode_ctrl(obj: dict[str, Any]) -> bytes:
    return _ctrl_encoder.encode(obj)


def decode_ctrl(data: bytes) -> dict[str, Any]:
    obj = msgspec.msgpack.decode(data)
    if not isinstance(obj, dict):
        raise ValueError("control message is not a map")
    return obj


def setup_logging(level: str, process: str) -> None:
    logging.basicConfig(
        level=level.upper(),
        format=f"%(asctime)s %(levelname)s [{process}] %(name)s: %(message)s",
        stream=sys.stderr,
        force=True,
    )


def engine_main(config: WorkerConfig, role: Role, ctrl_endpoint: str) -> None:
    """Entry point of the spawned engine process; exits non-zero on failure."""
    setup_logging(config.log_level, f"{config.role}-engine")
    # Ctrl-C reaches the whole process group; the front decides when we stop.
    # SIGTERM kills at once until startup is done, then stops gracefully.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    sys.exit(EngineServer(config, role, ctrl_endpoint).run())


def _peek_rid(payload: bytes) -> str | None:
    """The ``rid`` of a frame that failed validation, if it has a usable one."""
    try:
        obj = msgspec.msgpack.decode(payload)
    except msgspec.DecodeError:
        return None
    rid = obj.get("rid") if isinstance(obj, dict) else None
    return rid if isinstance(rid, str) and rid else None


class EngineServer:
    def __init__(self, config: WorkerConfig, role: Role, ctrl_endpoint: str) -> None:
        self.config = config
        self.role = role
        self.ctrl_endpoint = ctrl_endpoint
        self.ctx = zmq.Context()
        self.ctrl: zmq.Socket | None = None
        self.router: zmq.Socket | None = None
        self.loop: Any = None  # WorkerLoop; imported lazily (torch)
        self.request_endpoint: str | None = None
        self.info: dict[str, Any] = {}
        self.threads = 0
        self.exit_code = 0
        self._stop = False
        self._draining = False
        """Stopping: new requests are refused (retryable), in-flight ones finish."""
        self._started = time.monotonic()
        # rid -> requester. Only owned rids get deltas forwarded, so a request
        # ends with exactly one final delta even when it times out here.
        self._owners: dict[str, bytes] = {}
        self._deadlines: dict[str, float] = {}
        self._heard: dict[bytes, float] = {}
        """Requesters that send heartbeats -> when one was last heard from."""
        self.kv_events: Any = None
        """The ``KvPublisher`` of a role whose prefix cache routes prompts."""
        self._polled_at = time.monotonic()
        self._active_at = self._polled_at
        """When the last request (not a heartbeat) came or the last step ran."""
        self._counters = {
            "orphans_aborted_total": 0,
            "bad_frames_total": 0,
            "duplicate_rids_total": 0,
            "timed_out_total": 0,
            "refused_draining_total": 0,
            "engine_steps_total": 0,
            "engine_step_seconds_total": 0.0,
        }

    def request_stop(self) -> None:
        self._stop = True

    # -- lifecycle -------------------------------------------------------------

    def run(self) -> int:
        self.ctrl = self.ctx.socket(zmq.ROUTER)
        self.ctrl.linger = 1000
        self.ctrl.bind(self.ctrl_endpoint)
        try:
            self._startup()
        except Exception as e:
            # A bad setting or a missing model is said in one line; anything
            # else is a bug, with its traceback.
            from engine.checkpoints import ModelNotFound
            from engine.memory import NotEnoughMemory
            from engine.model_config import ModelConfigError

            known = isinstance(e, (ModelNotFound, ModelConfigError, NotEnoughMemory))
            log.error("startup failed: %s", e if known else "\n" + traceback.format_exc())
            self._report_startup_error(f"{type(e).__name__}: {e}")
            self._close_loop()
            self._close_sockets()
            return 1
        signal.signal(signal.SIGTERM, lambda *_: self.request_stop())
        log.info(
            "ready: role=%s request_endpoint=%s bootstrap_endpoint=%s",
            self.config.role,
            self.request_endpoint,
            self.info.get("bootstrap_endpoint"),
        )
        try:
            self._serve()
        except Exception:
            log.error("engine loop crashed:\n%s", traceback.format_exc())
            self._fail_all("worker engine crashed; see the worker log")
            self.exit_code = 1
        finally:
            self._shutdown()
        return self.exit_code

    def _startup(self) -> None:
        cfg = self.config.resolve()
        if not cfg.cluster_token and not is_loopback(cfg.host):
            raise RuntimeError(
                f"refusing to listen on {cfg.host} without a cluster token: any host that "
                "reaches the request plane could submit and abort requests; set "
                "DISAGG_CLUSTER_TOKEN (or --cluster-token) on every worker and the gateway"
            )
        if not cfg.cluster_token:
            log.warning(
                "no cluster token: the request plane accepts any local process; set "
                "DISAGG_CLUSTER_TOKEN to require it"
            )
        self.router = self.ctx.socket(zmq.ROUTER)
        secure_server(self.router, keys_for(cfg.cluster_token))
        # Replies to a requester that went away are dropped, never an error;
        # no send high-water mark, so a slow but live requester loses nothing.
        self.router.setsockopt(zmq.ROUTER_MANDATORY, 0)
        self.router.sndhwm = 0
        self.router.rcvhwm = 0
        self.router.linger = 500
        if ":" in cfg.host:
            self.router.ipv6 = True
        bind_host = f"tcp://{cfg.host if ':' not in cfg.host else f'[{cfg.host}]'}"
        if cfg.request_port == 0:
            port = self.router.bind_to_random_port(bind_host)
        else:
            self.router.bind(f"{bind_host}:{cfg.request_port}")
            port = cfg.request_port
        cfg = cfg.with_request_port(port)
        self.config = cfg
        self.request_endpoint = cfg.request_endpoint
        self.threads = _set_threads(cfg.engine_threads)
        self.loop = self.role.make_loop(cfg)
        self.loop.deliver = self._deliver
        cache = self.loop.prefix_cache()
        if cache is not None:
            from worker.kv_publisher import KvPublisher

            self.kv_events = KvPublisher(cache, self._send_kv)
        self.info = {
            "role": cfg.role,
            "model": cfg.engine.model,
            "served_model_name": cfg.model_name,
            "request_endpoint": self.request_endpoint,
            "bootstrap_endpoint": self.loop.bootstrap_endpoint,
            "page_size": cfg.engine.page_size,
            "context_length": cfg.engine.context_length,
            "transfer_backend": cfg.transfer_backend,
            "torch_threads": self.threads,
            "busy_poll_s": cfg.idle_spin_s,
            **self.loop.info(),
        }

    def _report_startup_error(self, message: str) -> None:
        """Answer control requests with the error until one was answered."""
        assert self.ctrl is not None
        parent = multiprocessing.parent_process()
        deadline = time.monotonic() + STARTUP_ERROR_LINGER_S
        while time.monotonic() < deadline and not self._stop:
            if parent is not None and not parent.is_alive():
                return
            if not self.ctrl.poll(100):
                continue
            frames = self.ctrl.recv_multipart()
            if len(frames) != 2:
                continue
            try:
                req_id = decode_ctrl(frames[1]).get("id")
            except (msgspec.DecodeError, ValueError):
                req_id = None
            reply = {"id": req_id, "ok": False, "error": message}
            self.ctrl.send_multipart([frames[0], encode_ctrl(reply)])
            return

    def _shutdown(self) -> None:
        self._fail_all(WORKER_STOPPED)
        self._close_loop()
        self._close_sockets()
        log.info("engine process stopped")

    def _close_loop(self) -> None:
        if self.loop is not None:
            try:
                self.loop.close()
            except Exception:
                log.exception("loop.close() failed")

    def _close_sockets(self) -> None:
        for sock in (self.router, self.ctrl):
            if sock is not None:
                sock.close()
        self.ctx.term()

    # -- main loop -------------------------------------------------------------

    def _serve(self) -> None:
        assert self.router is not None and self.ctrl is not None
        poller = zmq.Poller()
        poller.register(self.router, zmq.POLLIN)
        poller.register(self.ctrl, zmq.POLLIN)
        parent = multiprocessing.parent_process()
        next_housekeeping = time.monotonic() + HOUSEKEEPING_S
        waited: tuple[zmq.Socket, ...] = ()
        # Until this long after the last request or step the poll never sleeps:
        # a process asleep in poll is woken by its ZMQ I/O thread, and on an
        # idle (virtualized) CPU that wake-up alone costs 0.1-0.4 ms of the
        # next request's time to first token.
        spin_s = self.config.idle_spin_s
        while not self._stop:
            # The loop's own sockets (its KV plane) are polled here too: a loop
            # that only waits for a message sleeps until it comes, not for a
            # fixed pause (a Reserve or Done is handled within microseconds).
            wait = tuple(self.loop.wait_sockets())
            if wait != waited:
                for sock in waited:
                    poller.unregister(sock)
                for sock in wait:
                    poller.register(sock, zmq.POLLIN)
                waited = wait
            busy = self.loop.busy() or self._polled_at - self._active_at < spin_s
            events = dict(poller.poll(0 if busy else IDLE_POLL_MS))
            # What was on the socket until now is read below: silence is
            # measured up to here, not across a long step that follows.
            self._polled_at = time.monotonic()
            if self.router in events:
                self._drain(self.router, self._on_request)
            if self.ctrl in events:
                self._drain(self.ctrl, self._on_ctrl)
            if self._stop:
                break
            if self.loop.has_work():
                self._step()
                self._active_at = self._polled_at
            now = time.monotonic()
            if now >= next_housekeeping:
                next_housekeeping = now + HOUSEKEEPING_S
                if parent is not None and not parent.is_alive():
                    log.error("front process is gone; stopping")
                    # A crash, not a shutdown: say so before _shutdown ends the rest.
                    self._fail_all("the worker's front process exited")
                    self.exit_code = 1
                    return
                failure = self.loop.failure()
                if failure is not None:
                    log.error("%s; stopping", failure)
                    self._fail_all(f"worker failed: {failure}")
                    self.exit_code = 1
                    return
                self._expire(now)
                self._abort_orphans(now)

    def _drain(self, sock: zmq.Socket, handler: Any) -> None:
        for _ in range(MAX_MESSAGES_PER_ITERATION):
            try:
                frames = sock.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                return
            if len(frames) != 2:
                self._counters["bad_frames_total"] += 1
                log.warning("ignoring a message of %d frames (expected 2)", len(frames))
                continue
            handler(frames[0], frames[1])

    def _on_request(self, client: bytes, payload: bytes) -> None:
        try:
            msg = to_worker.decoder.decode(payload)
        except (msgspec.DecodeError, msgspec.ValidationError) as e:
            self._counters["bad_frames_total"] += 1
            rid = _peek_rid(payload)
            log.warning("ignoring a malformed request (rid=%s): %s", rid, e)
            if rid is not None and rid not in self._owners:
                self._send(client, [_error(rid, f"malformed request: {e}")], stamp=False)
            return
        if self._heard:
            heard = self._heard.get(client)
            if heard is not None:
                self._heard[client] = time.monotonic()
        if isinstance(msg, Heartbeat):
            self._heard[client] = time.monotonic()
            if msg.kv_seq is not None and self.kv_events is not None:
                self.kv_events.on_heartbeat(client, msg.kv_epoch, msg.kv_seq)
            return
        self._active_at = self._polled_at  # heartbeats keep nobody spinning
        if isinstance(msg, Abort):
            owner = self._owners.get(msg.rid)
            if owner is None:
                return
            if owner != client:
                log.warning("ignoring abort of %r from a requester that does not own it", msg.rid)
                return
            self._abort_quietly(msg.rid)
            return
        if self._draining:
            self._counters["refused_draining_total"] += 1
            self._send(client, [_refused(msg.rid)], stamp=False)
            return
        if msg.rid in self._owners:
            self._counters["duplicate_rids_total"] += 1
            # Not stamped: the stage record of this rid is the running request's.
            error = _error(msg.rid, f"request id {msg.rid!r} is already in use")
            self._send(client, [error], stamp=False)
            return
        self._owners[msg.rid] = client
        now = time.monotonic()
        self.loop.stages.open(msg.rid, now)
        if self.config.request_timeout_s > 0:
            self._deadlines[msg.rid] = now + self.config.request_timeout_s
        try:
            self.loop.submit(msg, client)
        except Exception as e:
            log.exception("loop.submit(%r) raised", msg.rid)
            del self._owners[msg.rid]
            self._deadlines.pop(msg.rid, None)
            self._send(client, [_error(msg.rid, f"internal error: {type(e).__name__}: {e}")])

    def _step(self) -> None:
        t0 = time.perf_counter()
        deltas = self.loop.step()
        self._counters["engine_steps_total"] += 1
        self._counters["engine_step_seconds_total"] += time.perf_counter() - t0
        self._deliver(deltas)
        if self.kv_events is not None:
            self.kv_events.publish()

    def _deliver(self, deltas: list[tuple[bytes, TokenDelta]]) -> None:
        """Send each delta to its requester (if it still owns the request)."""
        by_client: dict[bytes, list[TokenDelta]] = {}
        for client, delta in deltas:
            if self._owners.get(delta.rid) != client:
                continue
            by_client.setdefault(client, []).append(delta)
            if delta.finish_reason is not None:
                del self._owners[delta.rid]
                self._deadlines.pop(delta.rid, None)
        for client, items in by_client.items():
            self._send(client, items)

    def _expire(self, now: float) -> None:
        expired = [rid for rid, t in self._deadlines.items() if t <= now]
        for rid in expired:
            client = self._owners.pop(rid)
            del self._deadlines[rid]
            self._counters["timed_out_total"] += 1
            log.warning("request %r exceeded request_timeout_s; aborting it", rid)
            self._abort_quietly(rid)
            limit = self.config.request_timeout_s
            self._send(client, [_error(rid, f"request timed out after {limit:g}s in the worker")])

    def _abort_orphans(self, now: float) -> None:
        """Abort the requests of requesters that fell silent: a killed gateway
        never sends the aborts, and its streams would run to the end."""
        limit = self.config.requester_timeout_s
        if limit <= 0:
            return
        gone = {c for c, t in self._heard.items() if self._polled_at - t > limit}
        if not gone:
            return
        for client in gone:
            del self._heard[client]
            if self.kv_events is not None:
                self.kv_events.forget(client)
        orphans = [rid for rid, c in self._owners.items() if c in gone]
        if orphans:
            log.warning(
                "%d requester(s) silent for over %gs; aborting their %d request(s)",
                len(gone),
                limit,
                len(orphans),
            )
        for rid in orphans:
            del self._owners[rid]
            self._deadlines.pop(rid, None)
            self._counters["orphans_aborted_total"] += 1
            self._abort_quietly(rid)

    def _fail_all(self, message: str) -> None:
        """Give every in-flight request its final (error) delta."""
        by_client: dict[bytes, list[TokenDelta]] = {}
        for rid, client in self._owners.items():
            by_client.setdefault(client, []).append(_error(rid, message))
            if self.loop is not None:
                self._abort_quietly(rid)
        self._owners.clear()
        self._deadlines.clear()
        for client, items in by_client.items():
            self._send(client, items)

    def _abort_quietly(self, rid: str) -> None:
        try:
            self.loop.abort(rid)
        except Exception:
            log.exception("loop.abort(%r) raised", rid)

    def _send(self, client: bytes, deltas: list[TokenDelta], stamp: bool = True) -> None:
        """One frame of ``deltas`` to ``client``. ``stamp``: the deltas belong to
        requests this server accepted (their stage records see them go)."""
        assert self.router is not None
        if stamp and self.loop is not None:
            deltas = self.loop.stages.on_send(deltas, time.monotonic())
        frame = to_gateway.encoder.encode(Tokens(deltas))
        try:
            self.router.send_multipart([client, frame], zmq.NOBLOCK)
        except zmq.ZMQError as e:
            log.debug("could not send to a requester: %s", e)

    def _send_kv(self, client: bytes, batch: KvEvents) -> None:
        assert self.router is not None
        try:
            self.router.send_multipart([client, to_gateway.encoder.encode(batch)], zmq.NOBLOCK)
        except zmq.ZMQError as e:
            log.debug("could not send KV events to a requester: %s", e)

    # -- control plane ---------------------------------------------------------

    def _on_ctrl(self, ident: bytes, payload: bytes) -> None:
        assert self.ctrl is not None
        try:
            req = decode_ctrl(payload)
        except (msgspec.DecodeError, ValueError) as e:
            log.warning("ignoring a malformed control message: %s", e)
            return
        op = req.get("op")
        reply: dict[str, Any] = {"id": req.get("id"), "ok": True}
        try:
            if op == CtrlOp.READY:
                reply.update(self.info)
            elif op == CtrlOp.STATS:
                reply["stats"] = self.stats()
                reply["stages"] = self.loop.stages.histograms.snapshot()
            elif op == CtrlOp.SERVER_INFO:
                reply["info"] = {**self.info, "stats": self.stats()}
            elif op == CtrlOp.DRAIN:
                self._draining = True
                reply["in_flight"] = len(self._owners)
                reply["idle"] = not self._owners and not self.loop.has_work()
            elif op == CtrlOp.SHUTDOWN:
                self._stop = True
            elif op != CtrlOp.PING:
                reply.update(ok=False, error=f"unknown op {op!r}")
        except Exception as e:
            log.exception("control op %r failed", op)
            reply.update(ok=False, error=f"{op} failed: {type(e).__name__}: {e}")
        self.ctrl.send_multipart([ident, encode_ctrl(reply)])

    def stats(self) -> dict[str, Any]:
        return {
            **self.loop.stats(),
            "in_flight": len(self._owners),
            "requesters": len(set(self._owners.values())),
            "kv_event_subscribers": self.kv_events.subscribers if self.kv_events else 0,
            "kv_event_batches_total": self.kv_events.seq if self.kv_events else 0,
            "uptime_seconds": round(time.monotonic() - self._started, 3),
            **self._counters,
        }


def _set_threads(n: int) -> int:
    """Intra-op threads of this engine process: with torch's default (one per
    core) every engine on a machine runs as many threads as there are cores,
    and two of them beside any busy process thrash (a 2-core CPU served 0.55
    instead of 16.5 req/s)."""
    import torch

    torch.set_num_threads(n)
    log.info("intra-op threads: %d", torch.get_num_threads())
    return torch.get_num_threads()


def _refused(rid: str) -> TokenDelta:
    why = "the worker is draining (shutting down)"
    return TokenDelta(rid, [], [], FinishReason.ERROR, 0, why, retry=True)


def _error(rid: str, message: str) -> TokenDelta:
    return TokenDelta(rid, [], [], FinishReason.ERROR, 0, message)
