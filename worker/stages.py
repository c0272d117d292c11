"""Stage timing of the requests in one worker's engine process.

The engine server opens a request's record when the request arrives and
stamps what it sees on the request plane (first token sent, final delta sent);
the loop stamps what happens inside (admitted, forwards, first token, the KV
path). A record closes when the request's final delta is sent, or, for a
record the loop holds (a prefill room, whose KV still moves after its only
delta), when the loop lets it go. Closing observes the record's intervals in
the worker's stage histograms (requests that ended normally only), writes one
DEBUG line and, when configured, OpenTelemetry spans.

Cost: a few dict operations per request and stage; per token only a set
lookup while some request still waits for its first forward or first token.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Iterable

import msgspec

from protocol.finish import ENDED, FinishReason
from protocol.prometheus import HistogramFamily
from protocol.stages import (
    FINISHED,
    FIRST_TOKEN,
    FIRST_TOKEN_SENT,
    FORWARD_FINISHED,
    FORWARD_STARTED,
    WORKER_INTERVALS,
    StageClock,
    durations,
    format_durations,
)
from protocol.to_gateway import TokenDelta
from protocol.tracing import StageSpans

log = logging.getLogger("worker.stages")

_ENDED_WELL = ENDED | {FinishReason.PREFILL_DONE}
"""Final reasons whose requests count in the histograms (not aborts or errors)."""


class StageBook:
    """Open stage records by request id, and the histograms of closed ones."""

    def __init__(self, role: str, spans: StageSpans | None = None) -> None:
        self.role = role
        self.spans = spans
        self.clocks: dict[str, StageClock] = {}
        self.rooms: dict[str, str] = {}
        """rid -> room, for the log line and the spans of disaggregated requests."""
        self.histograms = HistogramFamily(
            "worker_stage_seconds",
            "time between two stages of a request in this worker (see protocol.stages)",
            ("stage",),
        )
        self._awaiting_forward: set[str] = set()
        self._awaiting_finish: set[str] = set()
        self._awaiting_token: set[str] = set()
        self._awaiting_send: set[str] = set()
        self._held: set[str] = set()
        self._final: dict[str, str] = {}
        """Held records whose final delta is out: rid -> its finish reason."""

    # -- stamps ------------------------------------------------------------------

    def open(self, rid: str, received: float) -> None:
        self.clocks[rid] = StageClock(received)
        self._awaiting_forward.add(rid)
        self._awaiting_token.add(rid)
        self._awaiting_send.add(rid)

    def mark(self, rid: str, stage: str, at: float | None = None) -> None:
        clock = self.clocks.get(rid)
        if clock is not None:
            clock.mark(stage, at)

    def set_room(self, rid: str, room: str) -> None:
        if rid in self.clocks:
            self.rooms[rid] = room

    def forward_started(self, rids: Iterable[str], at: float) -> None:
        """A forward over these requests was launched at ``at``."""
        waiting = self._awaiting_forward
        if waiting:
            for rid in rids:
                if rid in waiting:
                    waiting.discard(rid)
                    self._awaiting_finish.add(rid)
                    self.mark(rid, FORWARD_STARTED, at)

    def forward_finished(self, rids: Iterable[str], at: float) -> None:
        """The forward over these requests (launched earlier) ended at ``at``."""
        waiting = self._awaiting_finish
        if waiting:
            for rid in rids:
                if rid in waiting:
                    waiting.discard(rid)
                    self.mark(rid, FORWARD_FINISHED, at)

    def tokens_sampled(self, rids: Iterable[str], at: float) -> None:
        """These requests got a token from a forward that ended at ``at``."""
        waiting = self._awaiting_token
        if waiting:
            for rid in rids:
                if rid in waiting:
                    waiting.discard(rid)
                    self.mark(rid, FIRST_TOKEN, at)

    def hold(self, rid: str) -> None:
        """Keep the record open past its final delta, until ``release``."""
        if rid in self.clocks:
            self._held.add(rid)

    def release(self, rid: str) -> None:
        self._held.discard(rid)
        reason = self._final.pop(rid, None)
        if reason is not None:
            self._close(rid, reason)

    # -- the request plane ---------------------------------------------------------

    def on_send(self, deltas: list[TokenDelta], at: float) -> list[TokenDelta]:
        """Stamp the deltas about to be sent: a first token sent, a final delta
        (which carries the worker's stages to the requester)."""
        awaiting = self._awaiting_send
        for i, d in enumerate(deltas):
            if d.finish_reason is None:
                if awaiting and d.token_ids and d.rid in awaiting:
                    awaiting.discard(d.rid)
                    self.mark(d.rid, FIRST_TOKEN_SENT, at)
                continue
            clock = self.clocks.get(d.rid)
            if clock is None:
                continue
            if d.token_ids and d.rid in awaiting:
                awaiting.discard(d.rid)
                clock.mark(FIRST_TOKEN_SENT, at)
            clock.mark(FINISHED, at)
            deltas[i] = msgspec.structs.replace(d, stages=clock.offsets())
            if d.rid in self._held:
                self._final[d.rid] = d.finish_reason
            else:
                self._close(d.rid, d.finish_reason)
        return deltas

    def _close(self, rid: str, reason: str) -> None:
        clock = self.clocks.pop(rid, None)
        room = self.rooms.pop(rid, None)
        for pending in (
            self._awaiting_forward,
            self._awaiting_finish,
            self._awaiting_token,
            self._awaiting_send,
        ):
            pending.discard(rid)
        if clock is None:
            return
        # A held record ends later than its final delta: FINISHED is when it closed.
        clock.stamps[FINISHED] = max(clock.stamps[FINISHED], time.monotonic())
        spans = durations(clock.stamps, WORKER_INTERVALS)
        if reason in _ENDED_WELL:
            for name, seconds in spans.items():
                self.histograms.observe((name,), seconds)
        if log.isEnabledFor(logging.DEBUG):
            log.debug(
                "rid=%s room=%s role=%s finish=%s stages: %s",
                rid,
                room or "-",
                self.role,
                reason,
                format_durations(spans),
            )
        if self.spans is not None:
            attrs = {"role": self.role, "finish_reason": str(reason)}  # a plain str
            if room:
                attrs["room"] = room
            try:
                self.spans.emit(rid, clock.stamps, WORKER_INTERVALS, attrs)
            except Exception:  # tracing must never fail a request
                log.exception("could not write the spans of %s", rid)

    def __len__(self) -> int:
        return len(self.clocks)
