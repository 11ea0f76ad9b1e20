"""Server configuration and the shared state: the model and engine, loaded after the socket is up; the readiness
and model checks every route makes."""

from __future__ import annotations

import asyncio
import ipaddress
import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from starlette.requests import Request

from gpullama import __version__
from gpullama.engine.args import EngineArgs
from gpullama.engine.errors import EngineStopped
from gpullama.engine.kv_events import KVEventsConfig
from gpullama.vision.images import ImagePolicy

from .engine_log import DEFAULT_INTERVAL_S, log_engine_status
from .http.errors import APIError
from .http.metrics import ServerMetrics

log = logging.getLogger("gpullama.server")

BUILD_INFO = f"gpullama-{__version__}"
"""This server and its version: chat and completions' ``system_fingerprint``, ``/props``' ``build_info``."""
DEFAULT_MAX_BODY_BYTES = 4 * 1024 * 1024
DEFAULT_MAX_QUEUE = 256  # requests waiting for a place in the batch, then 429
DEFAULT_MAX_CONNECTIONS = 512  # open connections, then uvicorn answers 503
DEFAULT_REQUEST_TIMEOUT = 600.0  # seconds from arrival to the last token, then 504 (llama.cpp's --timeout)
DEFAULT_HEADER_TIMEOUT = 10.0  # seconds for a request line and headers, then the connection is closed
DEFAULT_BODY_TIMEOUT = 30.0  # seconds for the request body, then 408
DEFAULT_KEEP_ALIVE_TIMEOUT = 5.0  # seconds an idle keep-alive connection stays open (uvicorn's default)
LOOPBACK_HOSTS = ("localhost", "*.localhost", "127.0.0.1", "[::1]")  # names that only reach this machine


REASONING_MODES = ("on", "off", "auto")


@dataclass(frozen=True)
class ChatDefaults:
    """What every chat render takes from the server's flags (llama.cpp's): `reasoning` (``--reasoning``), the
    template's ``enable_thinking`` unless the request sets it (``on`` true, ``off`` false, ``auto`` true where the
    template reads it); `prefill_assistant` (``--no-prefill-assistant`` turns it off), whether a conversation that
    ends with an assistant message continues that message."""

    reasoning: str = "auto"
    prefill_assistant: bool = True

    def enable_thinking(self, thinking_switch: bool) -> bool:
        """The ``enable_thinking`` of a render whose request leaves it out, for a template that reads it or not."""
        return self.reasoning == "on" or (self.reasoning == "auto" and thinking_switch)


@dataclass(frozen=True)
class RequestDefaults:
    """Server-wide values of the request fields a request leaves out, for every API family (llama.cpp's
    ``--temp``, ``--seed``, ``-n``/``--n-predict``, ``--verbose``); None: each API's own default."""

    temperature: float | None = None
    seed: int | None = None
    max_tokens: int | None = None
    verbose: bool = False  # answers carry llama.cpp's "__verbose" unless the request says "verbose": false
    # LoRA adapters (gpullama/server/adapters.py): llama.cpp's applied to every request that has no `lora` field,
    # (engine id, scale) pairs (None: none); the named ones a request's `model` picks, (name, pairs) pairs
    lora: tuple[tuple[int, float], ...] | None = None
    lora_models: tuple[tuple[str, tuple[tuple[int, float], ...]], ...] = ()

    def lora_of_model(self, model: Any) -> list[tuple[int, float]] | None:
        """The adapters of a request whose `model` is a named adapter's name (None: it is not one)."""
        for name, pairs in self.lora_models:
            if name == model:
                return list(pairs)
        return None

    def sampling(self) -> dict[str, Any]:
        """The `SamplingParams` fields these defaults set."""
        given = {"temperature": self.temperature, "seed": self.seed, "max_tokens": self.max_tokens}
        return {name: value for name, value in given.items() if value is not None}


NO_DEFAULTS = RequestDefaults()


@dataclass
class ServerConfig:
    """Settings of ``gpullama-serve``: the engine's arguments and the server's own."""

    engine: EngineArgs = field(default_factory=EngineArgs)
    host: str = "127.0.0.1"
    port: int = 8080
    served_model_name: str | None = None
    api_key: str | None = None
    max_body_bytes: int = DEFAULT_MAX_BODY_BYTES
    max_queue: int = DEFAULT_MAX_QUEUE
    max_connections: int = DEFAULT_MAX_CONNECTIONS
    request_timeout: float | None = DEFAULT_REQUEST_TIMEOUT  # None or 0: no limit
    header_timeout: float = DEFAULT_HEADER_TIMEOUT
    body_timeout: float = DEFAULT_BODY_TIMEOUT
    keep_alive_timeout: float = DEFAULT_KEEP_ALIVE_TIMEOUT
    allowed_hosts: list[str] | None = None  # None: loopback names when bound to a loopback address, else any
    allowed_origins: list[str] = field(default_factory=list)  # CORS; empty: off
    log_stats_interval: float = DEFAULT_INTERVAL_S  # seconds between engine status lines; 0: none
    kv_events: KVEventsConfig | None = None  # publish KV-cache events (vLLM's format) when enabled
    webui: bool = True  # the chat page at / (--no-webui: off)
    root_path: str = ""  # the path prefix a reverse proxy serves this server under (--root-path), such as /llm
    chat: ChatDefaults = field(default_factory=ChatDefaults)  # --reasoning, --no-prefill-assistant
    defaults: RequestDefaults = NO_DEFAULTS  # --temp, --seed, -n, --verbose
    pooling: str | None = None  # --pooling: how embeddings pool (mean, cls, last, none); None: the model's
    lora: list = field(default_factory=list)  # --lora, --lora-scaled: gpullama.server.adapters.LoraSpec
    lora_init_without_apply: bool = False  # --lora-init-without-apply (llama.cpp's): unnamed adapters at scale 0
    lora_runtime_updating: bool = False  # --enable-lora-runtime-updating: /v1/load_lora_adapter and unload
    images: ImagePolicy = field(default_factory=ImagePolicy)  # --max-image-bytes, --allowed-media-domains, ...

    def host_patterns(self) -> list[str]:
        """The Host header values accepted (`allowed_hosts`, else the default for the bound address)."""
        if self.allowed_hosts is not None:
            return self.allowed_hosts
        hosts = [host.strip() for host in self.host.split(",")]  # every address of --host
        if not all(is_loopback(host) for host in hosts):
            return ["*"]
        bound = [f"[{h.strip('[]')}]" if ":" in h else h for h in hosts]  # such as 127.0.0.2, as a Host header
        return [*LOOPBACK_HOSTS, *(h for h in bound if h not in LOOPBACK_HOSTS)]


def is_loopback(host: str) -> bool:
    """Whether a bind address only accepts connections from this machine."""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


def load_engine(config: ServerConfig) -> tuple[Any, Callable[[Any], Any]]:
    """Load the model (blocking; run in a thread); return it with the engine factory to call on the event loop."""
    from gpullama.chat.model_format import chat_format
    from gpullama.engine.async_engine import AsyncEngine
    from gpullama.llm import LLM

    from .adapters import load_adapters

    llm = LLM.from_engine_args(config.engine)
    llm.served_adapters = load_adapters(llm, config.lora, config.lora_init_without_apply)
    chat_format(llm.tokenizer)  # scans the vocabulary once, here rather than on the event loop
    return llm, lambda loaded: AsyncEngine(loaded.engine)


class ServerState:
    """What every route reads: status (``loading``/``ready``/``failed``), model, engine, metrics."""

    def __init__(self, config: ServerConfig,
                 loader: Callable[[ServerConfig], tuple[Any, Callable[[Any], Any]]] = load_engine) -> None:
        self.config = config
        self.loader = loader
        self.status = "loading"
        self.error: str | None = None
        self.llm: Any = None
        self.engine: Any = None
        self.model_name: str | None = config.served_model_name
        self.created = int(time.time())
        self.metrics = ServerMetrics()
        self.on_load_failed: Callable[[BaseException], None] | None = None
        self.loop: asyncio.AbstractEventLoop | None = None  # the server's event loop, once it runs
        self._status_task: asyncio.Task | None = None
        self.kv_events: Any = None  # the KV-event publisher, when the config enables one
        self.adapters: list = []  # the loaded LoRA adapters (gpullama.server.adapters.ServedAdapter)

    async def load(self) -> None:
        """Load the model off the event loop, then start the engine; on failure record it and notify."""
        start = time.perf_counter()
        args = self.config.engine
        log.info("loading model %s (device=%s, dtype=%s, max_model_len=%s)", args.model, args.device, args.dtype,
                 args.max_model_len)
        try:
            llm, engine_cls = await self._load_in_thread()
            self._start_kv_events(llm)
            self.engine = engine_cls(llm)
            self.llm = llm
        except Exception as exc:  # noqa: BLE001 - any loading failure ends the server with a clear log line
            self.status, self.error = "failed", f"{type(exc).__name__}: {exc}"
            log.error("loading model %s failed: %s", args.model, self.error)
            if self.on_load_failed is not None:
                self.on_load_failed(exc)
            return
        self.model_name = self.config.served_model_name or llm.model_name
        self.set_adapters(getattr(llm, "served_adapters", []))
        self.status = "ready"
        if self.config.log_stats_interval > 0 and hasattr(llm, "engine"):
            self._status_task = asyncio.create_task(log_engine_status(llm.engine, self.config.log_stats_interval))
        log.info("model %s ready on device %s (max_model_len=%d) in %.1fs; serving at http://%s:%d",
                 self.model_name, llm.device, llm.max_model_len, time.perf_counter() - start,
                 self.config.host, self.config.port)

    def set_adapters(self, adapters: list) -> None:
        """The loaded LoRA adapters changed (load, unload, POST /lora-adapters): the request defaults follow."""
        from .adapters import lora_defaults

        self.adapters = adapters
        self.config.defaults = lora_defaults(self.config.defaults, adapters)

    def _start_kv_events(self, llm: Any) -> None:
        """Publish the prefix cache's KV events when the config asks for them (before the engine runs a step)."""
        events = self.config.kv_events
        if events is None or not events.enabled:
            return
        from gpullama.engine.kv_events import KVEventPublisher

        self.kv_events = KVEventPublisher.from_config(events)
        llm.engine.block_manager.event_sink = self.kv_events.record
        log.info("KV-cache events on %s%s", events.endpoint,
                 f" (replay on {events.replay_endpoint})" if events.replay_endpoint else "")

    async def _load_in_thread(self) -> tuple[Any, Callable[[Any], Any]]:
        # A daemon thread, not the default executor: a server that stops mid-load (port in use, Ctrl-C) must not
        # wait for the load to finish before the process can exit.
        loop = asyncio.get_running_loop()
        future: asyncio.Future = loop.create_future()

        def settle(value: Any, exc: BaseException | None) -> None:
            if not future.done():
                future.set_exception(exc) if exc is not None else future.set_result(value)

        def work() -> None:
            try:
                value, exc = self.loader(self.config), None
            except BaseException as error:  # noqa: BLE001 - handed to the event loop
                value, exc = None, error
            try:
                loop.call_soon_threadsafe(settle, value, exc)
            except RuntimeError:  # the loop is already closed: the server stopped while loading
                pass

        threading.Thread(target=work, name="gpullama-load", daemon=True).start()
        return await future

    def begin_shutdown(self) -> None:
        """The server is stopping (SIGINT/SIGTERM): refuse new requests and stop the engine after its current
        step; every open stream then ends with an error event and ``[DONE]`` instead of waiting to be cut."""
        if self.status in ("loading", "ready"):
            self.status = "stopping"
        if self.engine is not None:
            self.engine.stop(EngineStopped("the server is shutting down"))

    def shutdown(self) -> None:
        """Stop the engine's step loop."""
        if self._status_task is not None:
            self._status_task.cancel()
        if self.engine is not None:
            self.engine.shutdown()
            self.engine = None
        if self.kv_events is not None:
            self.kv_events.close()
            self.kv_events = None
        if hasattr(self.llm, "shutdown"):  # tensor-parallel worker processes
            self.llm.shutdown()
        self.status = "stopped"


def server_state(request: Request) -> ServerState:
    """The server's shared state."""
    return request.app.state.server


def require_ready(state: ServerState) -> None:
    """503 while the model loads, when it failed to, while the server stops, or when the engine has stopped."""
    if state.status == "loading":
        raise APIError(503, "the model is still loading; retry when GET /health answers 200", code="model_loading")
    if state.status == "stopping":
        raise APIError(503, "the server is shutting down", code="engine_stopped")
    if state.status != "ready" or state.engine is None:
        raise APIError(503, f"the model is not available ({state.status}: {state.error})", code="model_unavailable")
    if not getattr(state.engine, "is_alive", True):
        raise APIError(503, "the generation engine has stopped; restart the server", code="engine_dead")


def check_model(state: ServerState, model: str | None) -> None:
    """404 unless `model` is absent, the served model's name or a named LoRA adapter's (``--lora name=path``)."""
    if model is not None and model != state.model_name and state.config.defaults.lora_of_model(model) is None:
        raise APIError(404, f"The model `{model}` does not exist; this server serves `{state.model_name}`.",
                       param="model", code="model_not_found")
