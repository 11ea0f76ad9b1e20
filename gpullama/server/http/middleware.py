"""Pure-ASGI middleware: request ids and the 500 answer, API-key authentication, and one access-log line (plus a
metric) per request."""

from __future__ import annotations

import hmac
import logging
import time
import uuid

from starlette.requests import Request
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from .errors import error_bytes, internal_error
from .metrics import ServerMetrics
from .request_log import RequestRecord, current_request

access_log = logging.getLogger("gpullama.server.access")
log = logging.getLogger("gpullama.server")


async def send_json_error(send: Send, status: int, body: bytes, headers: list[tuple[bytes, bytes]] | None = None) -> None:
    """Send a complete JSON error response."""
    await send({"type": "http.response.start", "status": status,
                "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]
                + (headers or [])})
    await send({"type": "http.response.body", "body": body})


class RequestIdMiddleware:
    """Give each request an id (``request.state.request_id`` and the ``x-request-id`` response header) and answer
    any exception that escapes the app with a 500 saying only "internal error" and that id; the detail and the
    traceback go to the log, once (Starlette's own handler would log it and re-raise it to uvicorn, which logs it
    again)."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        request_id = uuid.uuid4().hex[:16]
        scope.setdefault("state", {})["request_id"] = request_id
        started = False

        async def send_with_id(message: Message) -> None:
            nonlocal started
            if message["type"] == "http.response.start":
                started = True
                message = {**message, "headers": [*message.get("headers", []), (b"x-request-id", request_id.encode())]}
            await send(message)

        try:
            await self.app(scope, receive, send_with_id)
        except Exception as exc:  # noqa: BLE001 - every unexpected failure ends here, logged once
            log.error("internal error on %s %s (request id %s)", scope["method"], scope["path"], request_id,
                      exc_info=exc)
            if not started:
                body = error_bytes(500, internal_error(request_id).message, code="internal_error", path=scope["path"])
                await send_json_error(send_with_id, 500, body, [(b"connection", b"close")])


class APIKeyMiddleware:
    """Require the API key on the API routes (``/v1/*``, Ollama's ``/api/*``, llama.cpp's native ones and the
    OpenAI routes without ``/v1``), as ``Authorization: Bearer KEY`` or Anthropic's ``x-api-key: KEY``; health,
    metrics and the tokenizer endpoints stay open (as in vLLM). The 401 is in the shape of the route's API
    family."""

    PROTECTED = ("/v1", "/api/", "/completion", "/infill", "/chat/", "/models", "/apply-template", "/props",
                 "/embedding")

    def __init__(self, app: ASGIApp, api_key: str | None) -> None:
        self.app = app
        self.bearer = f"Bearer {api_key}".encode() if api_key else None
        self.key = api_key.encode() if api_key else None

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if self.bearer is None or scope["type"] != "http" or not scope["path"].startswith(self.PROTECTED):
            return await self.app(scope, receive, send)
        headers = dict(scope["headers"])
        given, key = headers.get(b"authorization", b""), headers.get(b"x-api-key")
        if hmac.compare_digest(given, self.bearer) or (key is not None and hmac.compare_digest(key, self.key)):
            return await self.app(scope, receive, send)
        message = "Missing API key" if not given and key is None else "Incorrect API key provided"
        body = error_bytes(401, f"{message}: pass it as 'Authorization: Bearer <key>' (or 'x-api-key: <key>').",
                           code="invalid_api_key", path=scope["path"])
        return await send_json_error(send, 401, body, [(b"www-authenticate", b"Bearer")])


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
            # Timer handles scheduled while serving (a deadline) keep a copy of this context, with the record, for
            # as long as they sit in the event loop: drop the generations (and through them the engine), so that
            # an unloaded model's memory is not held by a cancelled timer.
            record.generations.clear()


def request_id(request: Request) -> str:
    """The id `RequestIdMiddleware` gave this request ("-" outside it)."""
    return getattr(request.state, "request_id", "-")
