"""The decode side of a room: one Generate request whose prompt KV a prefill
worker writes into pages reserved here."""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum

from engine.request import Request


class DecodeState(Enum):
    WAITING_PAGES = "waiting_pages"
    """Queued (FIFO) until the pool can hold the prompt; holds no page and has
    sent nothing to the prefill worker."""
    TRANSFERRING = "transferring"
    """Pages reserved and ``Reserve`` sent: the prefill worker writes into them
    until it sends ``Done`` (or fails the room)."""
    DRAINING = "draining"
    """The request has ended but a write may still land in its pages: they are
    held until the prefill worker confirms (``AbortAck``/``RoomFailed``) or is
    known to be gone."""
    DECODING = "decoding"
    """Every page landed: the request decodes in the scheduler's running batch
    (the room's part is over)."""
    CLOSED = "closed"
    """Ended; its pages, if it had any, are back in the pool."""


_MOVES: dict[DecodeState, frozenset[DecodeState]] = {
    DecodeState.WAITING_PAGES: frozenset({DecodeState.TRANSFERRING, DecodeState.CLOSED}),
    DecodeState.TRANSFERRING: frozenset(
        {DecodeState.DECODING, DecodeState.DRAINING, DecodeState.CLOSED}
    ),
    DecodeState.DRAINING: frozenset({DecodeState.CLOSED}),
    DecodeState.DECODING: frozenset(),
    DecodeState.CLOSED: frozenset(),
}


@dataclass(eq=False)
class Room:
    id: str
    req: Request
    prefill: str
    """Bootstrap endpoint of the prefill worker that writes the KV."""
    deadline: float
    """Transferring: when to give up on the KV. Draining: when to presume the
    prefill worker dead."""
    state: DecodeState = DecodeState.WAITING_PAGES

    def move(self, to: DecodeState) -> None:
        """The one place a room changes state; an illegal move is a bug."""
        if to not in _MOVES[self.state]:
            raise RuntimeError(f"room {self.id!r}: no move from {self.state.name} to {to.name}")
        self.state = to
