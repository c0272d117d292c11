"""The ``status`` of a worker's GET /health answer, which the gateway's health
checks read (torch-free)."""

from __future__ import annotations

from enum import StrEnum


class HealthStatus(StrEnum):
    OK = "ok"
    """200: the worker takes requests."""
    DRAINING = "draining"
    """503: the worker is stopping; its in-flight requests may still finish,
    it takes no new ones (the gateway takes it out of routing at once)."""
    UNAVAILABLE = "unavailable"
    """503: the engine process is gone or does not answer (``reason`` says why)."""
