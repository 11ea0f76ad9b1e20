"""``GET /health`` (readiness, as llama.cpp's and vLLM's) and ``GET /metrics`` (Prometheus)."""

from __future__ import annotations

from starlette.requests import Request
from starlette.responses import Response

from ..http.body import JSONResponse
from ..http.metrics import CONTENT_TYPE as METRICS_CONTENT_TYPE
from ..state import server_state


async def health(request: Request) -> Response:
    """``GET /health``: 200 ``{"status": "ok"}`` when ready, 503 while loading or when the engine is gone. With
    several models (or after the default model was unloaded) it is ready once the server is: a model loads on its
    first request."""
    state = server_state(request)
    if state.status in ("loading", "stopping"):
        return JSONResponse({"status": state.status}, status_code=503)
    if state.status != "ready":
        return JSONResponse({"status": "error", "message": f"{state.status}: {state.error}"}, status_code=503)
    if state.engine is not None and not getattr(state.engine, "is_alive", True):
        return JSONResponse({"status": "error", "message": "the generation engine has stopped"}, status_code=503)
    return JSONResponse({"status": "ok"})


async def metrics(request: Request) -> Response:
    """``GET /metrics``: Prometheus text exposition, with llama.cpp's ``Process-Start-Time-Unix`` header (when the
    server started, in Unix seconds); a server of several models labels each model's series ``model_name``."""
    state = server_state(request)
    engines = [(m.name, m.engine) for m in state.models.values()] if state.multi else state.engine
    return Response(state.metrics.render(engines), media_type=METRICS_CONTENT_TYPE,
                    headers={"Process-Start-Time-Unix": str(state.created)})
