"""Engine-process loop of a prefill worker.

A ``Prefill`` request waits for its decode engine's ``Reserve`` (no KV is
computed without a destination), then runs in chunks; after every step the
newly computed pages are pushed into the decode engine's reserved pages. The
first token goes to the requester at once; ``Done`` goes to the decode engine
once every write of the room has landed, and only then do the pages return to
the prefix cache. ``PrefillState`` names where a room is on that path; a room
stopped on the way keeps its pages until no write of it is in flight.
"""

from __future__ import annotations

import logging
import time
from typing import Any

from engine.request import EngineRequestError
from engine.scheduler import ScheduledBatch
from kvtransfer import to_decode, to_prefill
from kvtransfer.backend import TransferState
from kvtransfer.prefill_side import PrefillKVPlane
from prefill_server.room import STOPPED, FirstToken, PrefillState, Room, Unclaimed
from prefill_server.scheduler import PrefillScheduler
from protocol.finish import FinishReason
from protocol.roles import PREFILL
from protocol.stages import (
    ADMITTED,
    DONE_SENT,
    LAST_CHUNK_PUSHED,
    RESERVE_RECEIVED,
    WRITES_LANDED,
)
from protocol.to_gateway import TokenDelta
from protocol.to_worker import Generate, Prefill
from worker.config import WorkerConfig
from worker.disagg_loop import DisaggLoop
from worker.loop import abort_delta, error_delta, idle_wait, step_delta

log = logging.getLogger(__name__)


class PrefillLoop(DisaggLoop[Room, PrefillKVPlane]):
    role = PREFILL
    COUNTERS = {
        "transfers_ok": 0,
        "transfers_failed": 0,
        "bytes_sent": 0,
        "transfer_tail_seconds": 0.0,
    }

    def __init__(self, config: WorkerConfig) -> None:
        super().__init__(config, PrefillScheduler)
        self.unclaimed = Unclaimed(config.transfer_timeout_s)

    def _open_kv_plane(self) -> PrefillKVPlane:
        # The backend's own write timeout is --transfer-timeout-s too: a write to a
        # dead decode worker must fail (and free its pages) within that, not
        # after the backend's built-in default (10 s).
        return PrefillKVPlane(
            self.config.host,
            self.config.bootstrap_port,
            self._kv_backend(write_timeout_s=self.config.transfer_timeout_s),
            self._kv_compat(),
            self.config.cluster_token or "",
            self.engine.runner.pool.config.page_bytes,
            self._open_rank_agents(write_timeout_s=self.config.transfer_timeout_s),
        )

    # -- requests ------------------------------------------------------------

    def prefix_cache(self) -> Any:
        return self.engine.scheduler.cache

    def submit(self, msg: Generate | Prefill, client: bytes) -> None:
        error = param = None
        if not isinstance(msg, Prefill):
            error = "a prefill worker only serves Prefill requests"
        elif msg.room in self.rooms:
            error = f"room {msg.room!r} is already in use"
        elif self.unclaimed.was_cancelled(msg.room):
            # Its reservation is void (the decode engine freed those pages on our
            # AbortAck): prefilling it now would write into pages that may
            # already hold another request's KV.
            self.outbox.put(client, abort_delta(msg.rid))
            return
        elif msg.decode_bootstrap in self.kv.rejected:
            error = self.kv.rejected[msg.decode_bootstrap]
        else:
            try:
                req = self.engine.build_request(msg.rid, msg.prompt_ids, msg.sampling)
            except EngineRequestError as e:
                error, param = str(e), e.param
        if error is not None:
            self._refuse(client, msg.rid, error, param)
            return
        deadline = time.monotonic() + self.config.transfer_timeout_s
        self._open(Room(msg.room, req, msg.decode_bootstrap, deadline), client)

    def _open(self, room: Room, client: bytes) -> None:
        self.rooms.add(room)
        self.clients[room.req.rid] = client
        # The room outlives the request's only delta (its KV is still moving):
        # its stage record stays open until the room is dropped.
        self.stages.set_room(room.req.rid, room.id)
        self.stages.hold(room.req.rid)
        log.debug(
            "rid=%s room=%s: prefill of %d tokens for %s",
            room.req.rid,
            room.id,
            len(room.req.prompt_ids),
            room.decode,
        )
        if self.kv.is_connected(room.decode):
            # A decode engine we already shook hands with: compute at once,
            # push once the reservation is in (its round trip overlaps the
            # compute). A new peer's handshake may still refuse it, and the
            # requester must then get that refusal, not a first token.
            self._schedule(room)
        held = self.unclaimed.claim(room.id)
        if held is not None:
            self._on_reserve(held.decode, held.msg)

    def abort(self, rid: str) -> None:
        room = self.rooms.serving(rid)
        if room is not None:
            self._fail(room, "aborted", aborted=True)

    # -- KV plane --------------------------------------------------------------

    def _on_reserve(self, decode: str, msg: to_prefill.Reserve) -> None:
        room = self.rooms.get(msg.room)
        if room is None:
            self.unclaimed.hold(decode, msg)
            return
        if room.state in STOPPED and decode == room.decode:
            # Stopped before its reservation came: it must not compute now. The
            # decode engine frees the pages on the AbortAck/RoomFailed that
            # closing the room sends.
            log.debug("room %s: Reserve for a stopped room", msg.room)
            return
        if room.state is not PrefillState.AWAITING_RESERVE or decode != room.decode:
            log.warning("room %s: unexpected Reserve from %s", msg.room, decode)
            return
        n_prompt = len(room.req.prompt_ids)
        if not self._fits(msg, n_prompt):
            self._fail(room, f"decode reservation does not fit the prompt ({n_prompt} tokens)")
            return
        room.reserve = msg
        room.sent_upto = msg.decode_prefix_len
        room.deadline = time.monotonic() + self.config.transfer_timeout_s
        self.stages.mark(room.req.rid, RESERVE_RECEIVED)
        if not room.scheduled:
            self._schedule(room)
        computed = room.first is not None
        room.move(PrefillState.SETTLING if computed else PrefillState.COMPUTING)
        # What was computed while the reservation was on its way goes now.
        self._push(room)
        if computed:
            self.stages.mark(room.req.rid, LAST_CHUNK_PUSHED)

    def _schedule(self, room: Room) -> None:
        room.scheduled = True
        self.scheduler.add(room.req)
        self.stages.mark(room.req.rid, ADMITTED)

    def _fits(self, msg: to_prefill.Reserve, n_prompt: int) -> bool:
        """The reservation covers exactly the prompt's pages past a whole-page
        prefix that the decode engine already has."""
        ps = self.engine.runner.pool.page_size
        prefix_pages = msg.decode_prefix_len // ps
        return (
            msg.prompt_len == n_prompt
            and msg.decode_prefix_len % ps == 0
            and prefix_pages + len(msg.dst_pages) == -(-n_prompt // ps)
        )

    def _on_abort_room(self, decode: str, msg: to_prefill.AbortRoom) -> None:
        room = self.rooms.get(msg.room)
        if room is not None and room.decode == decode:
            self._fail(room, f"decode worker aborted the room: {msg.reason}", aborted=True)
            return
        # A reservation that came before its Prefill is void from now on: drop
        # it, and refuse the Prefill if it still comes.
        self.unclaimed.cancel(decode, msg.room)
        self.kv.send(decode, to_decode.AbortAck(msg.room))

    def _push(self, room: Room) -> None:
        """Hand the backend every page touched since the last push (none
        before the reservation: it says where they go)."""
        req, reserve = room.req, room.reserve
        if reserve is None:
            return
        ps = self.engine.runner.pool.page_size
        upto = min(req.num_computed, len(req.prompt_ids))
        if upto <= room.sent_upto:
            return
        first, last = room.sent_upto // ps, -(-upto // ps)
        base = reserve.decode_prefix_len // ps
        src = req.page_table[first:last]
        dst = reserve.dst_pages[first - base : last - base]
        room.handles.append(self.kv.write(room.decode, src, dst))
        self.counters["bytes_sent"] += len(src) * self.kv.page_bytes
        # A partly filled last page is sent again with the next chunk.
        room.sent_upto = (upto // ps) * ps

    def _writes_landed(self, room: Room) -> bool:
        """Poll the room's writes; True when none is in flight."""
        still: list[int] = []
        for h in room.handles:
            state = self.kv.poll_write(h)
            if state == TransferState.PENDING:
                still.append(h)
            elif state == TransferState.FAILED:
                self._fail(room, f"KV transfer to {room.decode} failed")
        room.handles = still
        return not still

    # -- the loop --------------------------------------------------------------

    def step(self) -> list[tuple[bytes, TokenDelta]]:
        events = self.kv.poll()
        for decode, msg in events:
            if isinstance(msg, to_prefill.Reserve):
                self._on_reserve(decode, msg)
            else:
                self._on_abort_room(decode, msg)
        if self.kv.rejected:
            self._fail_rejected()
        batch = self.scheduler.schedule()
        if batch is not None:
            self._run(batch)
        self._end_rooms()
        if batch is None and not events and not self.outbox and self._writing():
            idle_wait()  # only a backend's writes to poll: no socket to wait on
        return self.outbox.take()

    def _writing(self) -> bool:
        return any(room.handles for room in self.rooms)

    def _fail_rejected(self) -> None:
        # Rooms waiting for a decode engine whose handshake was just refused
        # fail now, with the reason (e.g. the mismatching compat field),
        # rather than later with a bare "no KV reservation" timeout.
        for room in self.rooms:
            if room.state is PrefillState.AWAITING_RESERVE and room.decode in self.kv.rejected:
                self._fail(room, self.kv.rejected[room.decode])

    def _run(self, batch: ScheduledBatch) -> None:
        """Compute one batch of chunks and push every page it filled."""
        t0 = time.monotonic()
        results = self.engine.finish(self.engine.launch_batch(batch))
        t1 = time.monotonic()
        rids = [req.rid for req in batch.requests]
        self.stages.forward_started(rids, t0)
        self.stages.forward_finished(rids, t1)
        self.stages.tokens_sampled((r.rid for r in results), t1)
        for r in results:
            room = self._room_of(r.rid)
            room.first = FirstToken(r.token_id, r.logprob, r.finish_reason)
            room.computed_at = time.monotonic()
            if room.state is PrefillState.COMPUTING:
                room.move(PrefillState.SETTLING)
            # else still awaiting the reservation: it settles when that comes.
            self._reply(r.rid, step_delta(r))
        if results and self.deliver is not None:
            # The first tokens leave now, before the pushes below: the
            # requester streams them while the KV is on its way.
            self.deliver(self.outbox.take())
        for req in batch.requests:
            room = self._room_of(req.rid)
            if room.state not in STOPPED:
                self._push(room)
                if room.state is PrefillState.SETTLING:
                    self.stages.mark(req.rid, LAST_CHUNK_PUSHED)

    def _room_of(self, rid: str) -> Room:
        room = self.rooms.serving(rid)
        assert room is not None, f"request {rid!r} was scheduled without a room"
        return room

    def _end_rooms(self) -> None:
        """Time rooms out, and close those with no write in flight."""
        now = time.monotonic()
        timeout = self.config.transfer_timeout_s
        for room in self.rooms:
            if room.state is PrefillState.AWAITING_RESERVE:
                if now > room.deadline:
                    self._fail(
                        room,
                        f"no KV reservation from decode worker {room.decode} within {timeout:g}s",
                    )
                continue
            if room.state is PrefillState.COMPUTING:
                continue
            if not self._writes_landed(room):
                if room.state is PrefillState.SETTLING and now > room.deadline + timeout:
                    self._fail(room, "KV transfer timed out")
                continue
            self._close(room)
        for held in self.unclaimed.expire(now):
            self.kv.send(
                held.decode,
                to_decode.RoomFailed(held.msg.room, "prefill worker never received this room"),
            )

    def _close(self, room: Room) -> None:
        """Tell the decode engine how the room ended (no write of it is in
        flight any more), then let its pages go. A requester that already has
        its first token learns of a failure from the decode side, which streams
        the rest."""
        if room.state is PrefillState.SETTLING:
            self._send_done(room)
        else:
            self.counters["transfers_failed"] += 1
            if room.state is PrefillState.ABORTED:
                self.kv.send(room.decode, to_decode.AbortAck(room.id))
            else:
                self.kv.send(room.decode, to_decode.RoomFailed(room.id, room.error))
        self._drop(room)

    def _send_done(self, room: Room) -> None:
        assert room.first is not None and room.computed_at is not None
        tok, lp, reason = room.first
        cached = max(room.req.num_cached_tokens, 0)
        finish = None if reason == FinishReason.PREFILL_DONE else reason
        self.stages.mark(room.req.rid, WRITES_LANDED)
        self.kv.send(room.decode, to_decode.Done(room.id, tok, lp, cached, finish))
        self.stages.mark(room.req.rid, DONE_SENT)
        room.move(PrefillState.DONE)
        tail = time.monotonic() - room.computed_at
        self.counters["transfers_ok"] += 1
        self.counters["transfer_tail_seconds"] += tail
        log.debug(
            "rid=%s room=%s: KV landed %.1f ms after prefill", room.req.rid, room.id, tail * 1e3
        )

    def _fail(self, room: Room, reason: str, aborted: bool = False) -> None:
        """Stop the room; its pages are released once no write is in flight."""
        if room.state in STOPPED:
            return
        room.move(PrefillState.ABORTED if aborted else PrefillState.FAILED)
        room.error = reason
        req = room.req
        (log.debug if aborted else log.warning)(
            "rid=%s room=%s: %s: %s", req.rid, room.id, "aborted" if aborted else "failed", reason
        )
        # Not released yet: a write in flight may still be reading its pages.
        self.scheduler.detach(req)
        # Only a requester still waiting for its first token gets this: one that
        # has it already was sent its final delta and left ``clients``.
        self._reply(req.rid, abort_delta(req.rid) if aborted else error_delta(req.rid, reason))

    def _drop(self, room: Room) -> None:
        if room.req.page_table:
            self.scheduler.release(room.req)
        self.rooms.remove(room)
        self.engine.forget(room.req.rid)
        self.stages.release(room.req.rid)

    def has_work(self) -> bool:
        # The engine process only calls step() (the one place the KV plane is
        # polled) while this is True. An idle worker must still answer
        # handshakes, Reserve and AbortRoom: otherwise a decode worker that
        # reserves before our Prefill arrives, or aborts a room we never got,
        # waits out its timeouts and then drops this (healthy) peer.
        # The outbox too: a Prefill refused in submit() (room in use, rejected
        # decode worker, invalid request) is answered only by the next step().
        return bool(self.rooms) or self.busy()

    def busy(self) -> bool:
        # ``has_work`` less the rooms that only wait: those awaiting their
        # reservation wait for the KV plane's socket (rooms with writes in
        # flight must be polled, so they count).
        return bool(
            self.outbox
            or self.scheduler.has_work()
            or self.unclaimed.needs_steps()
            or self.kv.has_pending()
            or self._writing()
        )

    def wait_sockets(self) -> list[Any]:
        return self.kv.sockets()

    def _room_stats(self) -> dict[str, int]:
        return {"rooms": len(self.rooms)}
