"""The model registry: the models one server serves, each by a name; loaded on demand in the background, kept for
its ``keep_alive`` (Ollama's semantics), unloaded when that runs out, when a request or ``POST /models/unload``
asks, or when ``--max-loaded-models`` or ``--max-model-memory`` needs room (the least recently used idle model
goes first).

A request holds its model (a lease) from the moment its ``model`` is resolved until its answer, streamed or not,
is sent; a model is never unloaded while a request holds it. `LeaseMiddleware` gives the leases back.
"""

from __future__ import annotations

import asyncio
import ctypes
import ctypes.util
import gc
import logging
import math
import re
import time
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path
from typing import Any

from starlette.requests import Request
from starlette.types import ASGIApp, Receive, Scope, Send

from gpullama.engine.args import EngineArgs
from gpullama.hub import ALIASES, resolve_model

from .http.errors import APIError

ServerState = Any
"""`gpullama.server.state.ServerState`, which builds the registry: named here without an import (state imports this
module; the layers import downward only)."""

log = logging.getLogger("gpullama.server")

FOREVER = -1.0
"""A keep-alive that never runs out (Ollama's negative ``keep_alive``)."""
DEFAULT_KEEP_ALIVE = 300.0  # seconds: Ollama's 5 minutes
_LEASES = "gpullama.model_leases"  # the scope key of a request's leases
_ASKED = "gpullama.model_asked"  # the scope key of the `model` a request named
MODEL_STATES = ("loaded", "loading", "unloaded", "failed")

_GO_UNITS = {"ns": 1e-9, "us": 1e-6, "µs": 1e-6, "μs": 1e-6, "ms": 1e-3, "s": 1.0, "m": 60.0, "h": 3600.0}
_GO_DURATION = re.compile(r"([0-9]*\.?[0-9]+)(ns|us|µs|μs|ms|s|m|h)")


def parse_keep_alive(value: Any, param: str = "keep_alive") -> float:
    """Seconds of a ``keep_alive`` as Ollama reads it: a number of seconds or a Go duration string (``"5m"``,
    ``"1h30m"``, ``"0"``); a negative one keeps the model forever (`FOREVER`). ValueError naming `param`."""
    if isinstance(value, bool) or value is None:
        raise ValueError(f"'{param}' must be a number of seconds or a duration such as \"5m\", got {value!r}")
    if isinstance(value, (int, float)):
        seconds = float(value)
    elif isinstance(value, str):
        text = value.strip()
        sign, body = (-1.0, text[1:]) if text.startswith("-") else (1.0, text.removeprefix("+"))
        if body == "0":
            seconds = 0.0
        else:
            parts = _GO_DURATION.findall(body)
            if not body or "".join(n + u for n, u in parts) != body:
                raise ValueError(f"'{param}' must be a number of seconds or a duration such as \"5m\", \"1h30m\" or "
                                 f"\"-1\" (forever), got {value!r}")
            seconds = sign * sum(float(n) * _GO_UNITS[u] for n, u in parts)
    else:
        raise ValueError(f"'{param}' must be a number of seconds or a duration such as \"5m\", got {value!r}")
    if math.isnan(seconds):
        raise ValueError(f"'{param}' must be a number, got {value!r}")
    return FOREVER if seconds < 0 or math.isinf(seconds) else seconds


def display_name(reference: str) -> str:
    """The name a model reference is served under when none is given: an alias as itself, else the file's stem
    (as `LLM.model_name`)."""
    return reference if reference in ALIASES else Path(reference).stem


def parse_model_spec(text: str) -> tuple[str, str]:
    """``--model`` as given: ``NAME=PATH`` (a name of its own), else a path or alias served under its stem."""
    name, sep, path = text.partition("=")
    if sep and name and path and "/" not in name and not Path(text).exists():
        return name, path
    return display_name(text), text


def models_in_dir(folder: str) -> list[tuple[str, str]]:
    """(name, path) of every GGUF in `folder` (sorted by name), skipping projector files (``mmproj*.gguf``);
    ValueError when it is not a folder or holds none."""
    root = Path(folder)
    if not root.is_dir():
        raise ValueError(f"--models-dir {folder}: not a directory")
    found = [(p.stem, str(p)) for p in sorted(root.glob("*.gguf")) if not p.name.lower().startswith("mmproj")]
    if not found:
        raise ValueError(f"--models-dir {folder}: no *.gguf model files in it")
    return found


def mib(nbytes: int) -> str:
    """Bytes in MiB, for messages."""
    return f"{nbytes / 2**20:.1f} MiB"


class MemoryBudgetError(Exception):
    """A model that cannot fit in ``--max-model-memory`` even alone."""


def _release_memory() -> None:
    """Collect the unloaded model's objects and hand freed heap pages back to the OS (glibc's malloc_trim)."""
    gc.collect()
    try:
        import torch

        if torch.cuda.is_available():
            torch.cuda.empty_cache()
    except Exception:  # noqa: BLE001 - best effort
        pass
    libc = ctypes.util.find_library("c")
    if libc:
        try:
            ctypes.CDLL(libc).malloc_trim(0)
        except (OSError, AttributeError):
            pass


class ModelState:
    """One served model: its name, engine arguments and state (``unloaded``, ``loading``, ``loaded``, ``failed``);
    once loaded, what a route reads of it (``llm``, ``engine``, ``model_name``, ``config``, ``metrics``), the same
    names `ServerState` has for the default model."""

    def __init__(self, server: ServerState, name: str, engine_args: EngineArgs, pinned: bool = False) -> None:
        self.server = server
        self.name = self.model_name = name
        # LoRA adapters (--lora) belong to the default (first) model: the others load none
        self.config = replace(server.config, engine=engine_args, served_model_name=name,
                              lora=server.config.lora if pinned else [])
        self.adapters: list = []  # its loaded LoRA adapters (gpullama.server.adapters.ServedAdapter)
        self.metrics = server.metrics.for_model(name)
        self.created = server.created
        self.status = "unloaded"
        self.error: str | None = None
        self.llm: Any = None
        self.engine: Any = None
        self.active = 0  # requests holding it
        self.last_used = 0.0  # time.monotonic() of its last lease's end (or start)
        self.loaded_at: float | None = None
        self.load_seconds: float | None = None
        # bytes it holds (weights, KV pool, states: `LLM.memory_bytes`), measured at its last load (None: never
        # loaded); `reserved` is what ``--max-model-memory`` counts for it while it loads or is loaded (0: nothing)
        self.memory_bytes: int | None = None
        self.reserved = 0
        self.error_code = "model_load_failed"
        # keep-alive: the default (first) model, loaded at start, stays until a request says otherwise
        self.base_keep_alive = FOREVER if pinned else server.config.keep_alive
        self.keep_alive = self.base_keep_alive
        self.expires_at: float | None = None  # wall-clock time it unloads at, while idle; None: not while idle
        self._timer: asyncio.TimerHandle | None = None
        self._loading: asyncio.Future | None = None
        self._status_task: asyncio.Task | None = None
        self._released: asyncio.Future | None = None

    @property
    def path(self) -> str:
        return self.config.engine.model

    # -- loading ------------------------------------------------------------------------------------
    async def ensure_loaded(self) -> None:
        """Load the model unless it is loaded (one load at a time, shared by every request waiting for it); an
        APIError when it cannot be (500 naming why; 503 when its engine has stopped)."""
        if self.status == "loaded":
            if not getattr(self.engine, "is_alive", True):
                raise APIError(503, "the generation engine has stopped; restart the server", code="engine_dead")
            return
        if self._loading is None or self._loading.done():
            self._loading = asyncio.ensure_future(self._load())
        await asyncio.shield(self._loading)
        if self.status != "loaded":
            if self.error_code == "model_too_large":
                raise APIError(500, f"model '{self.name}' cannot be loaded: {self.error}", param="model",
                               code=self.error_code)
            raise APIError(500, f"model '{self.name}' failed to load: {self.error}", param="model",
                           code=self.error_code)

    async def _load(self) -> None:
        self.status, self.error, self.error_code = "loading", None, "model_load_failed"
        self.server.changed()
        start = time.perf_counter()
        args = self.config.engine
        try:
            # a file that cannot load fails here, in milliseconds, before another model is unloaded for its room
            await asyncio.to_thread(self.server.check_file, args.model)
            await self.server.make_room(self)
            log.info("loading model %s from %s (device=%s, dtype=%s, max_model_len=%s)", self.name, args.model,
                     args.device, args.dtype, args.max_model_len)
            llm, engine_factory = await self.server.load_in_thread(self.config)
            if self is self.server.default:
                self.server.start_kv_events(llm)
            engine = engine_factory(llm)
        except MemoryBudgetError as exc:  # too large for --max-model-memory even alone: not loaded
            self.status, self.error, self.error_code, self.reserved = "failed", str(exc), "model_too_large", 0
            log.error("model %s: %s", self.name, self.error)
            self.server.changed()
            return
        except Exception as exc:  # noqa: BLE001 - a failed load fails this model's requests, nothing else
            self.status, self.error, self.reserved = "failed", f"{type(exc).__name__}: {exc}", 0
            log.error("loading model %s failed: %s", self.name, self.error)
            self.server.changed()
            return
        self.memory_bytes = getattr(llm, "memory_bytes", 0)
        self.reserved = max(self.memory_bytes, 1)
        too_large = self.server.registry.after_load(self)
        if too_large is not None:  # measured, it does not fit even alone: dropped again
            self._release(engine, llm, None)
            del engine, llm
            self.status, self.error, self.error_code, self.reserved = "failed", too_large, "model_too_large", 0
            log.error("model %s: %s", self.name, self.error)
            self.server.changed()
            return
        served = getattr(llm, "served_adapters", [])
        if self.load_seconds is not None and (served or self.adapters):  # loaded before: its adapters as they were
            from .adapters import restore_adapters

            served = await asyncio.to_thread(restore_adapters, llm, served, self.adapters)
        self.llm, self.engine = llm, engine
        self.set_adapters(served)
        self.status, self.loaded_at = "loaded", time.time()
        self.load_seconds = time.perf_counter() - start
        self.last_used = time.monotonic()
        interval = self.server.config.log_stats_interval
        if interval > 0 and hasattr(llm, "engine"):
            from .engine_log import log_engine_status

            self._status_task = asyncio.create_task(log_engine_status(llm.engine, interval))
        log.info("model %s loaded on device %s (max_model_len=%d) in %.1fs, holding %s", self.name, llm.device,
                 llm.max_model_len, self.load_seconds, mib(self.memory_bytes))
        self.server.changed()
        if self.active == 0:  # loaded by itself (at start-up): its keep-alive runs from now
            self.schedule_expiry()

    def set_adapters(self, adapters: list) -> None:
        """Its loaded LoRA adapters changed (load, unload, POST /lora-adapters): its request defaults follow."""
        from .adapters import lora_defaults

        self.adapters = adapters
        self.config.defaults = lora_defaults(self.config.defaults, adapters)

    # -- keep-alive and unloading -------------------------------------------------------------------------
    def hold(self, keep_alive: float | None) -> None:
        """A request takes the model: its keep-alive is the request's (else the model's base one)."""
        self.active += 1
        self.last_used = time.monotonic()
        self.keep_alive = self.base_keep_alive if keep_alive is None else keep_alive
        self._cancel_timer()
        self.expires_at = None

    def release(self) -> None:
        """A request let go of the model; when none holds it, its keep-alive starts."""
        self.active -= 1
        self.last_used = time.monotonic()
        if self.active == 0:
            self.schedule_expiry()
        self.server.changed()

    def schedule_expiry(self) -> None:
        """Idle now: unload at once (keep-alive 0), after the keep-alive, or never (negative)."""
        self._cancel_timer()
        if self.status != "loaded":
            self.expires_at = None
            return
        if self.keep_alive == FOREVER:
            self.expires_at = None
        elif self.keep_alive <= 0:
            self.unload()
        else:
            self.expires_at = time.time() + self.keep_alive
            loop = asyncio.get_running_loop()
            self._timer = loop.call_later(self.keep_alive, self._expire)

    def _expire(self) -> None:
        self._timer = None
        if self.active == 0 and self.status == "loaded":
            log.info("model %s: keep-alive of %gs ran out", self.name, self.keep_alive)
            self.unload()

    def request_unload(self) -> None:
        """Unload now if idle, else once the requests holding it end (llama.cpp's ``/models/unload``, Ollama's
        ``keep_alive: 0``)."""
        self.keep_alive = 0.0
        if self.active == 0:
            self.unload()

    def unload(self) -> None:
        """Stop the engine and drop the model (only when no request holds it)."""
        if self.active or self.status != "loaded":
            return
        self._cancel_timer()
        self.expires_at = None
        engine, llm = self.engine, self.llm
        self.engine = self.llm = None
        self.status, self.loaded_at, self.reserved = "unloaded", None, 0
        self.keep_alive = self.base_keep_alive
        status_task, self._status_task = self._status_task, None
        if status_task is not None:
            status_task.cancel()
        self._release(engine, llm, status_task)
        del engine, llm
        log.info("model %s unloaded", self.name)
        self.server.changed()

    def _release(self, engine, llm, status_task: asyncio.Task | None) -> None:
        """Stop `engine` and `llm` (the callers drop their last references), end the KV events of the default
        model, and give their memory back in the background (`_give_back_memory`)."""
        if engine is not None:
            engine.shutdown()
        if hasattr(llm, "shutdown"):
            llm.shutdown()
        if self is self.server.default:
            self.server.stop_kv_events()
        self._released = asyncio.ensure_future(self._give_back_memory(status_task))

    async def _give_back_memory(self, status_task: asyncio.Task | None) -> None:
        if status_task is not None:  # it holds the engine until its cancellation has run
            await asyncio.gather(status_task, return_exceptions=True)
        _release_memory()
        # some of the freed pages only become trimmable a moment later (seen: RSS fell by 300 MB more after 1 s)
        asyncio.get_running_loop().call_later(1.0, _release_memory)

    async def released(self) -> None:
        """Wait until an unloaded model's memory has gone back (its last references dropped, the heap trimmed)."""
        if self._released is not None:
            await asyncio.shield(self._released)

    def _cancel_timer(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None

    def shutdown(self) -> None:
        """The server stops: stop the engine whatever holds it."""
        self._cancel_timer()
        if self._status_task is not None:
            self._status_task.cancel()
        if self.engine is not None:
            self.engine.shutdown()
            self.engine = None
        if hasattr(self.llm, "shutdown"):
            self.llm.shutdown()


def lookup(server: ServerState, name: str | None) -> ModelState | None:
    """The served model a request's ``model`` names: absent or empty, the default model; a served name, that
    model (Ollama's ``:latest`` tag allowed); else None. The one place a request's model name is resolved."""
    if name is None or name == "":
        return server.default
    entry = server.models.get(name)
    if entry is None and name.endswith(":latest"):
        entry = server.models.get(name.removesuffix(":latest"))
    if entry is None and server.default.config.defaults.lora_of_model(name) is not None:
        entry = server.default  # a named LoRA adapter (--lora NAME=PATH) of the default model
    return entry


def unknown_model(server: ServerState, name: str, path: str) -> APIError:
    """404 for a model this server does not serve, naming those it does (Ollama's phrasing under /api/)."""
    names = list(server.models)
    if path.startswith("/api/"):
        there = ", ".join(f"'{n}'" for n in names)
        return APIError(404, f"model '{name}' not found; this server serves {there}", param="model",
                        code="model_not_found")
    there = ", ".join(f"`{n}`" for n in names)
    return APIError(404, f"The model `{name}` does not exist; this server serves {there}.", param="model",
                    code="model_not_found")


def find_model(request: Request, name: Any) -> ModelState:
    """The model a request names, without loading it: 404 for an unknown name on a server of several models (a
    server of one model answers every name with it; its routes' own model check gives today's 404)."""
    server = request.app.state.server  # state.server_state's reading
    if not server.multi or not isinstance(name, str):
        return server.default
    entry = lookup(server, name)
    if entry is None:
        raise unknown_model(server, name, request.url.path)
    return entry


async def use_model(request: Request, name: Any, keep_alive: float | None = None) -> ModelState:
    """The model a request names, loaded (waiting while it loads) and held until the request's answer is sent;
    `keep_alive` (seconds, `FOREVER`, or None for the model's own) is how long it stays once idle."""
    entry = find_model(request, name)
    request.scope[_ASKED] = name
    entry.hold(keep_alive)
    try:
        await entry.ensure_loaded()
    except BaseException:
        entry.release()
        raise
    leases = request.scope.get(_LEASES)
    if leases is None:  # not under LeaseMiddleware (a test's bare app): nothing would give it back
        entry.release()
    else:
        leases.append(entry)
    return entry


def answer_name(request: Request, entry: ModelState) -> str:
    """The ``model`` an answer names: a named LoRA adapter's name when the request's ``model`` picked one (vLLM
    answers so), else the model's."""
    asked = request.scope.get(_ASKED)
    if isinstance(asked, str) and asked != entry.model_name and entry.config.defaults.lora_of_model(asked) is not None:
        return asked
    return entry.model_name


def request_lora(request: Request, entry: ModelState) -> list[tuple[int, float]] | None:
    """The LoRA adapters of a request that has no ``lora`` field of its own (embeddings), by the ``model`` it named
    (`RequestDefaults.lora_for`)."""
    return entry.config.defaults.lora_for(request.scope.get(_ASKED))


class LeaseMiddleware:
    """Gives back the models a request held once its answer (a stream included) has been sent or abandoned."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        leases: list[ModelState] = []
        scope[_LEASES] = leases
        try:
            await self.app(scope, receive, send)
        finally:
            for entry in leases:
                entry.release()


class Registry:
    """What `ServerState` needs to manage several models: room for one more (``--max-loaded-models``, and
    ``--max-model-memory``: the bytes the loaded models may hold together)."""

    def __init__(self, server: ServerState, max_loaded: int, max_memory: int | None = None) -> None:
        self.server = server
        self.max_loaded = max_loaded
        self.max_memory = max_memory
        self._changed: asyncio.Event | None = None

    def changed(self) -> None:
        """A model was loaded, unloaded or let go of: wake whoever waits for room."""
        if self._changed is not None:
            self._changed.set()

    def _holding(self, entry: ModelState) -> list[ModelState]:
        """The other models that hold memory: loaded, or loading past `make_room`."""
        return [m for m in self.server.models.values() if m is not entry and m.reserved > 0]

    def _fits(self, entry: ModelState, others: list[ModelState], need: int) -> bool:
        if self.max_loaded > 0 and len(others) >= self.max_loaded:
            return False
        return self.max_memory is None or sum(m.reserved for m in others) + need <= self.max_memory

    def _too_large(self, entry: ModelState, need: int, measured: bool) -> str:
        how = "holds" if measured else "would hold (estimated from its file)"
        return (f"it {how} {mib(need)} (weights, KV pool and state), more than --max-model-memory "
                f"{mib(self.max_memory)} allows even alone: give more --max-model-memory, or load it with a "
                f"smaller --kv-cache-memory / --max-model-len")

    async def _need(self, entry: ModelState) -> int:
        """The bytes `entry` will hold once loaded: measured at its last load, else estimated from its file (0 when
        its file cannot be read: its load then fails by itself)."""
        if entry.memory_bytes is not None:
            return entry.memory_bytes
        # imported here, at the first load: model_spec imports torch, which `gpullama-serve --help` must not
        from gpullama.engine.model_spec import estimate_memory_bytes

        args = entry.config.engine
        try:
            return await asyncio.to_thread(estimate_memory_bytes, args, resolve_model(args.model, download=False))
        except Exception as exc:  # noqa: BLE001 - the load reports what is wrong with the file
            log.debug("model %s: no size estimate (%s)", entry.name, exc)
            return 0

    async def make_room(self, entry: ModelState, is_stopping: Callable[[], bool]) -> None:
        """Before `entry` loads: while the loaded (and loading) models are at a limit (their count, or their bytes
        with `entry`'s), unload the least recently used one that no request holds; wait for one to become idle when
        all are busy. MemoryBudgetError when `entry` cannot fit ``--max-model-memory`` even alone."""
        need = await self._need(entry) if self.max_memory is not None else 0
        if self.max_memory is not None and need > self.max_memory:
            raise MemoryBudgetError(self._too_large(entry, need, entry.memory_bytes is not None))
        while True:
            others = self._holding(entry)
            if self._fits(entry, others, need):
                entry.reserved = max(need, 1)
                return
            idle = [m for m in others if m.status == "loaded" and m.active == 0]
            if idle:
                victim = min(idle, key=lambda m: m.last_used)
                log.info("model %s: unloaded to make room for %s (%s)", victim.name, entry.name, self._limits())
                victim.unload()
                continue
            if is_stopping():
                raise RuntimeError("the server is shutting down")
            if self._changed is None:
                self._changed = asyncio.Event()
            self._changed.clear()
            await self._changed.wait()

    def after_load(self, entry: ModelState) -> str | None:
        """`entry` has loaded and its bytes are measured: when it holds more than estimated and the budget is
        exceeded, unload least recently used idle models until it fits; the reason it cannot stay when it does not
        fit even alone (None: it stays)."""
        if self.max_memory is None:
            return None
        if entry.reserved > self.max_memory:
            return self._too_large(entry, entry.reserved, True)
        while True:
            others = self._holding(entry)
            if sum(m.reserved for m in others) + entry.reserved <= self.max_memory:
                return None
            idle = [m for m in others if m.status == "loaded" and m.active == 0]
            if not idle:  # the busy ones hold the rest: over budget until they end (logged)
                log.warning("model %s holds more than estimated: the loaded models hold %s, over "
                            "--max-model-memory %s until a busy one is idle", entry.name,
                            mib(sum(m.reserved for m in others) + entry.reserved), mib(self.max_memory))
                return None
            victim = min(idle, key=lambda m: m.last_used)
            log.info("model %s: unloaded to make room for %s (%s)", victim.name, entry.name, self._limits())
            victim.unload()

    def _limits(self) -> str:
        limits = [f"--max-loaded-models {self.max_loaded}"] if self.max_loaded > 0 else []
        if self.max_memory is not None:
            limits.append(f"--max-model-memory {mib(self.max_memory)}")
        return ", ".join(limits)
