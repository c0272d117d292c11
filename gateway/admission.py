"""Admission control: how many generation requests the gateway runs at once,
and how much work may wait for a slot.

A request is admitted at once while fewer than the limit run; otherwise it
queues (first come, first served) if the tokens queued with it stay within
``max_queued_tokens`` and gets a slot when one frees up, within
``max_queue_wait_s``. Anything beyond that is refused with ``Overloaded`` (a
429 with ``Retry-After``): bounded queues keep the gateway's memory bounded
under any overload, and the requests that do run keep their latency.

The limit is ``max_concurrent_requests`` and, with a per-worker bound, at most
that bound times the decode workers available now (``capacity``), so the
workers' own queues stay bounded too.
"""

from __future__ import annotations

import asyncio
import contextlib
import math
from collections import deque
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass

from protocol.settings import setting

ADMISSION_GROUP = "admission control"


@dataclass(frozen=True)
class AdmissionConfig:
    max_concurrent_requests: int = setting(
        0,
        help="generation requests running at once; more wait in a bounded queue or get 429; "
        "0: no limit (default: %(default)s)",
        group=ADMISSION_GROUP,
    )
    max_queued_tokens: int = setting(
        0,
        help="prompt plus max_tokens of the requests waiting for a slot; beyond it, 429 with "
        "Retry-After; 0: no queue when a limit is set, a request that finds no slot is "
        "refused at once (default: %(default)s)",
        group=ADMISSION_GROUP,
    )
    max_queue_wait_s: float = setting(
        30.0,
        help="a queued request waits this long for a slot, then gets 429 (default: %(default)s)",
        group=ADMISSION_GROUP,
    )
    retry_after_s: float = setting(
        1.0,
        help="the smallest Retry-After, in seconds, given to a refused request "
        "(default: %(default)s)",
        group=ADMISSION_GROUP,
    )

    def __post_init__(self) -> None:
        if self.max_concurrent_requests < 0 or self.max_queued_tokens < 0:
            raise ValueError("max_concurrent_requests and max_queued_tokens must be >= 0")
        if self.max_queue_wait_s <= 0 or self.retry_after_s <= 0:
            raise ValueError("max_queue_wait_s and retry_after_s must be > 0")


class Overloaded(Exception):
    """The request was refused: no slot and no room in the queue."""

    def __init__(self, message: str, retry_after_s: float) -> None:
        super().__init__(message)
        self.retry_after_s = retry_after_s

    @property
    def retry_after(self) -> str:
        """The Retry-After header's value (whole seconds, at least 1)."""
        return str(max(1, math.ceil(self.retry_after_s)))


class _Waiter:
    __slots__ = ("future", "tokens")

    def __init__(self, future: asyncio.Future[None], tokens: int) -> None:
        self.future = future
        self.tokens = tokens


class Admission:
    """The gateway's admission queue; ``capacity`` (optional) is a further
    limit that may change over time (per-worker bound x available workers)."""

    def __init__(
        self, config: AdmissionConfig, capacity: Callable[[], int | None] | None = None
    ) -> None:
        self.config = config
        self.capacity = capacity
        self.running = 0
        self.queued_tokens = 0
        self.refused = 0
        self._queue: deque[_Waiter] = deque()

    @property
    def queued(self) -> int:
        return len(self._queue)

    def limit(self) -> int | None:
        """Requests that may run now (None: no limit)."""
        limits = []
        if self.config.max_concurrent_requests:
            limits.append(self.config.max_concurrent_requests)
        extra = self.capacity() if self.capacity is not None else None
        if extra is not None:
            limits.append(max(1, extra))
        return min(limits) if limits else None

    def _has_slot(self) -> bool:
        limit = self.limit()
        return limit is None or self.running < limit

    async def acquire(self, tokens: int) -> None:
        """Take a slot for a request of ``tokens`` (prompt + max_tokens);
        raises ``Overloaded`` when it cannot get one. Pair with ``release``."""
        if not self._queue and self._has_slot():
            self.running += 1
        else:
            await self._wait(tokens)

    def release(self) -> None:
        self.running -= 1
        self._wake()

    @contextlib.asynccontextmanager
    async def admit(self, tokens: int) -> AsyncIterator[None]:
        """Hold a slot while the block runs (``acquire`` / ``release``)."""
        await self.acquire(tokens)
        try:
            yield
        finally:
            self.release()

    async def _wait(self, tokens: int) -> None:
        cfg = self.config
        if self.queued_tokens + tokens > cfg.max_queued_tokens:
            self.refused += 1
            raise Overloaded(
                f"the server is at capacity ({self.running} requests running, "
                f"{self.queued} queued with {self.queued_tokens} tokens); retry later",
                cfg.retry_after_s,
            )
        waiter = _Waiter(asyncio.get_running_loop().create_future(), tokens)
        self._queue.append(waiter)
        self.queued_tokens += tokens
        try:
            async with asyncio.timeout(cfg.max_queue_wait_s):
                await waiter.future
        except BaseException as e:
            if waiter.future.done() and not waiter.future.cancelled():
                self.running -= 1  # it got the slot as it gave up: pass it on
                self._wake()
            if isinstance(e, TimeoutError):
                self.refused += 1
                raise Overloaded(
                    f"no capacity for this request within {cfg.max_queue_wait_s:g}s; retry later",
                    cfg.retry_after_s,
                ) from None
            raise
        finally:
            if waiter in self._queue:
                self._queue.remove(waiter)
            self.queued_tokens -= tokens

    def _wake(self) -> None:
        """Hand free slots to the waiters at the head of the queue."""
        while self._queue and self._has_slot():
            waiter = self._queue.popleft()
            if waiter.future.done():
                continue
            self.running += 1
            waiter.future.set_result(None)
