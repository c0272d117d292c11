"""Engine-process loop of a decode worker.

A disaggregated request has a room that moves through ``DecodeState``:

1. waiting for pages: queued until the pool can hold its prompt (FIFO, so a
   large request is not starved by small ones), then it asks its prefill
   engine to fill the reserved pages (``Reserve``);
2. transferring: waits for ``Done`` (the first token, all pages landed), a
   failure, or its deadline;
3. decoding: ordinary continuous-batching decode in the engine's scheduler.

A request without a prefill engine goes straight to the scheduler and is
prefilled here. Pages of a room whose writes may still be in flight are only
released once the prefill engine confirms (``AbortAck``/``RoomFailed``) or is
known to be gone (the room drains).
"""

from __future__ import annotations

import logging
import time
from collections import deque
from typing import Any

from decode_server.room import DecodeState, Room
from engine.engine import InFlight
from engine.request import EngineRequestError
from kvtransfer import to_decode, to_prefill
from kvtransfer.decode_side import DecodeKVPlane, PeerFailed
from protocol.finish import FinishReason
from protocol.roles import DECODE
from protocol.stages import ADMITTED, DONE_RECEIVED, RESERVE_SENT
from protocol.to_gateway import TokenDelta
from protocol.to_worker import Generate, Prefill
from worker.config import WorkerConfig
from worker.disagg_loop import DisaggLoop
from worker.loop import abort_delta, idle_wait, step_delta, timed_overlap_step

log = logging.getLogger(__name__)


class DecodeLoop(DisaggLoop[Room, DecodeKVPlane]):
    role = DECODE
    COUNTERS = {"transfers_ok": 0, "transfers_failed": 0}

    def __init__(self, config: WorkerConfig) -> None:
        super().__init__(config)
        self.prealloc: deque[Room] = deque()
        """Rooms waiting for pages, oldest first."""
        self.inflight: InFlight | None = None

    def _open_kv_plane(self) -> DecodeKVPlane:
        return DecodeKVPlane(
            self.config.host,
            self.config.bootstrap_port,
            self._kv_backend(),
            self._kv_compat(),
            self.config.cluster_token or "",
            self.config.transfer_timeout_s,
            self._rank_agents(),
        )

    def _rank_agents(self) -> list[to_prefill.RankAgent]:
        agents = self._open_rank_agents()
        if agents is None:
            return []
        return [to_prefill.RankAgent(name, meta) for name, meta in agents.agents]

    # -- requests ------------------------------------------------------------

    def submit(self, msg: Generate | Prefill, client: bytes) -> None:
        if not isinstance(msg, Generate):
            self._refuse(client, msg.rid, "a decode worker only serves Generate requests")
            return
        if msg.room is not None and msg.room in self.rooms:
            self._refuse(client, msg.rid, f"room {msg.room!r} is already in use")
            return
        try:
            req = self.engine.build_request(msg.rid, msg.prompt_ids, msg.sampling)
        except EngineRequestError as e:
            self._refuse(client, msg.rid, str(e), e.param)
            return
        self.clients[msg.rid] = client
        if msg.prefill_bootstrap is None:
            self.scheduler.add(req)
            self.stages.mark(msg.rid, ADMITTED)
            return
        room = Room(
            msg.room or msg.rid,
            req,
            msg.prefill_bootstrap,
            time.monotonic() + self.config.transfer_timeout_s,
        )
        self.rooms.add(room)
        self.stages.set_room(msg.rid, room.id)
        self.prealloc.append(room)

    def abort(self, rid: str) -> None:
        room = self.rooms.serving(rid)
        if room is not None and room.state in (DecodeState.WAITING_PAGES, DecodeState.TRANSFERRING):
            self._fail_room(room, FinishReason.ABORT, None)
            return
        if self.scheduler.abort(rid) is not None:
            self._finish(rid, abort_delta(rid))

    # -- rooms -----------------------------------------------------------------

    def _admit_prealloc(self) -> None:
        busy = len(self.scheduler.running) + self._count(DecodeState.TRANSFERRING)
        while self.prealloc and busy < self.config.engine.max_running_requests:
            room = self.prealloc[0]
            if not self.scheduler.reserve_prompt(room.req):
                return  # waits for pages; FIFO keeps large requests from starving
            self.prealloc.popleft()
            self._send_reserve(room)
            busy += 1

    def _send_reserve(self, room: Room) -> None:
        """Ask the prefill engine to fill the pages past the cached prefix."""
        req = room.req
        ps = self.engine.runner.pool.page_size
        prefix = req.num_computed
        room.move(DecodeState.TRANSFERRING)
        room.deadline = time.monotonic() + self.config.transfer_timeout_s
        self.kv.send(
            room.prefill,
            to_prefill.Reserve(
                room.id, req.page_table[prefix // ps :], prefix, len(req.prompt_ids)
            ),
        )
        self.stages.mark(req.rid, RESERVE_SENT)

    def _on_done(self, room: Room, msg: to_decode.Done) -> None:
        req = room.req
        self.stages.mark(req.rid, DONE_RECEIVED)
        self.counters["transfers_ok"] += 1
        log.debug("rid=%s room=%s: KV received, decoding", req.rid, room.id)
        req.num_computed = len(req.fill_ids)
        req.fill_ids.append(msg.first_token)
        req.output_logprobs.append(msg.logprob)
        req.num_cached_tokens = msg.cached_tokens
        self.rooms.remove(room)
        if msg.finish_reason is not None:
            room.move(DecodeState.CLOSED)
            self.scheduler.release(req)
            self._finish(req.rid, TokenDelta(req.rid, [], [], msg.finish_reason, msg.cached_tokens))
            return
        room.move(DecodeState.DECODING)
        # The first token already reached the requester from the prefill side.
        self.scheduler.admit_prefilled(req)
        self.stages.mark(req.rid, ADMITTED)

    def _fail_room(
        self,
        room: Room,
        kind: FinishReason,
        reason: str | None,
        peer_alive: bool = True,
        tell_peer: bool = True,
    ) -> None:
        """End the request now; free its pages once no write can be in flight
        (``peer_alive``: one may be; ``tell_peer``: ask the prefill engine to
        give the room up, which frees them sooner)."""
        req = room.req
        failed = kind == FinishReason.ERROR
        self.counters["transfers_failed"] += int(failed)
        (log.warning if failed else log.debug)(
            "rid=%s room=%s: %s in state %s: %s", req.rid, room.id, kind, room.state.value, reason
        )
        if room.state is DecodeState.WAITING_PAGES:
            self.prealloc.remove(room)
            room.move(DecodeState.CLOSED)
            self.rooms.remove(room)
        elif room.state is DecodeState.TRANSFERRING and peer_alive:
            room.move(DecodeState.DRAINING)
            room.deadline = time.monotonic() + self.config.transfer_timeout_s
            if tell_peer:
                self.kv.send(room.prefill, to_prefill.AbortRoom(room.id, reason or kind))
        else:
            # The peer never connected to our buffer, or is gone: nothing writes.
            self._release_room(room)
        self._finish(req.rid, TokenDelta(req.rid, [], [], kind, 0, reason))

    def _release_room(self, room: Room) -> None:
        room.move(DecodeState.CLOSED)
        self.scheduler.release(room.req)
        self.rooms.remove(room)

    def _finish(self, rid: str, delta: TokenDelta) -> None:
        """Queue the request's final delta; its id may be used again."""
        self._reply(rid, delta)
        self.engine.forget(rid)

    def _count(self, state: DecodeState) -> int:
        return sum(r.state is state for r in self.rooms)

    # -- the loop --------------------------------------------------------------

    def step(self) -> list[tuple[bytes, TokenDelta]]:
        had_events = self._kv_events()
        self._admit_prealloc()
        self._deadlines()
        # Overlap: step N+1 is scheduled and launched before step N's tokens
        # are read back and streamed.
        self.inflight, results = timed_overlap_step(self.engine, self.stages, self.inflight)
        if not (had_events or results or self.outbox or self.inflight) and self.busy():
            idle_wait()  # e.g. requests queued for pages: nothing to wait on but time
        for r in results:
            delta = step_delta(r)
            if r.finish_reason is None:
                self._reply(r.rid, delta)
            else:
                self._finish(r.rid, delta)
        return self.outbox.take()

    def _kv_events(self) -> bool:
        """Handle KV-plane messages; True if there were any."""
        events = self.kv.poll()
        for prefill, msg in events:
            if isinstance(msg, PeerFailed):
                self._on_peer_failed(prefill, msg)
                continue
            room = self.rooms.get(msg.room)
            if room is None or room.prefill != prefill:
                continue
            if room.state is DecodeState.TRANSFERRING:
                if isinstance(msg, to_decode.Done):
                    self._on_done(room, msg)
                elif isinstance(msg, to_decode.RoomFailed):
                    self._fail_room(room, FinishReason.ERROR, msg.reason, peer_alive=False)
                else:  # AbortAck: the prefill side gave the room up
                    self._fail_room(room, FinishReason.ABORT, None, peer_alive=False)
            elif room.state is DecodeState.DRAINING:
                self._release_room(room)
        return bool(events)

    def _on_peer_failed(self, prefill: str, failure: PeerFailed) -> None:
        """The prefill engine is unusable. Its rooms fail now; their pages come
        back at once if nothing of it can write into them, else after one more
        timeout (a paused engine that resumes may still finish a write)."""
        for room in self.rooms:
            if room.prefill != prefill:
                continue
            if failure.writes_possible:
                if room.state is DecodeState.TRANSFERRING:
                    # No AbortRoom: the connection it would go on is the one
                    # that just dropped.
                    self._fail_room(room, FinishReason.ERROR, failure.reason, tell_peer=False)
            elif room.state is DecodeState.DRAINING:
                self._release_room(room)
            elif room.state is DecodeState.TRANSFERRING:
                self._fail_room(room, FinishReason.ERROR, failure.reason, peer_alive=False)
            # A room still waiting for pages has sent nothing yet: it opens a
            # fresh connection (a restarted prefill worker at the same address
            # serves it; a refusal fails it then).

    def _deadlines(self) -> None:
        now = time.monotonic()
        for room in self.rooms:
            if now <= room.deadline:
                continue
            if room.state is DecodeState.TRANSFERRING:
                self._fail_room(
                    room,
                    FinishReason.ERROR,
                    f"KV transfer from {room.prefill} did not finish within "
                    f"{self.config.transfer_timeout_s:g}s",
                )
            elif room.state is DecodeState.DRAINING:
                # No confirmation in time: the prefill engine is presumed dead.
                self.kv.drop_peer(room.prefill, "prefill worker stopped answering")
                self._release_room(room)

    def has_work(self) -> bool:
        return bool(
            self.rooms or self.outbox or self.inflight is not None or self.scheduler.has_work()
        )

    def busy(self) -> bool:
        # Rooms waiting for their KV wait for the KV plane's sockets (Done,
        # RoomFailed, a dropped peer's monitor event).
        return bool(
            self.outbox
            or self.inflight is not None
            or self.scheduler.has_work()
            or self.prealloc
            or self.kv.has_pending()
        )

    def wait_sockets(self) -> list[Any]:
        return self.kv.sockets()

    def _room_stats(self) -> dict[str, int]:
        return {
            "prealloc": len(self.prealloc),
            "transferring": self._count(DecodeState.TRANSFERRING),
        }
