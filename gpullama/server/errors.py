"""OpenAI-shaped API errors: one exception type and the JSON body it renders to."""

from __future__ import annotations

import orjson

_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    404: "invalid_request_error",
    405: "invalid_request_error",
    408: "invalid_request_error",
    413: "invalid_request_error",
    415: "invalid_request_error",
    429: "rate_limit_error",
    500: "server_error",
    503: "server_error",
    504: "server_error",
}


class APIError(Exception):
    """An error answered to the client as ``{"error": {"message", "type", "param", "code"}}``."""

    def __init__(self, status: int, message: str, *, param: str | None = None, code: str | None = None,
                 headers: dict[str, str] | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.code = code
        self.headers = headers or {}

    def body(self) -> dict:
        """The OpenAI error object."""
        return error_body(self.status, self.message, param=self.param, code=self.code)


def error_body(status: int, message: str, *, param: str | None = None, code: str | None = None) -> dict:
    """Build OpenAI's error object for an HTTP status."""
    return {"error": {"message": message, "type": _TYPES.get(status, "invalid_request_error"),
                      "param": param, "code": code}}


def error_bytes(status: int, message: str, *, param: str | None = None, code: str | None = None) -> bytes:
    """The error object serialised with orjson."""
    return orjson.dumps(error_body(status, message, param=param, code=code))


def internal_error(request_id: str, code: str = "internal_error") -> APIError:
    """The 500 a client sees for a failure on our side: only "internal error" and the request id that finds the
    detail in the server's log (exception text can carry paths, data of other requests, or internals)."""
    return APIError(500, f"internal error (request id {request_id})", code=code)
