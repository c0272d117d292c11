"""Periodic health checks of every registered worker."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable

import httpx

from gateway.routing.config import RouterConfig
from gateway.routing.probe import (
    WorkerProbe,
    WorkerRefused,
    WorkerStopping,
    WorkerUnreachable,
)
from gateway.routing.router import Router
from gateway.routing.workers import WorkerInfo
from protocol.aio import cancel_and_wait

log = logging.getLogger("gateway.router")


Check = Callable[[WorkerInfo], Awaitable[None]]
"""An admission check of a worker: returns when the worker may take
requests; raises ``WorkerRefused`` (it cannot, until fixed) or
``WorkerUnreachable`` / ``httpx.HTTPError`` (it did not answer) with the reason."""


class HealthChecker:
    """Polls every worker's /health and /server_info every
    ``config.health_interval_s``: ``config.unhealthy_after`` failed checks in a
    row mark a worker unhealthy, one passing check re-admits it, and each
    passing check refreshes endpoints and stats.

    Before a worker takes requests (when it is first seen, whenever it comes
    back from being down, and after a restart) it must pass the ``checks``
    (``admit``): one that fails them stays out of routing with the reason in
    its ``last_error`` (and ``refused``), logged once, and is checked again
    every round, so that a fixed worker joins.

    Use ``await start()`` / ``await stop()`` or ``async with``. ``probe`` is
    where the HTTP calls go; without one it makes its own, over ``client`` (or
    ``transport``, for tests) when given. ``stop`` closes only a client the
    probe created itself.
    """

    def __init__(
        self,
        router: Router,
        config: RouterConfig | None = None,
        *,
        probe: WorkerProbe | None = None,
        client: httpx.AsyncClient | None = None,
        transport: httpx.AsyncBaseTransport | None = None,
    ) -> None:
        self.router = router
        self.config = config or router.config
        self.probe = probe or WorkerProbe(
            self.config.health_timeout_s, client=client, transport=transport
        )
        self._task: asyncio.Task[None] | None = None
        self.after_round: list[Callable[[], Awaitable[None]]] = []
        """Called after every round of checks (e.g. to close clients of workers
        that left)."""
        self.checks: list[Check] = []
        """Admission checks, in order (``admit``)."""
        self._told: dict[str, str] = {}
        """URL -> the problem last logged for that worker (each is logged once)."""

    @property
    def running(self) -> bool:
        return self._task is not None and not self._task.done()

    async def check_worker(self, worker: WorkerInfo) -> bool:
        """One check of one worker; updates its health. True if it passed."""
        try:
            await self.probe.health(worker.url)
            info = await self.probe.server_info(worker.url)
            role = info.get("role")
            if role != worker.role and not (
                not worker.info and role in self.router.pool_for(worker.role).roles
            ):
                raise WorkerUnreachable(
                    f"now reports role {info.get('role')!r}, registered as {worker.role!r}"
                )
        except (httpx.HTTPError, WorkerUnreachable) as e:
            if isinstance(e, WorkerStopping):
                worker.stopping = True
            self._failed(worker, f"{type(e).__name__}: {e}")
            return False
        first = not worker.info
        if first:  # listed before it ever answered: its own role counts
            worker.role = info["role"]
        restarted = worker.info.get("started_at") not in (None, info.get("started_at"))
        worker.update_from_server_info(info)
        worker.stopping = False
        if restarted:
            self.router.restarted(worker)
        vet = not worker.healthy or restarted or worker.refused is not None
        if vet and not await self.admit(worker):
            return False
        worker.consecutive_failures = 0
        if not worker.healthy:
            log.info("worker %s is %s", worker.url, "up" if first else "healthy again")
        worker.healthy = True
        return True

    async def admit(self, worker: WorkerInfo) -> bool:
        """Run the admission ``checks`` on ``worker`` (whose /server_info is
        in ``worker.info``). True if it passed them (it is not marked healthy
        here); else it is out of routing, with the reason in ``last_error``
        (and in ``refused`` when it answers but cannot serve), logged once."""
        try:
            for check in self.checks:
                await check(worker)
        except WorkerRefused as e:
            self._down(worker, str(e), refused=True)
            return False
        except Exception as e:  # no answer, or a check that failed otherwise: down
            self._down(worker, f"{type(e).__name__}: {e}", refused=False)
            return False
        worker.refused = None
        self._told.pop(worker.url, None)
        return True

    def _down(self, worker: WorkerInfo, reason: str, refused: bool) -> None:
        """``worker`` failed its admission checks: out of routing now."""
        worker.healthy = False
        worker.last_error = reason
        worker.refused = reason if refused else None
        if self._told.get(worker.url) != reason:
            self._told[worker.url] = reason
            log.warning("worker %s is not usable: %s", worker.url, reason)

    def _failed(self, worker: WorkerInfo, error: str) -> None:
        worker.consecutive_failures += 1
        worker.last_error = error
        if worker.healthy and worker.consecutive_failures >= self.config.unhealthy_after:
            worker.healthy = False
            log.warning(
                "worker %s marked unhealthy after %d failed checks: %s",
                worker.url,
                worker.consecutive_failures,
                error,
            )

    async def check_all(self, only_unhealthy: bool = False) -> None:
        """Check every registered worker (or only the unhealthy ones) once,
        concurrently."""
        workers = [w for w in self.router.workers() if not (only_unhealthy and w.healthy)]
        if workers:
            await asyncio.gather(*(self.check_worker(w) for w in workers))

    async def _run(self) -> None:
        # Healthy workers are checked every health_interval_s; a worker that is
        # down (failed checks, a dropped connection, not up yet) every
        # probe_interval_s, so it is back in routing soon after it answers.
        interval = self.config.health_interval_s
        probe = min(interval, self.config.probe_interval_s)
        loop = asyncio.get_running_loop()
        full_at = loop.time()
        while True:
            try:
                full = loop.time() >= full_at
                if full:
                    full_at = loop.time() + interval
                await self.check_all(only_unhealthy=not full)
                for hook in self.after_round:
                    await hook()
            except Exception:  # never let one bad round end the loop
                log.exception("health check round failed")
            await asyncio.sleep(probe)

    async def start(self) -> None:
        if self.running:
            return
        self.probe.http()
        self._task = asyncio.create_task(self._run(), name="gateway-health-checker")

    async def stop(self) -> None:
        task, self._task = self._task, None
        await cancel_and_wait(task)
        await self.probe.close()

    async def __aenter__(self) -> HealthChecker:
        await self.start()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.stop()
