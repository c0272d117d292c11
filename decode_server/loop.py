"""Engine-process loop of a decode worker.

A disaggregated request moves through three queues:

1. pre-allocation: waits until the pool can hold its prompt (FIFO, so a large
   request is not starved by small ones), then asks its prefill engine to
   fill the reserved pages (``Reserve``);
2. transfer: waits for ``Done`` (the first token, all pages landed), a
   failure, or its deadline;
3. running: ordinary continuous-batching decode in the engine's scheduler.

A request without a prefill engine goes straight to the scheduler and is
prefilled here. Pages of a room whose writes may still be in flight are only
released once the prefill engine confirms (``AbortAck``/``RoomFailed``) or is
known to be gone.
"""

from __future__ import annotations

import logging
import time
from collections import deque
from dataclasses import dataclass

from engine.engine import Engine, InFlight
from engine.request import EngineRequestError, Request
from kvtransfer import to_decode, to_prefill
from kvtransfer.decode_side import DecodeKVPlane, PeerFailed
from protocol.to_gateway import TokenDelta
from protocol.to_worker import Generate, Prefill
from worker.config import WorkerConfig
from worker.kv_setup import engine_compat, kv_backend
from worker.loop import (
    WorkerLoop,
    engine_stats,
    error_delta,
    idle_wait,
    step_delta,
)

log = logging.getLogger(__name__)


@dataclass(eq=False)
class Room:
    room: str
    req: Request
    client: bytes
    prefill: str
    deadline: float
    state: str = "prealloc"
    """prealloc -> transfer -> (scheduler's running batch | draining)."""


class DecodeLoop(WorkerLoop):
    def __init__(self, config: WorkerConfig) -> None:
        super().__init__(config)
        self.engine = Engine(config.engine_config())
        self.scheduler = self.engine.scheduler
        backend = kv_backend(self.engine, config.transfer_backend, "decode", config.host)
        self.kv = DecodeKVPlane(
            config.host,
            config.bootstrap_port,
            backend,
            engine_compat(self.engine, config.transfer_backend),
            config.cluster_token or "",
            config.transfer_timeout_s,
        )
        self.clients: dict[str, bytes] = {}
        """rid -> requester of every request this worker streams."""
        self.rooms: dict[str, Room] = {}
        self.by_rid: dict[str, Room] = {}
        self.prealloc: deque[Room] = deque()
        self.outbox: list[tuple[bytes, TokenDelta]] = []
        self.inflight: InFlight | None = None
        self.counters = {"transfers_ok": 0, "transfers_failed": 0}

    @property
    def bootstrap_endpoint(self) -> str | None:
        return self.kv.endpoint

    # -- requests ------------------------------------------------------------

    def submit(self, msg: Generate | Prefill, client: bytes) -> None:
        if not isinstance(msg, Generate):
            self.outbox.append(
                (client, error_delta(msg.rid, "a decode worker only serves Generate requests"))
            )
            return
        if msg.room is not None and msg.room in self.rooms:
            self.outbox.append(
                (client, error_delta(msg.rid, f"room {msg.room!r} is already in use"))
            )
            return
        try:
            req = self.engine.build_request(msg.rid, msg.prompt_ids, msg.sampling)
        except EngineRequestError as e:
            self.outbox.append((client, error_delta(msg.rid, str(e))))
            return
        self.clients[msg.rid] = client
        if msg.prefill_bootstrap is None:
            self.scheduler.add(req)
            return
        room = Room(
            msg.room or msg.rid,
            req,
            client,
            msg.prefill_bootstrap,
            time.monotonic() + self.config.transfer_timeout_s,
        )
        self.rooms[room.room] = room
        self.by_rid[msg.rid] = room
        self.prealloc.append(room)

    def abort(self, rid: str) -> None:
        room = self.by_rid.get(rid)
        if room is not None and room.state in ("prealloc", "transfer"):
            self._fail_room(room, "abort", None)
            return
        if self.scheduler.abort(rid) is not None:
            self._finish(rid, TokenDelta(rid, [], [], "abort", 0))

    # -- queues ----------------------------------------------------------------

    def _admit_prealloc(self) -> None:
        busy = len(self.scheduler.running) + sum(r.state == "transfer" for r in self.rooms.values())
        while self.prealloc and busy < self.config.max_running_requests:
            room = self.prealloc[0]
            if not self.scheduler.reserve_prompt(room.req):
                return  # waits for pages; FIFO keeps large requests from starving
            self.prealloc.popleft()
            req = room.req
            ps = self.engine.runner.pool.page_size
            prefix = req.num_computed
            room.state = "transfer"
            room.deadline = time.monotonic() + self.config.transfer_timeout_s
            self.kv.send(
                room.prefill,
                to_prefill.Reserve(
                    room.room,
                    req.page_table[prefix // ps :],
                    prefix,
                    len(req.prompt_ids),
                ),
            )
            busy += 1

    def _on_done(self, room: Room, msg: to_decode.Done) -> None:
        req = room.req
        self.counters["transfers_ok"] += 1
        log.debug("rid=%s room=%s: KV received, decoding", req.rid, room.room)
        req.num_computed = len(req.fill_ids)
        req.fill_ids.append(msg.first_token)
        req.output_logprobs.append(msg.logprob)
        req.num_cached_tokens = msg.cached_tokens
        self._forget_room(room)
        if msg.finish_reason is not None:
            self.scheduler.release(req)
            self._finish(req.rid, TokenDelta(req.rid, [], [], msg.finish_reason, msg.cached_tokens))
            return
        # The first token already reached the requester from the prefill side.
        self.scheduler.running.append(req)

    def _fail_room(
        self, room: Room, kind: str, reason: str | None, peer_alive: bool = True
    ) -> None:
        """End the request now; free its pages once no write can be in flight."""
        req = room.req
        self.counters["transfers_failed"] += kind == "error"
        (log.warning if kind == "error" else log.debug)(
            "rid=%s room=%s: %s in state %s: %s", req.rid, room.room, kind, room.state, reason
        )
        if room.state == "prealloc":
            self.prealloc.remove(room)
            self._forget_room(room)
        elif room.state == "transfer" and peer_alive:
            room.state = "draining"
            room.deadline = time.monotonic() + self.config.transfer_timeout_s
            self.kv.send(room.prefill, to_prefill.AbortRoom(room.room, reason or kind))
        else:
            # The peer never connected to our buffer, or is gone: nothing writes.
            self._release_room(room)
        self._finish(req.rid, TokenDelta(req.rid, [], [], kind, 0, reason))

    def _release_room(self, room: Room) -> None:
        self.scheduler.release(room.req)
        self._forget_room(room)

    def _forget_room(self, room: Room) -> None:
        self.rooms.pop(room.room, None)
        self.by_rid.pop(room.req.rid, None)

    def _finish(self, rid: str, delta: TokenDelta) -> None:
        client = self.clients.pop(rid, None)
        self.engine.forget(rid)
        if client is not None:
            self.outbox.append((client, delta))

    # -- the loop --------------------------------------------------------------

    def step(self) -> list[tuple[bytes, TokenDelta]]:
        had_events = self._kv_events()
        self._admit_prealloc()
        self._deadlines()
        # Overlap: step N+1 is scheduled and launched before step N's tokens
        # are read back and streamed.
        self.inflight, results = self.engine.overlap_step(self.inflight)
        if not (had_events or results or self.outbox or self.inflight):
            idle_wait()
        for r in results:
            delta = step_delta(r)
            if r.finish_reason is None:
                self.outbox.append((self.clients[r.rid], delta))
            else:
                self._finish(r.rid, delta)
        out, self.outbox = self.outbox, []
        return out

    def _kv_events(self) -> bool:
        """Handle KV-plane messages; True if there were any."""
        events = self.kv.poll()
        for prefill, msg in events:
            if isinstance(msg, PeerFailed):
                for room in [r for r in self.rooms.values() if r.prefill == prefill]:
                    if room.state == "draining":
                        self._release_room(room)
                    elif room.state == "transfer":
                        self._fail_room(room, "error", msg.reason, peer_alive=False)
                    # A room still waiting for pages has sent nothing yet: it
                    # opens a fresh connection (a restarted prefill worker at
                    # the same address serves it; a refusal fails it then).
                continue
            room = self.rooms.get(msg.room)
            if room is None or room.prefill != prefill:
                continue
            if room.state == "transfer":
                if isinstance(msg, to_decode.Done):
                    self._on_done(room, msg)
                elif isinstance(msg, to_decode.RoomFailed):
                    self._fail_room(room, "error", msg.reason, peer_alive=False)
                else:  # AbortAck: the prefill side gave the room up
                    self._fail_room(room, "abort", None, peer_alive=False)
            elif room.state == "draining":
                self._release_room(room)
        return bool(events)

    def _deadlines(self) -> None:
        now = time.monotonic()
        for room in list(self.rooms.values()):
            if now <= room.deadline:
                continue
            if room.state == "transfer":
                self._fail_room(
                    room,
                    "error",
                    f"KV transfer from {room.prefill} did not finish within "
                    f"{self.config.transfer_timeout_s:g}s",
                )
            elif room.state == "draining":
                # No confirmation in time: the prefill engine is presumed dead.
                self.kv.drop_peer(room.prefill, "prefill worker stopped answering")
                self._release_room(room)

    def has_work(self) -> bool:
        return bool(
            self.rooms or self.outbox or self.inflight is not None or self.scheduler.has_work()
        )

    def stats(self) -> dict:
        return {
            **engine_stats(self.engine, "decode"),
            "prealloc": len(self.prealloc),
            "transferring": sum(r.state == "transfer" for r in self.rooms.values()),
            **self.counters,
        }

    def close(self) -> None:
        self.kv.close()
