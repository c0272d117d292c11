"""Engine-process loop of a prefill worker.

A ``Prefill`` request waits for its decode engine's ``Reserve`` (no KV is
computed without a destination), then runs in chunks; after every step the
newly computed pages are pushed into the decode engine's reserved pages. The
first token goes to the requester at once; ``Done`` goes to the decode engine
once every write of the room has landed, and only then do the pages return to
the prefix cache.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field

from engine.engine import Engine
from engine.request import EngineRequestError, Request
from kvtransfer import to_decode, to_prefill
from kvtransfer.backend import TransferState
from kvtransfer.prefill_side import PrefillKVPlane
from prefill_server.scheduler import PREFILL_DONE, PrefillScheduler
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
    decode: str
    deadline: float
    reserve: to_prefill.Reserve | None = None
    sent_upto: int = 0
    """Prompt tokens whose KV has been handed to the backend."""
    handles: list[int] = field(default_factory=list)
    first: tuple[int, float, str | None] | None = None
    """(token, logprob, finish_reason) once prefill is done."""
    failed: str | None = None
    aborted: bool = False
    computed_at: float | None = None
    """When the prompt's last chunk was computed (the KV transfer's tail starts)."""


class PrefillLoop(WorkerLoop):
    def __init__(self, config: WorkerConfig) -> None:
        super().__init__(config)
        self.engine = Engine(config.engine_config(), PrefillScheduler)
        self.scheduler = self.engine.scheduler
        # The backend's own write timeout is --transfer-timeout-s too: a write to a
        # dead decode worker must fail (and free its pages) within that, not
        # after the backend's built-in default (10 s).
        backend = kv_backend(
            self.engine,
            config.transfer_backend,
            "prefill",
            config.host,
            timeout=config.transfer_timeout_s,
        )
        self.kv = PrefillKVPlane(
            config.host,
            config.bootstrap_port,
            backend,
            engine_compat(self.engine, config.transfer_backend),
            config.cluster_token or "",
            self.engine.runner.pool.config.page_bytes,
        )
        self.rooms: dict[str, Room] = {}
        self.by_rid: dict[str, Room] = {}
        self.early: dict[str, tuple[str, to_prefill.Reserve, float]] = {}
        """Reservations that arrived before their Prefill request."""
        self.cancelled: dict[str, float] = {}
        """Rooms the decode engine aborted before their Prefill request came:
        room -> until when a late Prefill for it is refused."""
        self.outbox: list[tuple[bytes, TokenDelta]] = []
        self.stats_counters: dict[str, float] = {
            "transfers_ok": 0,
            "transfers_failed": 0,
            "bytes_sent": 0,
            "transfer_tail_seconds": 0.0,
        }

    @property
    def bootstrap_endpoint(self) -> str | None:
        return self.kv.endpoint

    # -- requests ------------------------------------------------------------

    def submit(self, msg: Generate | Prefill, client: bytes) -> None:
        error = None
        if not isinstance(msg, Prefill):
            error = "a prefill worker only serves Prefill requests"
        elif msg.room in self.rooms:
            error = f"room {msg.room!r} is already in use"
        elif self._was_cancelled(msg.room):
            # Its reservation is void (the decode engine freed those pages on our
            # AbortAck): prefilling it now would write into pages that may
            # already hold another request's KV.
            self.outbox.append((client, TokenDelta(msg.rid, [], [], "abort", 0)))
            return
        elif msg.decode_bootstrap in self.kv.rejected:
            error = self.kv.rejected[msg.decode_bootstrap]
        else:
            try:
                req = self.engine.build_request(msg.rid, msg.prompt_ids, msg.sampling)
            except EngineRequestError as e:
                error = str(e)
        if error is not None:
            self.outbox.append((client, error_delta(msg.rid, error)))
            return
        room = Room(
            msg.room,
            req,
            client,
            msg.decode_bootstrap,
            time.monotonic() + self.config.transfer_timeout_s,
        )
        self.rooms[msg.room] = room
        self.by_rid[msg.rid] = room
        log.debug(
            "rid=%s room=%s: prefill of %d tokens for %s",
            msg.rid,
            msg.room,
            len(msg.prompt_ids),
            msg.decode_bootstrap,
        )
        early = self.early.pop(msg.room, None)
        if early is not None:
            self._on_reserve(early[0], early[1])

    def _was_cancelled(self, room: str) -> bool:
        until = self.cancelled.pop(room, None)
        return until is not None and time.monotonic() <= until

    def abort(self, rid: str) -> None:
        room = self.by_rid.get(rid)
        if room is not None:
            self._fail(room, "aborted", aborted=True)

    # -- KV plane --------------------------------------------------------------

    def _on_reserve(self, decode: str, msg: to_prefill.Reserve) -> None:
        room = self.rooms.get(msg.room)
        if room is None:
            self.early[msg.room] = (decode, msg, time.monotonic() + self.config.transfer_timeout_s)
            return
        if room.reserve is not None or decode != room.decode:
            log.warning("room %s: unexpected Reserve from %s", msg.room, decode)
            return
        n_prompt = len(room.req.prompt_ids)
        ps = self.engine.runner.pool.page_size
        prefix_pages = msg.decode_prefix_len // ps
        if (
            msg.prompt_len != n_prompt
            or msg.decode_prefix_len % ps
            or prefix_pages + len(msg.dst_pages) != -(-n_prompt // ps)
        ):
            self._fail(room, f"decode reservation does not fit the prompt ({n_prompt} tokens)")
            return
        room.reserve = msg
        room.sent_upto = msg.decode_prefix_len
        room.deadline = time.monotonic() + self.config.transfer_timeout_s
        self.scheduler.add(room.req)

    def _push(self, room: Room) -> None:
        """Hand the backend every page touched since the last push."""
        req, reserve = room.req, room.reserve
        assert reserve is not None
        ps = self.engine.runner.pool.page_size
        upto = min(req.num_computed, len(req.prompt_ids))
        if upto <= room.sent_upto:
            return
        first, last = room.sent_upto // ps, -(-upto // ps)
        base = reserve.decode_prefix_len // ps
        src = req.page_table[first:last]
        dst = reserve.dst_pages[first - base : last - base]
        room.handles.append(self.kv.write(room.decode, src, dst))
        self.stats_counters["bytes_sent"] += len(src) * self.kv.page_bytes
        # A partly filled last page is sent again with the next chunk.
        room.sent_upto = (upto // ps) * ps

    def _settle(self, room: Room) -> bool:
        """Poll the room's writes; True when none is in flight."""
        still: list[int] = []
        for h in room.handles:
            state = self.kv.poll_write(h)
            if state == TransferState.PENDING:
                still.append(h)
            elif state == TransferState.FAILED and room.failed is None:
                room.failed = f"KV transfer to {room.decode} failed"
        room.handles = still
        return not still

    # -- the loop --------------------------------------------------------------

    def step(self) -> list[tuple[bytes, TokenDelta]]:
        events = self.kv.poll()
        for decode, msg in events:
            if isinstance(msg, to_prefill.Reserve):
                self._on_reserve(decode, msg)
            else:
                room = self.rooms.get(msg.room)
                if room is not None and room.decode == decode:
                    self._fail(room, f"decode worker aborted the room: {msg.reason}", aborted=True)
                else:
                    early = self.early.get(msg.room)
                    if early is not None and early[0] == decode:
                        # A reservation that came before its Prefill is void from
                        # now on: drop it, and refuse the Prefill if it still comes.
                        del self.early[msg.room]
                        until = time.monotonic() + self.config.transfer_timeout_s
                        self.cancelled[msg.room] = until
                    self.kv.send(decode, to_decode.AbortAck(msg.room))
        if self.kv.rejected:
            # Rooms waiting for a decode engine whose handshake was just refused
            # fail now, with the reason (e.g. the mismatching compat field),
            # rather than later with a bare "no KV reservation" timeout.
            for room in list(self.rooms.values()):
                if room.reserve is None and room.failed is None and room.decode in self.kv.rejected:
                    self._fail(room, self.kv.rejected[room.decode])
        batch = self.scheduler.schedule()
        if batch is not None:
            for r in self.engine.finish(self.engine.launch_batch(batch)):
                room = self.by_rid[r.rid]
                room.first = (r.token_id, r.logprob, r.finish_reason)
                room.computed_at = time.monotonic()
                # The first token reaches the requester before the transfer ends.
                self.outbox.append((room.client, step_delta(r)))
            for req in batch.requests:
                room = self.by_rid[req.rid]
                if room.failed is None:
                    self._push(room)
        self._finish_rooms()
        if batch is None and not events and not self.outbox:
            idle_wait()
        out, self.outbox = self.outbox, []
        return out

    def _finish_rooms(self) -> None:
        now = time.monotonic()
        for room in list(self.rooms.values()):
            if room.reserve is None and room.failed is None and now > room.deadline:
                self._fail(
                    room,
                    f"no KV reservation from decode worker {room.decode} within "
                    f"{self.config.transfer_timeout_s:g}s",
                )
                continue
            if room.first is None and room.failed is None:
                continue
            if not self._settle(room):
                if now > room.deadline + self.config.transfer_timeout_s and room.failed is None:
                    room.failed = "KV transfer timed out"
                continue
            if room.failed is None:
                tok, lp, reason = room.first
                self.kv.send(
                    room.decode,
                    to_decode.Done(
                        room.room,
                        tok,
                        lp,
                        max(room.req.num_cached_tokens, 0),
                        None if reason == PREFILL_DONE else reason,
                    ),
                )
                self.stats_counters["transfers_ok"] += 1
                tail = 0.0 if room.computed_at is None else time.monotonic() - room.computed_at
                self.stats_counters["transfer_tail_seconds"] += tail
                log.debug(
                    "rid=%s room=%s: KV landed %.1f ms after prefill",
                    room.req.rid,
                    room.room,
                    tail * 1e3,
                )
            else:
                self.stats_counters["transfers_failed"] += 1
                if room.aborted:
                    self.kv.send(room.decode, to_decode.AbortAck(room.room))
                else:
                    self.kv.send(room.decode, to_decode.RoomFailed(room.room, room.failed))
            # A requester that already has its first token learns of a failure
            # from the decode side, which streams the rest.
            self._drop(room)
        for r, until in list(self.cancelled.items()):
            if now > until:
                del self.cancelled[r]
        for r, (decode, _msg, deadline) in list(self.early.items()):
            if now > deadline:
                del self.early[r]
                self.kv.send(
                    decode, to_decode.RoomFailed(r, "prefill worker never received this room")
                )

    def _fail(self, room: Room, reason: str, aborted: bool = False) -> None:
        """Stop the room; its pages are released once no write is in flight."""
        if room.failed is not None:
            return
        room.failed = reason
        room.aborted = aborted
        req = room.req
        (log.debug if aborted else log.warning)(
            "rid=%s room=%s: %s: %s", req.rid, room.room, "aborted" if aborted else "failed", reason
        )
        if req in self.scheduler.waiting:
            self.scheduler.waiting.remove(req)
        elif req in self.scheduler.running:
            self.scheduler.running.remove(req)
        if room.first is None:
            room.first = (-1, 0.0, "abort" if aborted else "error")
            kind = "abort" if aborted else "error"
            delta = TokenDelta(req.rid, [], [], kind, 0, None if aborted else reason)
            self.outbox.append((room.client, delta))

    def _drop(self, room: Room) -> None:
        if room.req.page_table:
            self.scheduler.release(room.req)
        self.rooms.pop(room.room, None)
        self.by_rid.pop(room.req.rid, None)
        self.engine.forget(room.req.rid)

    def has_work(self) -> bool:
        # The engine process only calls step() (the one place the KV plane is
        # polled) while this is True. An idle worker must still answer
        # handshakes, Reserve and AbortRoom: otherwise a decode worker that
        # reserves before our Prefill arrives, or aborts a room we never got,
        # waits out its timeouts and then drops this (healthy) peer.
        # The outbox too: a Prefill refused in submit() (room in use, rejected
        # decode worker, invalid request) is answered only by the next step().
        return bool(
            self.rooms
            or self.early
            or self.outbox
            or self.scheduler.has_work()
            or self.kv.has_pending()
        )

    def stats(self) -> dict:
        return {
            **engine_stats(self.engine, "prefill"),
            "rooms": len(self.rooms),
            **self.stats_counters,
        }

    def close(self) -> None:
        self.kv.close()
