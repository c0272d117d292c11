"""Errors as the OpenAI API answers them: an HTTP status and the body
``{"error": {"message", "type", "param", "code"}}``."""

from __future__ import annotations

from typing import Any

from fastapi.responses import JSONResponse


class APIError(Exception):
    def __init__(
        self,
        status: int,
        message: str,
        type_: str = "invalid_request_error",
        param: str | None = None,
        code: str | None = None,
        headers: dict[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = (
            status,
            message,
            type_,
            param,
            code,
        )
        self.headers = headers
        """Extra response headers (``Allow`` of a 405)."""

    def body(self) -> dict[str, Any]:
        return {
            "error": {
                "message": self.message,
                "type": self.type,
                "param": self.param,
                "code": self.code,
            }
        }

    def response(self) -> JSONResponse:
        return JSONResponse(self.body(), status_code=self.status, headers=self.headers)


def request_timeout(timeout_s: float) -> APIError:
    """A request that ran past the gateway's request timeout."""
    return APIError(
        504,
        f"request did not finish within {timeout_s:g}s",
        type_="server_error",
        code="timeout",
    )


def internal_error(exc: BaseException) -> APIError:
    """A failure the gateway did not expect (a bug, not the client's fault).
    Only the exception's type is told: its text may hold internals."""
    return APIError(
        500,
        f"the gateway failed on this request ({type(exc).__name__}); its log has the details",
        type_="server_error",
        code="internal_error",
    )
