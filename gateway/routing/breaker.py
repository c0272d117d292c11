"""Per-worker circuit breaker over request outcomes."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import ClassVar

log = logging.getLogger("gateway.router")

Clock = Callable[[], float]
"""A monotonic clock in seconds (``time.monotonic``, or a fake in tests)."""


class CircuitBreaker:
    """Per-worker breaker over request outcomes.

    closed --(``failure_threshold`` failures in a row)--> open
    open --(``cooldown_s`` elapsed)--> half_open
    half_open: lets one trial request through; its success closes the breaker,
    its failure re-opens it (and restarts the cooldown).
    """

    CLOSED: ClassVar[str] = "closed"
    OPEN: ClassVar[str] = "open"
    HALF_OPEN: ClassVar[str] = "half_open"

    def __init__(
        self, failure_threshold: int = 5, cooldown_s: float = 10.0, clock: Clock = time.monotonic
    ) -> None:
        if failure_threshold < 1:
            raise ValueError("failure_threshold must be >= 1")
        self.failure_threshold = failure_threshold
        self.cooldown_s = cooldown_s
        self.clock = clock
        self.failures = 0
        """Failed requests in a row (reset by a success)."""
        self._state = self.CLOSED
        self._opened_at = 0.0
        self._trial_in_flight = False

    @property
    def state(self) -> str:
        if self._state == self.OPEN and self.clock() - self._opened_at >= self.cooldown_s:
            self._state = self.HALF_OPEN
            self._trial_in_flight = False
        return self._state

    def allows(self) -> bool:
        """Whether a new request may go to the worker now. Does not consume the
        half-open trial (``on_request`` does)."""
        state = self.state
        if state == self.CLOSED:
            return True
        return state == self.HALF_OPEN and not self._trial_in_flight

    def on_request(self) -> None:
        """A request was sent to the worker."""
        if self.state == self.HALF_OPEN:
            self._trial_in_flight = True

    def record(self, ok: bool) -> None:
        """A request to the worker ended, well (``ok``) or not."""
        state = self.state
        if ok:
            if state != self.CLOSED:
                log.info("circuit breaker closes after a successful request")
            self._state = self.CLOSED
            self.failures = 0
            self._trial_in_flight = False
            return
        self.failures += 1
        if state == self.HALF_OPEN or (
            state == self.CLOSED and self.failures >= self.failure_threshold
        ):
            self._open()

    def _open(self) -> None:
        self._state = self.OPEN
        self._opened_at = self.clock()
        self._trial_in_flight = False

    def __repr__(self) -> str:
        return f"CircuitBreaker(state={self.state!r}, failures={self.failures})"
