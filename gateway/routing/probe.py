"""The gateway's HTTP calls to a worker's front (``/health`` and
``/server_info``), and how they fail."""

from __future__ import annotations

from typing import Any

import httpx


class WorkerError(RuntimeError):
    """A worker could not be added."""


class WorkerUnreachable(WorkerError):
    """The worker did not answer /server_info (connection, timeout or HTTP error)."""


class WorkerProbe:
    """One HTTP client for every call to workers' fronts, made on first use
    (again after ``close``). ``client`` (or ``transport``, for tests) replaces
    the AsyncClient it would create itself; a given client is not closed by
    ``close``."""

    def __init__(
        self,
        timeout_s: float,
        *,
        client: httpx.AsyncClient | None = None,
        transport: httpx.AsyncBaseTransport | None = None,
    ) -> None:
        self.timeout_s = timeout_s
        self._client = client
        self._owns_client = client is None
        self._transport = transport

    def http(self) -> httpx.AsyncClient:
        if self._client is None or self._client.is_closed:
            self._client = httpx.AsyncClient(timeout=self.timeout_s, transport=self._transport)
            self._owns_client = True
        return self._client

    async def health(self, url: str) -> None:
        """GET ``url``/health; raises ``WorkerUnreachable`` unless it answers 200
        (and ``httpx.HTTPError`` when the call itself fails)."""
        resp = await self.http().get(f"{url}/health")
        if resp.status_code != 200:
            raise WorkerUnreachable(f"/health answered {resp.status_code}")

    async def server_info(self, url: str) -> dict[str, Any]:
        """GET ``url``/server_info as a JSON object; raises ``WorkerUnreachable``
        on any other answer (and ``httpx.HTTPError`` when the call itself fails)."""
        resp = await self.http().get(f"{url}/server_info")
        if resp.status_code != 200:
            raise WorkerUnreachable(
                f"{url}/server_info answered {resp.status_code}: {resp.text[:200]}"
            )
        try:
            info = resp.json()
        except ValueError as e:
            raise WorkerUnreachable(f"{url}/server_info sent invalid JSON: {e}") from e
        if not isinstance(info, dict):
            raise WorkerUnreachable(f"{url}/server_info sent {type(info).__name__}, not an object")
        return info

    async def close(self) -> None:
        if self._client is not None and self._owns_client:
            await self._client.aclose()
            self._client = None
