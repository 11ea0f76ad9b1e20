"""``gpullama-serve``: parse flags, configure logging, run uvicorn (the model loads once the socket is up)."""

from __future__ import annotations

import argparse
import logging
import os
import sys

import uvicorn

from .app import create_app
from .state import DEFAULT_MAX_BODY_BYTES, DEFAULT_MODEL, ServerConfig, ServerState


def _positive(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1, got {value}")
    return value


def _bytes(text: str) -> int:
    units = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}
    text = text.strip().upper().removesuffix("IB").removesuffix("B")
    try:
        value = int(float(text[:-1]) * units[text[-1]]) if text and text[-1] in units else int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected bytes such as 1073741824, 512M or 4G, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be positive, got {value}")
    return value


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """The command-line flags."""
    p = argparse.ArgumentParser(prog="gpullama-serve", description="OpenAI-compatible HTTP server for a GGUF model.")
    p.add_argument("--model", default=DEFAULT_MODEL, help=f"GGUF path or alias (default: {DEFAULT_MODEL})")
    p.add_argument("--host", default="127.0.0.1", help="address to bind (default: 127.0.0.1)")
    p.add_argument("--port", type=int, default=8080, help="port to bind (default: 8080)")
    p.add_argument("--device", default="auto", help="auto, cpu, cuda or cuda:N (default: auto)")
    p.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16", "float16"],
                   help="compute dtype (default: auto, the library's choice for the device)")
    p.add_argument("--max-model-len", type=_positive, default=None, help="context limit in tokens (default: the model's)")
    p.add_argument("--served-model-name", default=None, help="name clients pass as `model` (default: the model's name)")
    p.add_argument("--api-key", default=os.environ.get("GPULLAMA_API_KEY"),
                   help="require `Authorization: Bearer KEY` on /v1 routes (default: $GPULLAMA_API_KEY, else none)")
    p.add_argument("--max-body-bytes", type=_positive, default=DEFAULT_MAX_BODY_BYTES,
                   help=f"largest request body accepted, else 413 (default: {DEFAULT_MAX_BODY_BYTES})")
    p.add_argument("--kv-cache-memory", type=_bytes, default=None,
                   help="bytes for the paged KV cache, e.g. 512M or 4G (default: 1 GiB on CPU, 85%% of free GPU memory)")
    p.add_argument("--max-num-seqs", type=_positive, default=64, help="sequences per batch (default: 64)")
    p.add_argument("--max-num-batched-tokens", type=_positive, default=512,
                   help="tokens per engine step; longer prompts are prefilled in chunks (default: 512)")
    p.add_argument("--no-prefix-caching", action="store_true", help="do not reuse KV blocks of shared prefixes")
    p.add_argument("--enforce-eager", action="store_true", help="no CUDA graphs for decode steps")
    p.add_argument("--log-level", default="info", choices=["debug", "info", "warning", "error"])
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    """Run the server until interrupted; exit status 1 when the model cannot be loaded."""
    args = parse_args(argv)
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    config = ServerConfig(model=args.model, host=args.host, port=args.port, device=args.device, dtype=args.dtype,
                          max_model_len=args.max_model_len, served_model_name=args.served_model_name,
                          api_key=args.api_key, max_body_bytes=args.max_body_bytes,
                          engine_options=dict(kv_cache_memory=args.kv_cache_memory, max_num_seqs=args.max_num_seqs,
                                              max_num_batched_tokens=args.max_num_batched_tokens,
                                              enable_prefix_caching=not args.no_prefix_caching,
                                              enforce_eager=args.enforce_eager))
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
