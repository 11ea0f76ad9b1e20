"""Streamed answers: server-sent events (plain ``data:`` events and typed ``event: TYPE`` ones), newline-delimited
JSON, a streaming response that notices disconnects, and a disconnect guard."""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any, TypeVar

import anyio
import orjson
from starlette.types import Receive, Scope, Send

log = logging.getLogger("gpullama.server")
T = TypeVar("T")

DONE = b"data: [DONE]\n\n"
SSE_MEDIA_TYPE = b"text/event-stream; charset=utf-8"
NDJSON_MEDIA_TYPE = b"application/x-ndjson"


def event(obj: Any) -> bytes:
    """One SSE ``data:`` event holding ``obj`` as JSON."""
    return b"data: " + orjson.dumps(obj) + b"\n\n"


def typed_event(kind: str, obj: Any) -> bytes:
    """One SSE event of type `kind` (``event: KIND``) holding ``obj`` as JSON (the Responses and Anthropic
    streams)."""
    return b"event: " + kind.encode() + b"\ndata: " + orjson.dumps(obj) + b"\n\n"


def ndjson_line(obj: Any) -> bytes:
    """One line of newline-delimited JSON (Ollama's streams)."""
    return orjson.dumps(obj) + b"\n"


class ClientDisconnected(Exception):
    """The client went away before the answer was complete."""


async def _wait_disconnect(receive: Receive) -> None:
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            return


class StreamResponse:
    """Streams ``events`` (``text/event-stream`` unless `media_type` says otherwise); stops them at once when the
    client disconnects.

    Stopping closes the ``events`` generator (its ``finally`` aborts the engine requests) and calls ``on_disconnect``.
    """

    def __init__(self, events: AsyncIterator[bytes], on_disconnect: Callable[[], None] | None = None,
                 media_type: bytes = SSE_MEDIA_TYPE) -> None:
        self.events = events
        self.on_disconnect = on_disconnect
        self.status_code = 200
        self.headers = [(b"content-type", media_type), (b"cache-control", b"no-cache"), (b"x-accel-buffering", b"no")]

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        disconnected = False
        complete = False  # every event was sent: a disconnect from here on is the normal end of the response

        async def watch() -> None:
            nonlocal disconnected
            await _wait_disconnect(receive)
            # once the last body message is sent, the server reports "disconnect" to anyone still listening;
            # that is the end of a complete response, not a client going away
            if not complete:
                disconnected = True
                tg.cancel_scope.cancel()

        try:
            async with anyio.create_task_group() as tg:
                tg.start_soon(watch)
                await send({"type": "http.response.start", "status": 200, "headers": self.headers})
                try:
                    async for chunk in self.events:
                        await send({"type": "http.response.body", "body": chunk, "more_body": True})
                    complete = True
                    await send({"type": "http.response.body", "body": b"", "more_body": False})
                except OSError:
                    disconnected = not complete
                tg.cancel_scope.cancel()
        finally:
            aclose = getattr(self.events, "aclose", None)
            if aclose is not None:
                with anyio.CancelScope(shield=True):
                    await aclose()
            if disconnected:
                log.info("client disconnected mid-stream; generation aborted")
                if self.on_disconnect is not None:
                    self.on_disconnect()


async def unless_disconnected(receive: Receive, work: Callable[[], Awaitable[T]]) -> T:
    """Run ``work()`` but cancel it (and raise ``ClientDisconnected``) if the client disconnects first."""
    result: list[T] = []
    failure: list[Exception] = []
    disconnected = False

    async with anyio.create_task_group() as tg:
        async def watch() -> None:
            nonlocal disconnected
            await _wait_disconnect(receive)
            disconnected = True
            tg.cancel_scope.cancel()

        async def run() -> None:
            try:
                result.append(await work())
            except Exception as exc:  # re-raised below, outside the task group's exception group
                failure.append(exc)
            tg.cancel_scope.cancel()

        tg.start_soon(watch)
        tg.start_soon(run)
    if failure:
        raise failure[0]
    if disconnected and not result:
        raise ClientDisconnected()
    return result[0]
