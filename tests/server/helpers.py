"""Helpers shared by the server tests."""

from __future__ import annotations

import httpx
import orjson

API_KEY = "test-key-123"


def sse_events(response: httpx.Response) -> list:
    """The ``data:`` payloads of an SSE response: parsed JSON objects, and the literal ``"[DONE]"``."""
    events = []
    for line in response.iter_lines():
        if not line.startswith("data: "):
            assert line == "", f"unexpected SSE line {line!r}"
            continue
        payload = line[len("data: "):]
        events.append(payload if payload == "[DONE]" else orjson.loads(payload))
    return events
