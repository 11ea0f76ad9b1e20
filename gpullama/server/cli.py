"""``gpullama-serve``: parse flags, configure logging, run uvicorn (the model loads once the socket is up)."""

from __future__ import annotations

import argparse
import logging
import os
import sys

import uvicorn

from gpullama.engine.args import EngineArgs, positive_int

from .app import create_app
from .engine_log import DEFAULT_INTERVAL_S
from .state import DEFAULT_MAX_BODY_BYTES, ServerConfig, ServerState


def port_number(text: str) -> int:
    """An argparse type: a TCP port, 0 (any free port) to 65535."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a port number, got {text!r}") from None
    if not 0 <= value <= 65535:
        raise argparse.ArgumentTypeError(f"must be in 0..65535, got {value}")
    return value


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """The command-line flags: the engine's (from `EngineArgs`) and the server's own."""
    p = argparse.ArgumentParser(prog="gpullama-serve", description="OpenAI-compatible HTTP server for a GGUF model.")
    EngineArgs.add_cli_args(p)
    p.add_argument("--host", default="127.0.0.1", help="address to bind (default: 127.0.0.1)")
    p.add_argument("--port", type=port_number, default=8080, help="port to bind (default: 8080)")
    p.add_argument("--served-model-name", default=None, help="name clients pass as `model` (default: the model's name)")
    p.add_argument("--api-key", default=os.environ.get("GPULLAMA_API_KEY"),
                   help="require `Authorization: Bearer KEY` on /v1 routes (default: $GPULLAMA_API_KEY, else none)")
    p.add_argument("--max-body-bytes", type=positive_int, default=DEFAULT_MAX_BODY_BYTES,
                   help=f"largest request body accepted, else 413 (default: {DEFAULT_MAX_BODY_BYTES})")
    p.add_argument("--log-level", default="info", choices=["debug", "info", "warning", "error"])
    p.add_argument("--log-stats-interval", type=float, default=DEFAULT_INTERVAL_S, metavar="SECONDS",
                   help="log the engine's status line this often while it has work; 0 turns it off "
                   f"(default: {DEFAULT_INTERVAL_S:g})")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    """Run the server until interrupted; exit status 1 when the model cannot be loaded."""
    args = parse_args(argv)
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        engine_args = EngineArgs.from_cli_args(args)
    except ValueError as exc:
        print(f"gpullama-serve: error: {exc}", file=sys.stderr)
        return 2
    config = ServerConfig(engine=engine_args, host=args.host, port=args.port,
                          served_model_name=args.served_model_name, api_key=args.api_key,
                          max_body_bytes=args.max_body_bytes, log_stats_interval=args.log_stats_interval)
    state = ServerState(config)
    app = create_app(config, state)
    server = uvicorn.Server(uvicorn.Config(app, host=args.host, port=args.port, log_config=None,
                                           log_level=args.log_level, access_log=False, lifespan="on",
                                           timeout_graceful_shutdown=5))
    failed: list[BaseException] = []

    def on_load_failed(exc: BaseException) -> None:
        failed.append(exc)
        server.should_exit = True

    state.on_load_failed = on_load_failed
    logging.getLogger("gpullama.server").info("gpullama-serve: model %s, device %s, address http://%s:%d%s",
                                              args.model, args.device, args.host, args.port,
                                              " (API key required)" if args.api_key else "")
    server.run()
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
