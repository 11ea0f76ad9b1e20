"""``gpullama-serve``: parse flags, configure logging, run uvicorn (the model loads once the socket is up)."""

from __future__ import annotations

import argparse
import contextlib
import logging
import os
import signal
import socket
import sys
import threading
from collections.abc import Iterator

import uvicorn

from gpullama.engine.args import DEFAULT_MODEL, EngineArgs, byte_size, positive_int
from gpullama.engine.kv_events import KVEventsConfig
from gpullama.hub import check_model
from gpullama.pooling_params import POOLING_KINDS
from gpullama.vision.images import MAX_IMAGE_BYTES, MAX_IMAGE_PIXELS, MAX_IMAGES_PER_REQUEST, ImagePolicy

from .adapters import parse_lora, parse_lora_scaled
from .engine_log import DEFAULT_INTERVAL_S
from .http.connection import head_timeout_protocol
from .http.root_path import normalize_root_path
from .registry import DEFAULT_KEEP_ALIVE, display_name, models_in_dir, parse_keep_alive, parse_model_spec
from .state import (
    DEFAULT_BODY_TIMEOUT,
    DEFAULT_HEADER_TIMEOUT,
    DEFAULT_KEEP_ALIVE_TIMEOUT,
    DEFAULT_MAX_BODY_BYTES,
    DEFAULT_MAX_CONNECTIONS,
    DEFAULT_MAX_QUEUE,
    DEFAULT_REQUEST_TIMEOUT,
    LOOPBACK_HOSTS,
    REASONING_MODES,
    ChatDefaults,
    RequestDefaults,
    ServerConfig,
    ServerState,
)

log = logging.getLogger("gpullama.server")


def port_number(text: str) -> int:
    """An argparse type: a TCP port, 0 (any free port) to 65535."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a port number, got {text!r}") from None
    if not 0 <= value <= 65535:
        raise argparse.ArgumentTypeError(f"must be in 0..65535, got {value}")
    return value


def seconds(text: str) -> float:
    """An argparse type: a duration in seconds, > 0."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected seconds, got {text!r}") from None
    if not value > 0 or value == float("inf"):
        raise argparse.ArgumentTypeError(f"must be a number of seconds > 0, got {text}")
    return value


def seconds_or_off(text: str) -> float:
    """An argparse type: a duration in seconds, or 0 for no limit."""
    return 0.0 if text.strip() in ("0", "0.0") else seconds(text)


def keep_alive_arg(text: str) -> float:
    """An argparse type: a keep-alive duration (Ollama's: seconds or "5m"; negative: forever)."""
    try:
        return parse_keep_alive(float(text) if _is_number(text) else text, "--keep-alive")
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc).replace("'--keep-alive' ", "")) from None


def _is_number(text: str) -> bool:
    try:
        float(text)
    except ValueError:
        return False
    return True


def temperature(text: str) -> float:
    """An argparse type: a sampling temperature, a number >= 0."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number, got {text!r}") from None
    if not 0 <= value < float("inf"):
        raise argparse.ArgumentTypeError(f"must be a number >= 0, got {text}")
    return value


def n_predict(text: str) -> int:
    """An argparse type: a token count >= 1, or -1 (no limit)."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected an integer, got {text!r}") from None
    if value != -1 and value < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1, or -1 for no limit, got {value}")
    return value


def name_list(text: str) -> list[str]:
    """An argparse type: comma-separated names (hosts, origins)."""
    names = [part.strip() for part in text.split(",") if part.strip()]
    if not names:
        raise argparse.ArgumentTypeError("expected one or more comma-separated names")
    return names


def host_pattern_list(text: str) -> list[str]:
    """An argparse type: comma-separated Host names; ``*`` for any, ``*.example.com`` for subdomains."""
    names = name_list(text)
    for name in names:
        if "*" in name[1:] or (name.startswith("*") and name != "*" and not name.startswith("*.")):
            raise argparse.ArgumentTypeError(f"a wildcard must look like '*.example.com' or '*', got {name!r}")
    return [name.lower() for name in names]


def _kv_events_config(text: str) -> KVEventsConfig:
    """An argparse type: vLLM's ``--kv-events-config`` JSON."""
    try:
        return KVEventsConfig.from_json(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc).removeprefix("--kv-events-config: ")) from None


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """The command-line flags: the engine's (from `EngineArgs`) and the server's own."""
    p = argparse.ArgumentParser(prog="gpullama-serve", description="OpenAI-compatible HTTP server for a GGUF model.")
    EngineArgs.add_cli_args(p, skip=("model",))
    models = p.add_argument_group("models (docs/server.md, 'Several models')")
    models.add_argument("--model", "-m", dest="model", action="append", default=None, metavar="[NAME=]MODEL",
                        help=f"GGUF path or alias (default: {DEFAULT_MODEL}); give it again to serve several "
                        "models, each under NAME or its file's stem; the first is the default, loaded at start")
    models.add_argument("--models-dir", default=None, metavar="DIR",
                        help="also serve every *.gguf in DIR (mmproj*.gguf skipped), each under its file's stem, "
                        "loaded at its first request (llama.cpp's router flag)")
    models.add_argument("--keep-alive", type=keep_alive_arg, default=DEFAULT_KEEP_ALIVE, metavar="DURATION",
                        help="how long a model loaded on demand stays once idle: seconds or a duration such as "
                        "5m or 1h; 0 unloads it after each request, a negative value keeps it (Ollama's; a "
                        "request's keep_alive overrides it) (default: 5m)")
    models.add_argument("--max-loaded-models", type=int, default=0, metavar="N",
                        help="models loaded at once; loading one more unloads the least recently used idle one "
                        "(Ollama's OLLAMA_MAX_LOADED_MODELS, llama.cpp's --models-max) (default: 0, no limit)")
    models.add_argument("--max-model-memory", type=byte_size, default=None, metavar="BYTES",
                        help="bytes the loaded models may hold together (weights, KV pool, state), such as 4G; "
                        "loading one more first unloads the least recently used idle ones, and a model that cannot "
                        "fit alone fails its own requests (Ollama's memory-based scheduling) (default: no limit)")
    p.add_argument("--host", type=name_list, default=["127.0.0.1"],
                   help="address to bind, or several comma-separated (default: 127.0.0.1)")
    p.add_argument("--port", type=port_number, default=8080, help="port to bind (default: 8080)")
    p.add_argument("--served-model-name", default=None, help="name clients pass as `model` (default: the model's name)")
    p.add_argument("--api-key", default=os.environ.get("GPULLAMA_API_KEY"),
                   help="require `Authorization: Bearer KEY` on /v1 routes (default: $GPULLAMA_API_KEY, else none)")
    p.add_argument("--max-body-bytes", type=positive_int, default=DEFAULT_MAX_BODY_BYTES,
                   help=f"largest request body accepted, else 413 (default: {DEFAULT_MAX_BODY_BYTES})")
    limits = p.add_argument_group("limits (docs/server.md, 'Limits')")
    limits.add_argument("--max-queue", type=positive_int, default=DEFAULT_MAX_QUEUE,
                        help="requests waiting for a place in the batch; past it new ones get 429 with Retry-After "
                        f"(default: {DEFAULT_MAX_QUEUE})")
    limits.add_argument("--max-connections", type=positive_int, default=DEFAULT_MAX_CONNECTIONS,
                        help=f"open connections; past it new requests get 503 (default: {DEFAULT_MAX_CONNECTIONS})")
    limits.add_argument("--request-timeout", type=seconds_or_off, default=DEFAULT_REQUEST_TIMEOUT,
                        help="seconds from a request's arrival to its last token, else it is ended with 504 (or an "
                        f"error event); 0: no limit (default: {DEFAULT_REQUEST_TIMEOUT:g})")
    limits.add_argument("--header-timeout", type=seconds, default=DEFAULT_HEADER_TIMEOUT,
                        help="seconds for a connection to send a request's line and headers, else it is closed "
                        f"(default: {DEFAULT_HEADER_TIMEOUT:g})")
    limits.add_argument("--body-timeout", type=seconds, default=DEFAULT_BODY_TIMEOUT,
                        help=f"seconds to receive a request body, else 408 (default: {DEFAULT_BODY_TIMEOUT:g})")
    limits.add_argument("--keep-alive-timeout", type=seconds, default=DEFAULT_KEEP_ALIVE_TIMEOUT,
                        help="seconds an idle keep-alive connection stays open "
                        f"(default: {DEFAULT_KEEP_ALIVE_TIMEOUT:g})")
    security = p.add_argument_group("browser safety (docs/server.md, 'Local-server safety')")
    security.add_argument("--allowed-hosts", type=host_pattern_list, default=None,
                          help="comma-separated Host header values accepted, '*.example.com' for subdomains, '*' for "
                          f"any (default: {', '.join(LOOPBACK_HOSTS)} when bound to a loopback address, else any)")
    security.add_argument("--allowed-origins", type=name_list, default=[],
                          help="comma-separated browser origins allowed by CORS, such as http://localhost:3000, or "
                          "'*' (default: none, CORS off)")
    webui = p.add_argument_group("web UI (docs/webui.md)")
    webui.add_argument("--no-webui", dest="webui", action="store_false",
                       help="do not serve the chat page at / (a browser is then told where the API is)")
    webui.add_argument("--root-path", type=normalize_root_path, default="", metavar="PREFIX",
                       help="the path prefix a reverse proxy serves this server under, such as /llm: requests are "
                       "accepted with or without it, and the chat page links below it (default: none)")
    chat = p.add_argument_group("chat rendering (llama.cpp's flags; docs/server.md, 'Reasoning')")
    chat.add_argument("--reasoning", "-rea", choices=REASONING_MODES, default="auto",
                      help="the chat template's enable_thinking when a request does not set it: on, off, or auto "
                      "(true where the template reads it) (default: auto)")
    chat.add_argument("--prefill-assistant", action=argparse.BooleanOptionalAction, default=True,
                      help="continue a last assistant message instead of starting a new turn after it (default: "
                      "on; --no-prefill-assistant renders it as a whole turn)")
    p.add_argument("--pooling", choices=POOLING_KINDS, default=None,
                   help="how embeddings pool the hidden states: mean, cls, last token, or none (llama.cpp's native "
                   "/embeddings then gives one unnormalised vector per token; the OpenAI and Ollama embeddings "
                   "refuse it) (default: the model's pooling_type, else the last token)")
    images = p.add_argument_group("images (with --mmproj; docs/server.md, 'Images')")
    images.add_argument("--max-image-bytes", type=positive_int, default=MAX_IMAGE_BYTES,
                        help="largest encoded image a request may send, in bytes (default: %(default)s); the body "
                        "must also fit --max-body-bytes")
    images.add_argument("--max-image-pixels", type=positive_int, default=MAX_IMAGE_PIXELS,
                        help="largest image in pixels (width x height), checked before it is decoded: the "
                        "decompression-bomb guard (default: %(default)s)")
    images.add_argument("--max-images-per-request", type=positive_int, default=MAX_IMAGES_PER_REQUEST,
                        help="images one request may carry (default: %(default)s)")
    images.add_argument("--allowed-media-domains", nargs="+", default=[], metavar="DOMAIN",
                        help="fetch http(s) image URLs from these domains and their subdomains (vLLM's flag; "
                        "default: none, no request makes the server fetch anything)")
    images.add_argument("--allowed-local-media-path", "--media-path", default=None, metavar="DIR",
                        help="read file:// image URLs under this folder (vLLM's flag; llama.cpp's --media-path) "
                        "(default: none)")
    defaults = p.add_argument_group("request defaults (llama.cpp's flags): for requests that leave the field out")
    defaults.add_argument("--temp", "--temperature", dest="temp", type=temperature, default=None,
                          help="sampling temperature (default: each API's own, such as llama.cpp's 0.8 on "
                          "/completion and 1.0 on the OpenAI routes)")
    defaults.add_argument("--seed", "-s", type=int, default=-1,
                          help="sampling seed; a fixed seed gives the same text streamed and not (default: -1, "
                          "random)")
    defaults.add_argument("--n-predict", "--predict", "-n", dest="n_predict", type=n_predict, default=-1,
                          help="tokens to generate (default: -1, until the end of the context or each API's own)")
    defaults.add_argument("--verbose", "-v", action="store_true",
                          help="answers of chat and completions carry llama.cpp's __verbose (the native result, with "
                          "the prompt as text and special tokens) unless the request says \"verbose\": false")
    lora = p.add_argument_group("LoRA adapters (docs/server.md, 'LoRA adapters')")
    lora.add_argument("--lora", action="append", default=[], metavar="FILE|NAME=PATH[:SCALE]",
                      help="a GGUF LoRA adapter (llama.cpp's format); repeat for more. FILE (or FILE,FILE...): "
                      "llama.cpp's, applied to every request at scale 1 unless its `lora` field says otherwise; "
                      "NAME=PATH[:SCALE]: a named adapter, applied when a request's `model` is NAME (vLLM's "
                      "--lora-modules)")
    lora.add_argument("--lora-scaled", action="append", nargs="+", default=[], metavar="FILE SCALE",
                      help="llama.cpp's adapter with a scale: FILE SCALE, or FILE:SCALE[,FILE:SCALE...]")
    lora.add_argument("--lora-init-without-apply", action="store_true",
                      help="load the FILE adapters at scale 0 (llama.cpp's): apply them per request or with POST "
                      "/lora-adapters")
    lora.add_argument("--enable-lora-runtime-updating", action="store_true",
                      help="serve vLLM's POST /v1/load_lora_adapter and /v1/unload_lora_adapter (off by default: "
                      "anyone who can reach the server could load a file of this machine)")
    p.add_argument("--headless", action="store_true",
                   help="a node other than 0 of multi-node tensor parallelism (--nnodes, --node-rank 1 and up): load "
                   "this machine's ranks and follow node 0's steps, without an HTTP server; implied by --node-rank > "
                   "0 and by torchrun's RANK > 0 (docs/deploy.md)")
    p.add_argument("--kv-events-config", type=_kv_events_config, default=None, metavar="JSON",
                   help="publish KV-cache events in vLLM's format for prefix-aware routers, with vLLM's keys, e.g. "
                   '\'{"enable_kv_cache_events": true, "endpoint": "tcp://*:5557", "replay_endpoint": '
                   '"tcp://*:5558"}\' (needs gpullama[kv-events]; docs/deploy.md) (default: off)')
    p.add_argument("--log-level", default="info", choices=["debug", "info", "warning", "error"])
    p.add_argument("--log-stats-interval", type=float, default=DEFAULT_INTERVAL_S, metavar="SECONDS",
                   help="log the engine's status line this often while it has work; 0 turns it off "
                   f"(default: {DEFAULT_INTERVAL_S:g})")
    return p.parse_args(argv)


EXIT_STOPPED = 0  # stopped by SIGINT/SIGTERM once the open streams ended and the engine stopped
EXIT_BAD_INPUT = 2  # bad arguments, or a model that cannot be used (checked before binding) or loaded
EXIT_CANNOT_BIND = 3  # the address could not be bound (port in use, no permission): uvicorn's startup failure


def model_specs(args: argparse.Namespace) -> list[tuple[str, str]]:
    """(name, path or alias) of every model the flags name: each ``--model`` in order, then ``--models-dir``'s
    files; the first is the default. ValueError for a name given twice."""
    specs = [parse_model_spec(text) for text in args.model or []]
    if args.models_dir is not None:
        given = {path for _, path in specs}
        specs += [(name, path) for name, path in models_in_dir(args.models_dir) if path not in given]
    if not specs:
        specs = [(display_name(DEFAULT_MODEL), DEFAULT_MODEL)]
    seen: set[str] = set()
    for name, _ in specs:
        if name in seen:
            raise ValueError(f"two models are named {name!r}: name them apart with --model NAME=PATH")
        seen.add(name)
    return specs


def bind_sockets(hosts: list[str], port: int) -> list[socket.socket]:
    """One listening socket per address (IPv6 ones written bare or in brackets), for several ``--host``; OSError
    (with the others closed) when one cannot be bound."""
    sockets: list[socket.socket] = []
    try:
        for host in hosts:
            host = host.strip("[]")
            sock = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET, socket.SOCK_STREAM)
            sockets.append(sock)
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            sock.bind((host, port))
            sock.set_inheritable(True)
    except OSError:
        for sock in sockets:
            sock.close()
        raise
    return sockets


def fail(message: str, status: int = EXIT_BAD_INPUT) -> int:
    """Print one error line to stderr (the last line printed) and return the exit status."""
    print(f"gpullama-serve: error: {message}", file=sys.stderr, flush=True)
    return status


def main(argv: list[str] | None = None) -> int:
    """Run the server until SIGINT/SIGTERM; the exit statuses are the ``EXIT_*`` constants above (argparse's own
    usage errors also exit 2). The model reference is checked before the port is bound."""
    args = parse_args(argv)
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        specs = model_specs(args)
        args.model = specs[0][1]
        engine_args = EngineArgs.from_cli_args(args)
        check_model(engine_args.model)
    except ValueError as exc:
        return fail(str(exc))
    several = len(specs) > 1 or args.models_dir is not None
    if several and args.served_model_name:
        return fail("--served-model-name names the one model of a server; with several, name each as "
                    "--model NAME=PATH")
    if args.max_loaded_models < 0:
        return fail(f"--max-loaded-models must be >= 0, got {args.max_loaded_models}")
    bad_files = {}
    for name, path in specs[1:]:  # another model's bad file fails only that model's requests
        try:
            check_model(path)
        except ValueError as exc:
            log.warning("model %s (%s) cannot be loaded: %s", name, path, exc)
            bad_files[name] = f"{type(exc).__name__}: {exc}"
    if args.headless or engine_args.node_rank > 0 or _torchrun_rank() > 0:
        return _run_headless(engine_args)
    try:
        lora_specs = [spec for value in args.lora for spec in parse_lora(value)]
        lora_specs += [spec for values in args.lora_scaled for spec in parse_lora_scaled(values)]
    except ValueError as exc:
        return fail(str(exc))
    missing = next((spec.path for spec in lora_specs if not os.path.isfile(spec.path)), None)
    if missing is not None:
        return fail(f"LoRA adapter {missing!r} does not exist")
    hosts, args.host = args.host, ",".join(args.host)
    config = ServerConfig(engine=engine_args, host=args.host, port=args.port,
                          served_model_name=args.served_model_name, api_key=args.api_key,
                          max_body_bytes=args.max_body_bytes, max_queue=args.max_queue,
                          max_connections=args.max_connections, request_timeout=args.request_timeout or None,
                          header_timeout=args.header_timeout, body_timeout=args.body_timeout,
                          keep_alive_timeout=args.keep_alive_timeout, allowed_hosts=args.allowed_hosts,
                          allowed_origins=args.allowed_origins, log_stats_interval=args.log_stats_interval,
                          kv_events=args.kv_events_config, webui=args.webui, root_path=args.root_path,
                          chat=ChatDefaults(args.reasoning, args.prefill_assistant),
                          defaults=RequestDefaults(args.temp, None if args.seed == -1 else args.seed,
                                                   None if args.n_predict == -1 else args.n_predict, args.verbose),
                          pooling=args.pooling, lora=lora_specs,
                          lora_init_without_apply=args.lora_init_without_apply,
                          lora_runtime_updating=args.enable_lora_runtime_updating,
                          images=ImagePolicy(args.max_image_bytes, args.max_image_pixels, args.max_images_per_request,
                                             tuple(args.allowed_media_domains), args.allowed_local_media_path),
                          models=specs if several else [],
                          models_dir=args.models_dir, keep_alive=args.keep_alive,
                          max_loaded_models=args.max_loaded_models, max_model_memory=args.max_model_memory)
    if not several and specs[0][0] != display_name(specs[0][1]) and not args.served_model_name:
        config.served_model_name = specs[0][0]  # --model NAME=PATH
    state = ServerState(config)
    for name, error in bad_files.items():
        state.models[name].status, state.models[name].error = "failed", error
    from .app import create_app  # the routes load once the flags and the model reference are known good

    app = create_app(config, state)
    server = _Server(uvicorn.Config(app, host=args.host, port=args.port, log_config=None,
                                    log_level=args.log_level, access_log=False, lifespan="on",
                                    http=head_timeout_protocol(config.header_timeout),
                                    limit_concurrency=config.max_connections,
                                    timeout_keep_alive=config.keep_alive_timeout,
                                    timeout_graceful_shutdown=5), state)
    failed: list[BaseException] = []

    def on_load_failed(exc: BaseException) -> None:
        failed.append(exc)
        server.should_exit = True

    state.on_load_failed = on_load_failed
    logging.getLogger("gpullama.server").info("gpullama-serve: model %s, device %s, address http://%s:%d%s",
                                              args.model, args.device, args.host, args.port,
                                              " (API key required)" if args.api_key else "")
    if config.webui:
        shown = "127.0.0.1" if hosts[0].strip("[]") in ("0.0.0.0", "::") else hosts[0].strip("[]")
        log.info("chat page: open http://%s:%d%s/ in a browser", f"[{shown}]" if ":" in shown else shown, args.port,
                 config.root_path)
    if config.host_patterns() == ["*"]:
        log.info("accepting any Host header (bound to %s): pass --allowed-hosts to restrict it", args.host)
    startup_error = _LastError()
    logging.getLogger("uvicorn.error").addHandler(startup_error)
    try:
        sockets = [] if len(hosts) == 1 else bind_sockets(hosts, args.port)
    except OSError as exc:
        return fail(f"cannot listen on {args.host} port {args.port}: {exc}", EXIT_CANNOT_BIND)
    try:
        server.run(sockets=sockets or None)
    except SystemExit as exc:  # uvicorn exits 3 when it cannot bind, after logging why
        if exc.code != EXIT_CANNOT_BIND:
            raise
        return fail(f"cannot listen on {args.host}:{args.port}: {startup_error.message or 'see the log above'}",
                    EXIT_CANNOT_BIND)
    finally:
        logging.getLogger("uvicorn.error").removeHandler(startup_error)
    if failed:
        return fail(f"cannot load model {args.model}: {state.error}")
    if server.signalled:
        log.info("gpullama-serve stopped (%s)", signal.Signals(server.signalled[0]).name)
    return EXIT_STOPPED


def _torchrun_rank() -> int:
    """This process's rank when torchrun started it (its RANK and MASTER_ADDR are set), else 0."""
    env = os.environ
    return int(env.get("RANK", "0")) if "MASTER_ADDR" in env and env.get("RANK", "").isdigit() else 0


def _run_headless(engine_args: EngineArgs) -> int:
    """A node other than 0: follow node 0 until it stops the group (status 0) or fails (1, with the reason)."""
    from gpullama.engine.tp_workers import run_headless

    log.info("gpullama-serve --headless: model %s, node %d of %d, node 0 at %s:%d", engine_args.model,
             engine_args.node_rank, engine_args.nnodes, engine_args.master_addr, engine_args.master_port)
    try:
        run_headless(engine_args)
    except ValueError as exc:
        return fail(str(exc))
    except RuntimeError as exc:
        return fail(str(exc), 1)
    return EXIT_STOPPED


class _LastError(logging.Handler):
    """Keeps the last error uvicorn logs (why it could not bind), to repeat it as the last line printed."""

    def __init__(self) -> None:
        super().__init__(logging.ERROR)
        self.message: str | None = None

    def emit(self, record: logging.LogRecord) -> None:
        self.message = record.getMessage()


class _Server(uvicorn.Server):
    """uvicorn's server, ending the open streams at the first SIGINT/SIGTERM (a second SIGINT forces the exit)
    and exiting with status 0 after such a clean stop instead of re-raising the signal."""

    def __init__(self, config: uvicorn.Config, state: ServerState) -> None:
        super().__init__(config)
        self.state = state
        self.signalled: list[int] = []

    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:
        if threading.current_thread() is not threading.main_thread():
            yield
            return
        handled = (signal.SIGINT, signal.SIGTERM)
        previous = {sig: signal.signal(sig, self.handle_exit) for sig in handled}
        try:
            yield
        finally:
            for sig, handler in previous.items():
                signal.signal(sig, handler)

    def handle_exit(self, sig: int, frame) -> None:
        self.signalled.append(sig)
        if self.should_exit:
            self.force_exit = sig == signal.SIGINT or self.force_exit
            return
        self.should_exit = True
        loop = self.state.loop
        if loop is not None and not loop.is_closed():
            loop.call_soon_threadsafe(self.state.begin_shutdown)  # streams end within one engine step


if __name__ == "__main__":
    sys.exit(main())
