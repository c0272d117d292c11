"""The gateway's HTTP calls to a worker's front (``/health``,
``/server_info`` and ``/tokenizer``), and how they fail."""

from __future__ import annotations

from typing import Any

import httpx

from protocol import tokenizer_files
from protocol.health import HealthStatus

TOKENIZER_TIMEOUT_S = 30.0
"""HTTP timeout of ``GET /tokenizer`` (a large tokenizer.json is megabytes)."""


class WorkerError(RuntimeError):
    """A worker could not be added."""


class WorkerUnreachable(WorkerError):
    """The worker did not answer /server_info (connection, timeout or HTTP error)."""


class WorkerStopping(WorkerUnreachable):
    """The worker's /health says it is draining before it stops."""


class WorkerRefused(WorkerError):
    """The worker answers but cannot serve this gateway's requests (it serves
    no tokenizer, another model, or its request plane refuses the handshake):
    it takes no requests until a later check finds it fixed."""


def no_tokenizer(why: str) -> WorkerRefused:
    return WorkerRefused(
        f"it serves no tokenizer files ({why}), so the gateway cannot tokenize for it: "
        "start it with a checkpoint directory that has tokenizer.json, or a preset "
        "with --load-format dummy"
    )


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
            if _json_status(resp) == HealthStatus.DRAINING:
                raise WorkerStopping(f"/health answered {resp.status_code}: draining")
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

    async def tokenizer_files(self, url: str) -> dict[str, bytes]:
        """GET ``url``/tokenizer: the tokenizer files, name -> bytes. Raises
        ``WorkerRefused`` when the worker serves none (404, no tokenizer.json,
        a body that is not the files), ``WorkerUnreachable`` on another status
        (and ``httpx.HTTPError`` when the call itself fails)."""
        resp = await self.http().get(f"{url}/tokenizer", timeout=TOKENIZER_TIMEOUT_S)
        if resp.status_code == 404:
            raise no_tokenizer("GET /tokenizer answered 404")
        if resp.status_code != 200:
            raise WorkerUnreachable(
                f"{url}/tokenizer answered {resp.status_code}: {resp.text[:200]}"
            )
        try:
            files = tokenizer_files.unpack(resp.json())
        except (ValueError, KeyError, TypeError, AttributeError) as e:
            raise no_tokenizer(f"GET /tokenizer sent no files: {type(e).__name__}") from e
        if "tokenizer.json" not in files:
            raise no_tokenizer("GET /tokenizer sent no tokenizer.json")
        return files

    async def close(self) -> None:
        if self._client is not None and self._owns_client:
            await self._client.aclose()
            self._client = None


def _json_status(resp: httpx.Response) -> Any:
    """The "status" member of a JSON object body (None: no such body)."""
    try:
        body = resp.json()
    except ValueError:
        return None
    return body.get("status") if isinstance(body, dict) else None
