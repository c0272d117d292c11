"""The checks every HTTP request passes before a route: API and admin keys,
the body size limit; and what it leaves in the request's ``state`` for the
routes (when it came in, the call that gives its admission slot back)."""

from __future__ import annotations

import secrets
import time
from collections.abc import Awaitable, Callable, Mapping
from typing import Any

from gateway.busy_poll import BusyPoller
from gateway.config import GatewayConfig
from gateway.openai import APIError

RECEIVED_AT = "received_at"
"""Key in the request's ``state`` of when the request came in (monotonic)."""
RELEASE_SLOT = "release_slot"
"""Key in the request's ``state`` of the call that gives its admission slot
back (``Guards`` calls it once the whole response, streamed or not, is out)."""

DirectHandler = Callable[[Any, Any, Any], Awaitable[Any]]
"""Serves a request (scope, receive, send) and returns None, or returns the
``receive`` to hand the request on to the app with."""


class Guards:
    """The checks every request passes first: API and admin keys, and the body
    size limit. It also stamps when the request came in (``RECEIVED_AT``),
    and hands the requests of the ``direct`` paths to their handler first
    (``gateway.app.DirectRoute``).

    A plain ASGI middleware, not an ``http`` one: that kind hands every chunk
    of a streamed response across a memory stream and a task of its own,
    which would cost more per streamed token than the rest of the gateway."""

    def __init__(
        self,
        app: Any,
        config: GatewayConfig,
        busy_poll: BusyPoller,
        direct: Mapping[str, DirectHandler] | None = None,
    ) -> None:
        self.app = app
        self.cfg = config
        self.busy_poll = busy_poll
        self.direct = direct or {}

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        scope.setdefault("state", {})[RECEIVED_AT] = time.monotonic()
        cfg = self.cfg
        path = scope["path"]
        auth = size = None
        for name, value in scope["headers"]:
            if name == b"authorization" and auth is None:
                auth = value.decode("latin-1")
            elif name == b"content-length" and size is None:
                size = value.decode("latin-1")
        error = None
        if path.startswith("/v1/") and cfg.api_key and auth != f"Bearer {cfg.api_key}":
            error = APIError(401, "invalid or missing API key", code="invalid_api_key")
        elif path.startswith("/admin/") and (admin := _admin_error(cfg, auth)) is not None:
            error = admin
        elif size is None and scope["method"] in ("POST", "PUT", "PATCH"):
            # Invariant: no body over max_body_bytes reaches a handler, framed
            # by Content-Length or not (a chunked body has no header to check;
            # it is read here and handed on as one message).
            body, receive, _ = await buffer_body(receive)
            size = str(len(body))
        too_large = size is not None and size.isdigit() and int(size) > cfg.max_body_bytes
        if error is None and too_large:
            error = APIError(
                400,
                f"request body is {size} bytes; the limit is {cfg.max_body_bytes}",
                code="body_too_large",
            )
        if error is not None:
            await error.response()(scope, receive, send)
            return
        busy_poll = self.busy_poll
        busy_poll.begin()
        try:
            route = self.direct.get(path) if scope["method"] == "POST" else None
            if route is not None:
                receive = await route(scope, receive, send)
            if receive is not None:
                await self.app(scope, receive, send)
        finally:
            busy_poll.end()
            release = scope["state"].pop(RELEASE_SLOT, None)
            if release is not None:
                release()


def _admin_error(cfg: GatewayConfig, auth: str | None) -> APIError | None:
    """Why a call to /admin/* is refused (None: it is not). The admin API is
    never open: without a key (``--admin-key`` or the cluster token) it
    refuses everything, since it decides where users' prompts go."""
    key = cfg.admin_bearer
    if key is None:
        return APIError(
            403,
            "the admin API is disabled: start the gateway with --admin-key or a cluster "
            "token (DISAGG_CLUSTER_TOKEN)",
            type_="permission_error",
            code="admin_disabled",
        )
    if auth is None or not secrets.compare_digest(auth.encode(), f"Bearer {key}".encode()):
        return APIError(401, "invalid or missing admin key", code="invalid_api_key")
    return None


async def buffer_body(receive: Any) -> tuple[bytes, Any, bool]:
    """Read the whole request body; returns it, a ``receive`` that hands it
    on in one message, then passes on whatever comes next (a disconnect), and
    whether the body came whole (False: the client left first)."""
    parts = []
    while True:
        message = await receive()
        if message["type"] != "http.request":
            # The client left before its body was complete: pass that on.
            first: dict[str, Any] | None = message
            break
        parts.append(message.get("body", b""))
        if not message.get("more_body", False):
            first = None
            break
    body = b"".join(parts)
    replayed = False

    async def replay() -> Any:
        nonlocal replayed
        if not replayed:
            replayed = True
            if first is not None:
                return first
            return {"type": "http.request", "body": body, "more_body": False}
        return await receive()

    return body, replay, first is None
