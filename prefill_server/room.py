"""The prefill side of a room: one Prefill request whose KV goes into pages a
decode worker reserved for it, and the KV-plane news about rooms whose Prefill
has not come yet."""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from enum import Enum
from typing import NamedTuple

from engine.request import Request
from kvtransfer import to_prefill
from protocol.finish import FinishReason


class PrefillState(Enum):
    AWAITING_RESERVE = "awaiting_reserve"
    """Nothing is pushed until the decode worker's ``Reserve`` says where the
    KV goes. For a decode engine already handshaken the request computes
    meanwhile (``Room.scheduled``; it may even have its first token out): the
    reservation's round trip overlaps the compute."""
    COMPUTING = "computing"
    """Reserved: in the scheduler, each computed chunk pushed as it lands."""
    SETTLING = "settling"
    """The last chunk is computed and the first token is out; writes are in
    flight. ``Done`` goes out once every one has landed."""
    DONE = "done"
    """``Done`` sent; the pages went back to the prefix cache."""
    FAILED = "failed"
    """Stopped by an error; held until no write is in flight, then
    ``RoomFailed`` goes out and the pages are released."""
    ABORTED = "aborted"
    """Stopped by the requester or the decode worker; held until no write is in
    flight, then ``AbortAck`` goes out and the pages are released."""


_MOVES: dict[PrefillState, frozenset[PrefillState]] = {
    PrefillState.AWAITING_RESERVE: frozenset(
        {PrefillState.COMPUTING, PrefillState.SETTLING, PrefillState.FAILED, PrefillState.ABORTED}
    ),
    PrefillState.COMPUTING: frozenset(
        {PrefillState.SETTLING, PrefillState.FAILED, PrefillState.ABORTED}
    ),
    PrefillState.SETTLING: frozenset(
        {PrefillState.DONE, PrefillState.FAILED, PrefillState.ABORTED}
    ),
    PrefillState.DONE: frozenset(),
    PrefillState.FAILED: frozenset(),
    PrefillState.ABORTED: frozenset(),
}

STOPPED = frozenset({PrefillState.FAILED, PrefillState.ABORTED})
"""States of a room that will not compute or push again."""


class FirstToken(NamedTuple):
    """What prefill hands to decode in ``Done``."""

    token_id: int
    logprob: float
    finish_reason: FinishReason | None


@dataclass(eq=False)
class Room:
    id: str
    req: Request
    decode: str
    """Bootstrap endpoint of the decode worker that holds the pages."""
    deadline: float
    """Awaiting reserve: when to give up on it. Later: when the reservation
    came, plus the transfer timeout; writes get one more timeout after that."""
    state: PrefillState = PrefillState.AWAITING_RESERVE
    scheduled: bool = False
    """Handed to the scheduler (before its reservation, for a known peer)."""
    reserve: to_prefill.Reserve | None = None
    sent_upto: int = 0
    """Prompt tokens whose KV has been handed to the backend."""
    handles: list[int] = field(default_factory=list)
    """Backend writes of this room not yet seen to end."""
    first: FirstToken | None = None
    computed_at: float | None = None
    """When the prompt's last chunk was computed (the KV transfer's tail starts)."""
    error: str = ""
    """Why the room stopped (failed or aborted)."""

    def move(self, to: PrefillState) -> None:
        """The one place a room changes state; an illegal move is a bug."""
        if to not in _MOVES[self.state]:
            raise RuntimeError(f"room {self.id!r}: no move from {self.state.name} to {to.name}")
        self.state = to


class HeldReserve(NamedTuple):
    """A ``Reserve`` that came before its Prefill request."""

    decode: str
    msg: to_prefill.Reserve
    deadline: float


class Unclaimed:
    """KV-plane news about rooms this worker has not been sent yet.

    A decode worker may reserve (and even abort) a room before the gateway's
    Prefill for it arrives here. A held reservation is claimed by that Prefill;
    one the decode worker aborted is void: its pages may already hold another
    request's KV, so a late Prefill for that room must be refused."""

    def __init__(self, ttl_s: float) -> None:
        self.ttl_s = ttl_s
        self.reserves: dict[str, HeldReserve] = {}
        self.cancelled: dict[str, float] = {}
        """Room -> until when a late Prefill for it is refused."""

    def hold(self, decode: str, msg: to_prefill.Reserve) -> None:
        self.reserves[msg.room] = HeldReserve(decode, msg, time.monotonic() + self.ttl_s)

    def claim(self, room_id: str) -> HeldReserve | None:
        return self.reserves.pop(room_id, None)

    def cancel(self, decode: str, room_id: str) -> None:
        """``decode`` aborted ``room_id``: void its held reservation, if any."""
        held = self.reserves.get(room_id)
        if held is not None and held.decode == decode:
            del self.reserves[room_id]
            self.cancelled[room_id] = time.monotonic() + self.ttl_s

    def was_cancelled(self, room_id: str) -> bool:
        """True (once) if a Prefill for ``room_id`` must be refused."""
        until = self.cancelled.pop(room_id, None)
        return until is not None and time.monotonic() <= until

    def expire(self, now: float) -> list[HeldReserve]:
        """Forget what is past its time; returns the reservations given up."""
        for room_id, until in list(self.cancelled.items()):
            if now > until:
                del self.cancelled[room_id]
        expired = [h for h in self.reserves.values() if now > h.deadline]
        for h in expired:
            del self.reserves[h.msg.room]
        return expired

    def needs_steps(self) -> bool:
        # A held reservation expires with a message to its decode worker, which
        # only a step sends; a cancellation just lapses.
        return bool(self.reserves)
