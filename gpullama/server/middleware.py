"""Pure-ASGI middleware: bearer-key authentication and one access-log line (plus a metric) per request."""

from __future__ import annotations

import hmac
import logging
import time

from starlette.types import ASGIApp, Message, Receive, Scope, Send

from .errors import error_bytes
from .metrics import ServerMetrics
from .request_log import RequestRecord, current_request

access_log = logging.getLogger("gpullama.server.access")


async def send_json_error(send: Send, status: int, body: bytes, headers: list[tuple[bytes, bytes]] | None = None) -> None:
    """Send a complete JSON error response."""
    await send({"type": "http.response.start", "status": status,
                "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]
                + (headers or [])})
    await send({"type": "http.response.body", "body": body})


class APIKeyMiddleware:
    """Require ``Authorization: Bearer KEY`` on ``/v1`` routes; health and metrics stay open (as in vLLM)."""

    def __init__(self, app: ASGIApp, api_key: str | None) -> None:
        self.app = app
        self.expected = f"Bearer {api_key}".encode() if api_key else None

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if self.expected is None or scope["type"] != "http" or not scope["path"].startswith("/v1"):
            return await self.app(scope, receive, send)
        given = dict(scope["headers"]).get(b"authorization", b"")
        if not hmac.compare_digest(given, self.expected):
            message = "Missing API key" if not given else "Incorrect API key provided"
            body = error_bytes(401, f"{message}: pass it as 'Authorization: Bearer <key>'.", code="invalid_api_key")
            return await send_json_error(send, 401, body, [(b"www-authenticate", b"Bearer")])
        return await self.app(scope, receive, send)


class AccessLogMiddleware:
    """Log ``client "METHOD path HTTP/v" status duration: details`` once the response is complete (details: a
    generation's tokens, time to first token, speed and finish reason, or an error's message; see `request_log`);
    health and metrics polls at debug level. Count each request by status."""

    QUIET_PATHS = ("/health", "/metrics")

    def __init__(self, app: ASGIApp, metrics: ServerMetrics) -> None:
        self.app = app
        self.metrics = metrics

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        start = time.perf_counter()
        status = 500
        record = RequestRecord()
        token = current_request.set(record)

        async def send_status(message: Message) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
            elif message["type"] == "http.response.body" and status >= 400:
                record.keep_error_body(message.get("body", b""))
            await send(message)

        try:
            await self.app(scope, receive, send_status)
        finally:
            current_request.reset(token)
            client = scope.get("client")
            where = f"{client[0]}:{client[1]}" if client else "-"
            quiet = scope["path"] in self.QUIET_PATHS  # polled every few seconds (503 while loading included)
            access_log.log(logging.DEBUG if quiet else logging.INFO, '%s "%s %s HTTP/%s" %d %s', where,
                           scope["method"], scope["path"], scope.get("http_version", "1.1"), status,
                           record.describe(status, time.perf_counter() - start))
            self.metrics.observe_request(scope["path"], status)
