"""Stage timing of the gateway's requests: one ``RequestTrace`` per choice.

The routes stamp when the request came in and was tokenized; the dispatcher
when it handed the request to its worker(s), the worker client when the first
token's frame was read; the response writer when the first chunk with text
was written and when the response ended. The workers' own stages arrive on
their final deltas (``TokenDelta.stages``, offsets on each worker's clock).
``StageMetrics.finish`` turns a trace into histograms (its own durations and
the workers', by role), one DEBUG line and, when configured, spans.
"""

from __future__ import annotations

import logging
from contextvars import ContextVar

from protocol.prometheus import HistogramFamily
from protocol.stages import (
    FINISHED,
    GATEWAY_INTERVALS,
    TOKENIZED,
    WORKER_INTERVALS,
    StageClock,
    durations,
    format_durations,
)
from protocol.tracing import StageSpans

log = logging.getLogger("gateway.stages")

current_trace: ContextVar[RequestTrace | None] = ContextVar("gateway_trace", default=None)
"""The trace of the choice whose stream the current task is running: set by
the choice's stream, read by the dispatcher below it (whose interface stays
that of any token source)."""


class RequestTrace:
    """The stages of one choice in the gateway and what its workers reported."""

    __slots__ = ("clock", "rid", "room", "workers", "reports")

    def __init__(self, received: float, tokenized: float) -> None:
        self.clock = StageClock(received)
        self.clock.mark(TOKENIZED, tokenized)
        self.rid = ""
        """The request id the workers saw (of the last attempt)."""
        self.room = ""
        self.workers: dict[str, str] = {}
        """Role -> URL of the workers of the last attempt."""
        self.reports: dict[str, dict[str, float]] = {}
        """Role -> that worker's stages (offsets on its own clock)."""

    def mark(self, stage: str, at: float | None = None) -> None:
        self.clock.mark(stage, at)

    def report(self, role: str, offsets: dict[str, float]) -> None:
        self.reports[role] = offsets


class StageMetrics:
    """The gateway's stage histograms, and where finished traces go."""

    def __init__(self, spans: StageSpans | None = None) -> None:
        self.spans = spans
        self.gateway = HistogramFamily(
            "gateway_stage_seconds",
            "time between two stages of a request in the gateway (see protocol.stages)",
            ("stage",),
        )
        self.workers = HistogramFamily(
            "gateway_worker_stage_seconds",
            "time between two stages of a request in its worker, as the worker reported "
            "it (its own clock)",
            ("role", "stage"),
        )

    def finish(self, trace: RequestTrace, ok: bool) -> None:
        """The choice ended (``ok``: normally, not by an error or a timeout)."""
        trace.mark(FINISHED)
        own = durations(trace.clock.stamps, GATEWAY_INTERVALS)
        theirs = {
            role: durations(offsets, WORKER_INTERVALS) for role, offsets in trace.reports.items()
        }
        if ok:
            for name, seconds in own.items():
                self.gateway.observe((name,), seconds)
            for role, values in theirs.items():
                for name, seconds in values.items():
                    self.workers.observe((role, name), seconds)
        if log.isEnabledFor(logging.DEBUG):
            parts = [f"gateway: {format_durations(own)}"]
            parts += [f"{role}: {format_durations(v)}" for role, v in sorted(theirs.items())]
            log.debug("rid=%s room=%s ok=%s %s", trace.rid, trace.room or "-", ok, "; ".join(parts))
        if self.spans is not None and trace.rid:
            attrs = {f"worker.{role}": url for role, url in trace.workers.items()}
            if trace.room:
                attrs["room"] = trace.room
            try:
                self.spans.emit(trace.rid, trace.clock.stamps, GATEWAY_INTERVALS, attrs)
            except Exception:  # tracing must never fail a request
                log.exception("could not write the spans of %s", trace.rid)

    def render(self) -> list[str]:
        return self.gateway.render() + self.workers.render()
