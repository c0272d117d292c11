"""Run-time membership: adding, removing and listing workers."""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Any

import httpx

from gateway.routing.probe import WorkerError, WorkerProbe, WorkerUnreachable
from gateway.routing.router import Router
from gateway.routing.workers import WorkerInfo, normalize_url
from protocol.roles import BOTH, DECODE, ROLES


class WorkerRoleMismatch(WorkerError):
    """The worker reports another role than the one it was added as."""


class WorkerNotAdmitted(WorkerError):
    """The worker answered but failed its admission checks: it is registered,
    out of routing (``refused``: it answers but cannot serve, see
    ``WorkerInfo.refused``), and the reason was logged."""

    def __init__(self, message: str, refused: bool) -> None:
        super().__init__(message)
        self.refused = refused


class WorkerAdmin:
    """Registers workers with the router from their own /server_info, and
    takes them out again (draining first)."""

    def __init__(
        self,
        router: Router,
        probe: WorkerProbe,
        admit: Callable[[WorkerInfo], Awaitable[bool]] | None = None,
    ) -> None:
        self.router = router
        self.probe = probe
        self.admit = admit
        """The admission checks a registered worker must pass before it takes
        requests (``HealthChecker.admit``; None: none)."""

    async def add_worker(self, url: str, role: str | None = None) -> WorkerInfo:
        """Fetch the worker's /server_info and register it. ``role`` defaults to
        the worker's own; a different one raises ``WorkerRoleMismatch``. Raises
        ``WorkerUnreachable`` if the worker does not answer. A worker that
        fails the admission checks stays registered, out of routing, and
        ``WorkerNotAdmitted`` is raised with the reason."""
        url = normalize_url(url)
        if role is not None and role not in ROLES:
            raise ValueError(f"unknown worker role {role!r}; choose from {', '.join(ROLES)}")
        try:
            info = await self.probe.server_info(url)
        except httpx.HTTPError as e:
            raise WorkerUnreachable(
                f"cannot reach worker {url}: GET /server_info failed: {type(e).__name__}: {e}"
            ) from e
        except WorkerUnreachable as e:
            raise WorkerUnreachable(f"cannot add worker {url}: {e}") from e
        actual = info.get("role")
        if actual not in ROLES:
            raise WorkerUnreachable(
                f"worker {url} reports no valid role in /server_info: {actual!r}"
            )
        # A colocated worker ("both") serves the decode pool: --decode URL and
        # role "decode" take it.
        if role is not None and role != actual and (role, actual) != (DECODE, BOTH):
            raise WorkerRoleMismatch(
                f"worker {url} was added as {role!r} but reports role {actual!r}"
            )
        new = WorkerInfo.from_server_info(url, info)
        # Out of routing until it passed its checks (an entry already listed
        # keeps its state meanwhile).
        new.healthy = self.admit is None
        worker = self.router.add(new)
        if self.admit is not None:
            if not await self.admit(worker):
                error = worker.last_error or "it failed its admission checks"
                raise WorkerNotAdmitted(
                    f"worker {url} is not usable: {error}", worker.refused is not None
                )
            worker.healthy = True
        return worker

    async def remove_worker(self, url: str) -> WorkerInfo | None:
        """Start draining the worker at ``url`` (None if unknown); it stays
        listed until its outstanding requests end."""
        return self.router.remove(url)

    def list_workers(self) -> list[dict[str, Any]]:
        """Every registered worker (draining ones included) as JSON-able dicts."""
        policy = self.router.prefill_policy
        return [
            {**w.to_dict(), "prefix_cache": policy.describe(w.url)}
            if w.role != "decode"
            else w.to_dict()
            for w in self.router.workers()
        ]
