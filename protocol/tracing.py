"""Optional OpenTelemetry spans of a request's stages. Torch-free.

Off unless the environment variable ``DISAGG_SERVE_OTEL`` is set to a true
value ("1", "true", "yes", "on") and the ``opentelemetry`` API is importable.
Spans are built after the fact from one process's stage stamps: one span for
the request in that process (from ``received`` to its last stage) with one
child span per reported interval, their start and end times converted from the
monotonic clock to wall-clock nanoseconds.

Every process derives the trace id (and a shared parent span id) from the
request id the workers see, so the gateway's, the prefill worker's and the
decode worker's spans of one request join one trace with no trace context on
the wire. Exporting is the OpenTelemetry SDK's job: the process must have a
tracer provider with an exporter configured (for example by running it under
``opentelemetry-instrument``, whose configuration the worker's spawned engine
process inherits through the environment); with the API alone spans are
no-ops.
"""

from __future__ import annotations

import hashlib
import logging
import os
import time
from collections.abc import Iterable, Mapping
from typing import Any

from protocol.stages import RECEIVED, Interval, durations

log = logging.getLogger(__name__)

ENV = "DISAGG_SERVE_OTEL"
_TRUE = frozenset({"1", "true", "yes", "on"})


def trace_ids(rid: str) -> tuple[int, int]:
    """(trace id, parent span id) of request ``rid``: the same in every process."""
    digest = hashlib.sha256(rid.encode()).digest()
    return int.from_bytes(digest[:16], "big") or 1, int.from_bytes(digest[16:24], "big") or 1


class StageSpans:
    """Writes a request's stages as spans through an OpenTelemetry tracer."""

    def __init__(self, tracer: Any, process: str) -> None:
        self.tracer = tracer
        self.process = process

    @classmethod
    def from_env(cls, process: str) -> StageSpans | None:
        """The hook when ``DISAGG_SERVE_OTEL`` asks for it and the API is there."""
        if os.environ.get(ENV, "").strip().lower() not in _TRUE:
            return None
        try:
            from opentelemetry import trace
        except ImportError:
            log.warning("%s is set but opentelemetry is not installed: no spans", ENV)
            return None
        return cls(trace.get_tracer("disagg-serve"), process)

    def emit(
        self,
        rid: str,
        stamps: Mapping[str, float],
        intervals: Iterable[Interval],
        attributes: Mapping[str, Any] | None = None,
    ) -> None:
        """Spans of one request's ``stamps`` (this process's monotonic clock)."""
        from opentelemetry.trace import (
            NonRecordingSpan,
            SpanContext,
            TraceFlags,
            set_span_in_context,
        )

        offset = time.time_ns() - time.monotonic_ns()

        def ns(t: float) -> int:
            return int(t * 1e9) + offset

        trace_id, parent_id = trace_ids(rid)
        parent = NonRecordingSpan(
            SpanContext(trace_id, parent_id, is_remote=True, trace_flags=TraceFlags(1))
        )
        attrs = {"request.id": rid, "process": self.process, **(attributes or {})}
        root = self.tracer.start_span(
            self.process,
            context=set_span_in_context(parent),
            start_time=ns(stamps[RECEIVED]),
            attributes=attrs,
        )
        inner = set_span_in_context(root)
        intervals = list(intervals)
        for iv in intervals:
            if iv.name not in durations(stamps, [iv]):
                continue
            span = self.tracer.start_span(
                iv.name, context=inner, start_time=ns(stamps[iv.start]), attributes=attrs
            )
            span.end(end_time=ns(max(stamps[iv.start], stamps[iv.end])))
        root.end(end_time=ns(max(stamps.values())))
