"""Server configuration and the shared state: the model and engine, loaded after the socket is up; the readiness
and model checks every route makes."""

from __future__ import annotations

import asyncio
import ipaddress
import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from typing import Any

from starlette.requests import Request

from gpullama import __version__
from gpullama.engine.args import EngineArgs
from gpullama.engine.errors import EngineStopped
from gpullama.engine.kv_events import KVEventsConfig
from gpullama.hub import check_model
from gpullama.vision.images import ImagePolicy

from .engine_log import DEFAULT_INTERVAL_S
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

    def lora_for(self, model: Any) -> list[tuple[int, float]] | None:
        """The adapters of a request without a ``lora`` field of its own: the named adapter its `model` names (vLLM),
        else the server's at their global scales (llama.cpp); None: the base model."""
        lora = self.lora_of_model(model)
        return lora if lora is not None else (list(self.lora) if self.lora is not None else None)

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
    models: list[tuple[str, str]] = field(default_factory=list)  # (name, path) of each model; empty: engine.model
    models_dir: str | None = None  # --models-dir: where `models` came from (a server of several models)
    keep_alive: float = 300.0  # --keep-alive: seconds an idle model stays loaded (negative: forever)
    max_loaded_models: int = 0  # --max-loaded-models: loaded at once, then the LRU idle one goes (0: no limit)
    max_model_memory: int | None = None  # --max-model-memory: bytes the loaded models hold together (None: no limit)

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
    """What every route reads: status (``loading``/``ready``/``failed``), the served models (`registry`), metrics;
    ``llm``, ``engine`` and ``model_name`` are the default (first) model's."""

    def __init__(self, config: ServerConfig,
                 loader: Callable[[ServerConfig], tuple[Any, Callable[[Any], Any]]] = load_engine,
                 check_file: Callable[[str], None] = check_model) -> None:
        from .registry import ModelState, Registry, display_name

        self.config = config
        self.loader = loader
        # a model's file checked before its load makes room (milliseconds; ValueError naming what is wrong)
        self.check_file = check_file
        self.status = "loading"
        self.error: str | None = None
        self.created = int(time.time())
        specs = config.models or [(config.served_model_name or display_name(config.engine.model), config.engine.model)]
        self.multi = len(specs) > 1 or config.models_dir is not None
        self.metrics = ServerMetrics(labelled=self.multi)
        self.registry = Registry(self, config.max_loaded_models, config.max_model_memory)
        self.models: dict[str, ModelState] = {}
        for name, path in specs:  # --mmproj names the default model's projector (the others find theirs beside them)
            args = replace(config.engine, model=path, **({} if not self.models else {"mmproj": None}))
            self.models[name] = ModelState(self, name, args, pinned=not self.models)
        self.default: ModelState = next(iter(self.models.values()))
        self.on_load_failed: Callable[[BaseException], None] | None = None
        self.loop: asyncio.AbstractEventLoop | None = None  # the server's event loop, once it runs
        self.kv_events: Any = None  # the KV-event publisher, when the config enables one

    @property
    def llm(self) -> Any:
        return self.default.llm

    @property
    def engine(self) -> Any:
        return self.default.engine

    @property
    def model_name(self) -> str:
        return self.default.name

    @property
    def adapters(self) -> list:
        """The default model's loaded LoRA adapters (gpullama.server.adapters.ServedAdapter)."""
        return self.default.adapters

    def set_adapters(self, adapters: list) -> None:
        """The default model's LoRA adapters changed (load, unload, POST /lora-adapters): its request defaults
        follow."""
        self.default.set_adapters(adapters)

    async def load(self) -> None:
        """Load the default model off the event loop, then start its engine; on failure record it and notify (a
        server of several models goes on serving the others)."""
        start = time.perf_counter()
        await self.default._load()
        if self.status == "stopping":
            return
        if self.default.status != "loaded":
            if not self.multi:
                self.status, self.error = "failed", self.default.error
                if self.on_load_failed is not None:
                    self.on_load_failed(RuntimeError(self.error))
                return
            log.error("the default model %s failed to load; serving the others", self.default.name)
        self.status = "ready"
        llm = self.default.llm
        if llm is not None:
            log.info("model %s ready on device %s (max_model_len=%d) in %.1fs; serving at http://%s:%d",
                     self.model_name, llm.device, llm.max_model_len, time.perf_counter() - start,
                     self.config.host, self.config.port)
        if self.multi:
            log.info("serving %d models: %s", len(self.models), ", ".join(self.models))

    def changed(self) -> None:
        self.registry.changed()

    async def make_room(self, entry: Any) -> None:
        await self.registry.make_room(entry, lambda: self.status in ("stopping", "stopped"))

    def start_kv_events(self, llm: Any) -> None:
        """Publish the prefix cache's KV events when the config asks for them (before the engine runs a step)."""
        events = self.config.kv_events
        if events is None or not events.enabled:
            return
        from gpullama.engine.kv_events import KVEventPublisher

        self.kv_events = KVEventPublisher.from_config(events)
        llm.engine.block_manager.event_sink = self.kv_events.record
        log.info("KV-cache events on %s%s", events.endpoint,
                 f" (replay on {events.replay_endpoint})" if events.replay_endpoint else "")

    def stop_kv_events(self) -> None:
        if self.kv_events is not None:
            self.kv_events.close()
            self.kv_events = None

    async def load_in_thread(self, config: ServerConfig) -> tuple[Any, Callable[[Any], Any]]:
        """``loader(config)`` in a thread of its own, awaited."""
        # A daemon thread, not the default executor: a server that stops mid-load (port in use, Ctrl-C) must not
        # wait for the load to finish before the process can exit.
        # The loaded model travels in `box`, emptied once taken: no future, handle or closure the event loop may
        # keep a while holds on to it (an unloaded model's memory must go back at once).
        loop = asyncio.get_running_loop()
        future: asyncio.Future = loop.create_future()
        box: list[Any] = []

        def settle(exc: BaseException | None) -> None:
            if not future.done():
                future.set_exception(exc) if exc is not None else future.set_result(None)

        def work() -> None:
            exc = None
            try:
                box.append(self.loader(config))
            except BaseException as error:  # noqa: BLE001 - handed to the event loop
                exc = error
            try:
                loop.call_soon_threadsafe(settle, exc)
            except RuntimeError:  # the loop is already closed: the server stopped while loading
                box.clear()

        threading.Thread(target=work, name="gpullama-load", daemon=True).start()
        await future
        return box.pop()

    def begin_shutdown(self) -> None:
        """The server is stopping (SIGINT/SIGTERM): refuse new requests and stop the engines after their current
        step; every open stream then ends with an error event and ``[DONE]`` instead of waiting to be cut."""
        if self.status in ("loading", "ready"):
            self.status = "stopping"
        for entry in self.models.values():
            if entry.engine is not None:
                entry.engine.stop(EngineStopped("the server is shutting down"))
        self.changed()

    def shutdown(self) -> None:
        """Stop every engine's step loop."""
        for entry in self.models.values():
            entry.shutdown()
        self.stop_kv_events()
        self.status = "stopped"


def server_state(request: Request) -> ServerState:
    """The server's shared state."""
    return request.app.state.server


def require_ready(state: ServerState) -> None:
    """503 while the default model loads at start-up, when it failed to, or while the server stops (each model's
    own readiness, its engine's included, is checked when a request takes it: `registry.use_model`)."""
    if state.status == "loading":
        raise APIError(503, "the model is still loading; retry when GET /health answers 200", code="model_loading")
    if state.status == "stopping":
        raise APIError(503, "the server is shutting down", code="engine_stopped")
    if state.status != "ready":
        raise APIError(503, f"the model is not available ({state.status}: {state.error})", code="model_unavailable")


def check_model(state: ServerState, model: str | None) -> None:
    """404 unless `model` is absent, the served model's name or a named LoRA adapter's (``--lora name=path``)."""
    if model is not None and model != state.model_name and state.config.defaults.lora_of_model(model) is None:
        raise APIError(404, f"The model `{model}` does not exist; this server serves `{state.model_name}`.",
                       param="model", code="model_not_found")
