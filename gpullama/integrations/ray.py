"""Replicas of ``gpullama-serve`` on Ray Serve (the optional extra ``gpullama[ray]``; docs/deploy.md).

Two deployments, as Ray Serve LLM lays them out:

- ``GpullamaIngress`` (one small replica, no CPU reserved) behind Ray's HTTP proxy: it reads each request's body and
  hands it, with its method, path and headers, to a replica through a streaming deployment handle, then streams the
  replica's answer back as it comes (status, headers, then each body chunk: SSE streams stay streams).
- ``GpullamaReplica`` (`num_replicas`, or an autoscaling config; its CPUs and GPUs per replica): the same engine and
  the same Starlette app as ``gpullama-serve``, so every endpoint answers as there. The app runs in-process on each
  forwarded request (an ASGI call); a client that goes away cancels the call, which aborts the request in the
  engine. Ray's health check asks the engine whether it still runs; a dead replica is replaced by Ray.

Routing: the replica deployment uses Ray's own `PrefixCacheAffinityRouter`, which reads the ``prompt`` or
``messages`` of the handle call's argument: a request whose body has them is forwarded with them (the router sends
requests with a common prefix to the replica that served it, while the load is balanced); any other request
(``GET /v1/models``, ``/health``, ...) goes without, by Ray's default power-of-two choice.

    from gpullama.integrations.ray import build_app
    serve.run(build_app({"model": "smollm2-135m", "threads": 1}, num_replicas=2), route_prefix="/")

or ``serve run gpullama.integrations.ray:app_builder model=smollm2-135m num_replicas=2``.
"""

from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import AsyncIterator
from typing import Any

from ray import serve
from ray.serve.config import RequestRouterConfig
from ray.serve.handle import DeploymentHandle
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import StreamingResponse
from starlette.routing import Route

from gpullama.engine.args import EngineArgs

log = logging.getLogger("gpullama.server")

# Ray's PrefixCacheAffinityRouter, from the module that defines it: its public alias in ray.serve.llm needs the
# ray[llm] extra (pyarrow, vLLM), which a gpullama replica has no use for
PREFIX_ROUTER = "ray.llm._internal.serve.routing_policies.prefix_aware.prefix_aware_router.PrefixCacheAffinityRouter"
MAX_ONGOING_PER_REPLICA = 64  # the engine batches up to max_num_seqs (64 by default); more wait in Ray's queue
_METHODS = ["GET", "POST", "HEAD", "OPTIONS", "PUT", "DELETE", "PATCH"]


class ForwardedRequest:
    """One HTTP request as the ingress hands it to a replica. It has a ``prompt`` or ``messages`` attribute only when
    the body carries one (what the prefix-aware router reads)."""

    def __init__(self, method: str, path: str, query_string: bytes, headers: list[tuple[bytes, bytes]],
                 body: bytes):
        self.method, self.path, self.query_string, self.headers, self.body = method, path, query_string, headers, body

    @classmethod
    def routing_text(cls, body: bytes) -> tuple[str, Any] | None:
        """``("messages", ...)`` or ``("prompt", ...)`` from a JSON body, when it has non-empty text there."""
        try:
            data = json.loads(body) if body else None
        except ValueError:
            return None
        if not isinstance(data, dict):
            return None
        for key in ("messages", "prompt", "input"):  # chat and Anthropic; completions; Responses
            value = data.get(key)
            if isinstance(value, str) and value:
                return "prompt", value
            if isinstance(value, list) and any(isinstance(m, dict) and isinstance(m.get("content"), str | list)
                                               for m in value):
                return "messages", value
        return None


async def run_asgi(app: Any, request: ForwardedRequest) -> AsyncIterator[tuple | bytes]:
    """Call the ASGI `app` with `request`: yields ``(status, headers)`` first, then each body chunk. Closing the
    generator (the client went away) tells the app the client disconnected, then cancels it."""
    scope = {
        "type": "http", "asgi": {"version": "3.0", "spec_version": "2.3"}, "http_version": "1.1",
        "method": request.method, "scheme": "http", "path": request.path, "raw_path": request.path.encode(),
        "query_string": request.query_string, "root_path": "", "headers": request.headers,
        "client": ("127.0.0.1", 0), "server": ("127.0.0.1", 80),
    }
    messages: asyncio.Queue = asyncio.Queue()
    disconnected = asyncio.Event()
    sent_body = False

    async def receive() -> dict:
        nonlocal sent_body
        if not sent_body:
            sent_body = True
            return {"type": "http.request", "body": request.body, "more_body": False}
        await disconnected.wait()
        return {"type": "http.disconnect"}

    async def send(message: dict) -> None:
        await messages.put(message)

    async def call() -> None:
        try:
            await app(scope, receive, send)
        finally:
            await messages.put(None)

    task = asyncio.create_task(call())
    try:
        while (message := await messages.get()) is not None:
            if message["type"] == "http.response.start":
                yield message["status"], [(bytes(k), bytes(v)) for k, v in message.get("headers", [])]
            elif message["type"] == "http.response.body":
                if message.get("body"):
                    yield bytes(message["body"])
                if not message.get("more_body", False):
                    break
        await task
    finally:
        disconnected.set()
        if not task.done():
            try:
                await asyncio.wait_for(asyncio.shield(task), timeout=5)
            except (asyncio.TimeoutError, Exception):  # noqa: BLE001 - the request is gone either way
                task.cancel()


class GpullamaReplica:
    """One replica: a loaded model, its engine and the ``gpullama-serve`` app (see the module's docstring)."""

    async def __init__(self, engine_args: dict, server_options: dict | None = None):
        from gpullama.server.app import create_app
        from gpullama.server.state import ServerConfig, ServerState

        options = {"allowed_hosts": ["*"], "log_stats_interval": 0.0, **(server_options or {})}
        self.config = ServerConfig(engine=EngineArgs(**engine_args), **options)
        self.state = ServerState(self.config)
        self.state.loop = asyncio.get_running_loop()
        await self.state.load()
        if self.state.status != "ready":
            raise RuntimeError(f"gpullama replica: cannot load {engine_args.get('model')}: {self.state.error}")
        self.app = create_app(self.config, self.state)

    async def forward(self, request: ForwardedRequest) -> AsyncIterator[tuple | bytes]:
        """Answer one forwarded HTTP request: ``(status, headers)``, then the body's chunks."""
        async for item in run_asgi(self.app, request):
            yield item

    async def check_health(self) -> None:
        """Ray's health check: the engine still runs (a dead one makes Ray replace this replica)."""
        engine = self.state.engine
        if engine is None or not engine.is_alive:
            raise RuntimeError(f"gpullama replica: the engine has stopped ({self.state.status})")

    def __del__(self) -> None:
        try:
            self.state.shutdown()
        except Exception:  # noqa: BLE001 - the process is ending
            pass


class GpullamaIngress:
    """The HTTP front: forwards every request to a replica, by prefix affinity when it has a prompt."""

    def __init__(self, replicas: DeploymentHandle):
        self.replicas = replicas.options(stream=True)

    def __serve_build_asgi_app__(self) -> Starlette:
        return Starlette(routes=[Route("/{path:path}", self.proxy, methods=_METHODS)])

    async def proxy(self, request: Request) -> StreamingResponse:
        body = await request.body()
        path, root = request.scope["path"], request.scope.get("root_path", "")
        if root and path.startswith(root):  # the app's route prefix (the replica's app is mounted at /)
            path = path[len(root):] or "/"
        forwarded = ForwardedRequest(request.method, path, request.scope.get("query_string", b""),
                                     list(request.scope["headers"]), body)
        routing = ForwardedRequest.routing_text(body)
        if routing is not None:
            setattr(forwarded, *routing)
            stream = self.replicas.forward.remote(forwarded)
        else:  # no positional argument: the prefix router leaves the choice to its power-of-two default
            stream = self.replicas.forward.remote(request=forwarded)
        status, headers = await stream.__anext__()

        async def chunks() -> AsyncIterator[bytes]:
            try:
                async for chunk in stream:
                    yield chunk
            finally:
                stream.cancel()

        response = StreamingResponse(chunks(), status_code=status)
        response.raw_headers = headers
        return response


def build_app(engine_args: EngineArgs | dict, *, num_replicas: int | None = 1,
              autoscaling_config: dict | None = None, num_cpus: float = 1, num_gpus: float = 0,
              prefix_affinity: bool = True, server_options: dict | None = None,
              max_ongoing_requests: int = MAX_ONGOING_PER_REPLICA) -> serve.Application:
    """The Ray Serve application: an ingress and `num_replicas` replicas (or `autoscaling_config`, Ray's dict),
    each reserving `num_cpus` CPUs and `num_gpus` GPUs. `engine_args` are `EngineArgs` (or their fields as a dict);
    `server_options` are `ServerConfig` fields (``api_key``, ``max_queue``, ...)."""
    if isinstance(engine_args, EngineArgs):
        import dataclasses

        engine_args = {f.name: getattr(engine_args, f.name) for f in dataclasses.fields(engine_args)}
    EngineArgs(**engine_args)  # bad arguments fail here, before any replica starts
    if autoscaling_config is not None:
        num_replicas = "auto" if num_replicas is None else None
    replica_options: dict[str, Any] = {
        "ray_actor_options": {"num_cpus": num_cpus, "num_gpus": num_gpus},
        "max_ongoing_requests": max_ongoing_requests,
        "health_check_period_s": 2,
    }
    if autoscaling_config is not None:
        replica_options["autoscaling_config"] = autoscaling_config
    else:
        replica_options["num_replicas"] = num_replicas
    if prefix_affinity:
        replica_options["request_router_config"] = RequestRouterConfig(request_router_class=PREFIX_ROUTER)
    replica = serve.deployment(GpullamaReplica, name="GpullamaReplica", **replica_options)
    ingress = serve.deployment(serve.ingress()(GpullamaIngress), name="GpullamaIngress",
                               ray_actor_options={"num_cpus": 0}, max_ongoing_requests=10_000)
    return ingress.bind(replica.bind(engine_args, server_options))


def app_builder(args: dict[str, str]) -> serve.Application:
    """For ``serve run gpullama.integrations.ray:app_builder key=value ...``: `EngineArgs` fields (``model``,
    ``threads``, ...) and ``num_replicas``, ``num_cpus``, ``num_gpus``, ``prefix_affinity``."""
    args = dict(args)
    options: dict[str, Any] = {}
    for key, kind in (("num_replicas", int), ("num_cpus", float), ("num_gpus", float)):
        if key in args:
            options[key] = kind(args.pop(key))
    if "prefix_affinity" in args:
        options["prefix_affinity"] = args.pop("prefix_affinity").lower() not in ("0", "false", "no")
    import dataclasses

    kinds = {f.name: f.type for f in dataclasses.fields(EngineArgs)}
    engine: dict[str, Any] = {}
    for key, value in args.items():
        if key not in kinds:
            raise ValueError(f"unknown argument {key!r}: EngineArgs fields, num_replicas, num_cpus, num_gpus, "
                             "prefix_affinity")
        kind = str(kinds[key])
        engine[key] = int(value) if kind.startswith("int") else \
            value.lower() not in ("0", "false", "no") if kind == "bool" else value
    return build_app(engine, **options)
