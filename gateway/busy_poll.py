"""Keeping the gateway's event loop awake while its requests are in flight.

An asyncio loop with nothing to do sleeps in ``epoll_wait``; the next frame
from a worker (a first token) or the next HTTP request then waits for the CPU
to wake, which on a virtualized host costs a few tenths of a millisecond per
wake-up (docs/perf/2026-12-01-ttft-path.md), and twice
for each request (its arrival, its first token). While a few requests are in
flight, and for ``linger_s`` after the last one ended, a task here hands
control back to the loop at once, over and over, so the loop polls instead of
sleeping. That spins one core for as long; ``linger_s = 0`` turns it off.

Only at low load: with more than ``MAX_IN_FLIGHT`` requests the loop is
seldom asleep anyway, and a spinning core competes with the processes beside
the gateway (a worker's engine on the same host, whose host work between its
steps is then what bounds the throughput).
"""

from __future__ import annotations

import asyncio

from protocol.aio import cancel_and_wait

MAX_IN_FLIGHT = 8


class BusyPoller:
    """Counts requests in flight; while 1 to ``MAX_IN_FLIGHT`` are, and
    ``linger_s`` after the last, one task keeps the loop from sleeping."""

    def __init__(self, linger_s: float) -> None:
        if linger_s < 0:
            raise ValueError("busy poll linger must be >= 0")
        self.linger_s = linger_s
        self.in_flight = 0
        self._until = 0.0
        self._task: asyncio.Task[None] | None = None

    @property
    def spinning(self) -> bool:
        return self._task is not None and not self._task.done()

    def begin(self) -> None:
        if not self.linger_s:
            return
        self.in_flight += 1
        self._start()

    def end(self) -> None:
        if not self.linger_s:
            return
        self.in_flight -= 1
        if not self.in_flight:
            self._until = asyncio.get_running_loop().time() + self.linger_s
        self._start()

    def _wanted(self, now: float) -> bool:
        n = self.in_flight
        return n <= MAX_IN_FLIGHT and (n > 0 or now < self._until)

    def _start(self) -> None:
        loop = asyncio.get_running_loop()
        if not self.spinning and self._wanted(loop.time()):
            self._task = loop.create_task(self._spin(), name="busy-poll")

    async def stop(self) -> None:
        task, self._task = self._task, None
        await cancel_and_wait(task)

    async def _spin(self) -> None:
        loop = asyncio.get_running_loop()
        while self._wanted(loop.time()):
            # sleep(0) yields without a timer: the loop's next select has a
            # zero timeout because this task is ready again.
            await asyncio.sleep(0)
