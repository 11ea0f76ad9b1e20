"""The request-id middleware: every answer carries an id; an unexpected exception is a 500 saying only "internal
error" and that id, with the detail in the log once (no model needed)."""

from __future__ import annotations

import logging

from starlette.applications import Starlette
from starlette.middleware import Middleware
from starlette.responses import JSONResponse
from starlette.routing import Route
from starlette.testclient import TestClient

from gpullama.server.http.middleware import RequestIdMiddleware


async def _boom(request):
    raise RuntimeError("secret detail: /home/user/data.txt")


async def _ok(request):
    return JSONResponse({"request_id": request.state.request_id})


def test_an_unexpected_exception_is_a_500_with_only_the_request_id(caplog) -> None:
    app = Starlette(routes=[Route("/boom", _boom), Route("/ok", _ok)], middleware=[Middleware(RequestIdMiddleware)])
    with TestClient(app, raise_server_exceptions=False) as client, caplog.at_level(logging.ERROR):
        ok = client.get("/ok")
        assert ok.json()["request_id"] == ok.headers["x-request-id"]
        answer = client.get("/boom")
    assert answer.status_code == 500
    request_id = answer.headers["x-request-id"]
    assert request_id != ok.headers["x-request-id"]
    assert answer.json() == {"error": {"message": f"internal error (request id {request_id})", "type": "server_error",
                                       "param": None, "code": "internal_error"}}
    errors = [r for r in caplog.records if r.levelno >= logging.ERROR]
    assert len(errors) == 1 and request_id in errors[0].getMessage() and "secret detail" in str(errors[0].exc_info[1])
