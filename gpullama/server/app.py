"""The Starlette application: every API family's routes, the middleware stack, and the error boundary (each error
renamed to its API's field names and written in its family's shape)."""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator

from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.middleware import Middleware
from starlette.middleware.cors import CORSMiddleware
from starlette.middleware.trustedhost import TrustedHostMiddleware
from starlette.requests import ClientDisconnect, Request
from starlette.responses import Response
from starlette.routing import Route

from gpullama.checks import RequestError

from .anthropic.messages import count_tokens, create_message
from .http.body import JSONResponse
from .http.errors import CHAT_NAMES, APIError, request_error, style_for_path
from .http.middleware import AccessLogMiddleware, APIKeyMiddleware, RequestIdMiddleware, request_id
from .http.root_path import RootPathMiddleware
from .llamacpp import completion as llamacpp_completion
from .llamacpp import embeddings as llamacpp_embeddings
from .llamacpp import lora as llamacpp_lora
from .llamacpp import props as llamacpp_props
from .llamacpp.rerank import rerank
from .ollama import chat as ollama_chat
from .ollama import embed as ollama_embed
from .ollama import models as ollama_models
from .openai.chat import chat_completions, input_tokens
from .openai.completions import completions
from .openai.embeddings import create_embeddings
from .openai.models import get_model, list_models, load_model, unload_model
from .openai.responses.serving import create_response
from .registry import LeaseMiddleware
from .state import ServerConfig, ServerState
from .vllm import lora as vllm_lora
from .vllm.health import health, metrics
from .vllm.score import score
from .vllm.tokenization import detokenize, tokenize, version
from .webui import serving as webui

log = logging.getLogger("gpullama.server")


def routes() -> list[Route]:
    """Every route, by API family."""
    return [
        # OpenAI
        Route("/v1/chat/completions", chat_completions, methods=["POST"]),
        Route("/v1/chat/completions/input_tokens", input_tokens, methods=["POST"]),
        Route("/v1/completions", completions, methods=["POST"]),
        Route("/v1/responses", create_response, methods=["POST"]),
        Route("/v1/embeddings", create_embeddings, methods=["POST"]),
        Route("/v1/models", list_models, methods=["GET"]),
        Route("/v1/models/{model:path}", get_model, methods=["GET"]),
        # the same without /v1, as llama.cpp serves them (OpenAI clients configured without /v1); llama.cpp's
        # /completions is its native /completion
        Route("/chat/completions", chat_completions, methods=["POST"]),
        Route("/chat/completions/input_tokens", input_tokens, methods=["POST"]),
        Route("/models", list_models, methods=["GET"]),
        # Anthropic
        Route("/v1/messages", create_message, methods=["POST"]),
        Route("/v1/messages/count_tokens", count_tokens, methods=["POST"]),
        # Ollama
        Route("/api/chat", ollama_chat.chat, methods=["POST"]),
        Route("/api/generate", ollama_chat.generate, methods=["POST"]),
        Route("/api/embed", ollama_embed.embed, methods=["POST"]),
        Route("/api/embeddings", ollama_embed.embeddings, methods=["POST"]),
        Route("/api/tags", ollama_models.tags, methods=["GET"]),
        Route("/api/show", ollama_models.show, methods=["POST"]),
        Route("/api/ps", ollama_models.ps, methods=["GET"]),
        Route("/api/version", ollama_models.version, methods=["GET"]),
        # the chat page for a browser, Ollama's probe answer for every other client
        Route("/", webui.root(ollama_models.root), methods=["GET", "HEAD"]),
        Route("/assets/{name:path}", webui.asset, methods=["GET", "HEAD"]),
        # llama.cpp's native endpoints
        Route("/completion", llamacpp_completion.completion, methods=["POST"]),
        Route("/completions", llamacpp_completion.completion, methods=["POST"]),
        Route("/embeddings", llamacpp_embeddings.embeddings, methods=["POST"]),
        Route("/embedding", llamacpp_embeddings.embeddings, methods=["POST"]),
        *(Route(path, rerank, methods=["POST"]) for path in ("/rerank", "/reranking", "/v1/rerank", "/v1/reranking")),
        Route("/v1/score", score, methods=["POST"]),
        Route("/score", score, methods=["POST"]),
        Route("/infill", llamacpp_completion.infill, methods=["POST"]),
        Route("/apply-template", llamacpp_props.apply_template, methods=["POST"]),
        Route("/props", llamacpp_props.props, methods=["GET"]),
        Route("/lora-adapters", llamacpp_lora.get_adapters, methods=["GET"]),
        Route("/lora-adapters", llamacpp_lora.set_adapters, methods=["POST"]),
        Route("/v1/load_lora_adapter", vllm_lora.load_adapter, methods=["POST"]),
        Route("/v1/unload_lora_adapter", vllm_lora.unload_adapter, methods=["POST"]),
        Route("/models/load", load_model, methods=["POST"]),  # its router mode's
        Route("/models/unload", unload_model, methods=["POST"]),
        # vLLM's tokenizer endpoints
        Route("/tokenize", tokenize, methods=["POST"]),
        Route("/detokenize", detokenize, methods=["POST"]),
        Route("/version", version, methods=["GET"]),
        # operations
        Route("/health", health, methods=["GET"]),
        Route("/metrics", metrics, methods=["GET"]),
    ]


def error_response(request: Request, error: APIError) -> Response:
    """The error boundary: `error` in the request's API field names (set by its route) and its family's shape."""
    error = getattr(request.state, "field_names", CHAT_NAMES).apply(error)
    return JSONResponse(style_for_path(request.url.path).body(error), status_code=error.status,
                        headers=error.headers)


async def _api_error(request: Request, exc: Exception) -> Response:
    assert isinstance(exc, APIError)
    return error_response(request, exc)


async def _request_error(request: Request, exc: Exception) -> Response:
    """A RequestError raised by any layer below while the request was read (a message list, a count, a choice):
    the 400 naming its field."""
    assert isinstance(exc, RequestError)
    return error_response(request, request_error(exc))


async def _http_error(request: Request, exc: Exception) -> Response:
    assert isinstance(exc, HTTPException)
    if exc.status_code == 404:
        message, code = f"no route for {request.method} {request.url.path}", "not_found"
    elif exc.status_code == 405:
        message, code = f"method {request.method} is not allowed on {request.url.path}", "method_not_allowed"
    else:
        message, code = str(exc.detail), None
    return error_response(request, APIError(exc.status_code, message, code=code, headers=exc.headers))


async def _client_gone(request: Request, exc: Exception) -> Response:
    """The client hung up while sending its body: one quiet line, status 499 (nginx's "client closed request")."""
    log.info("client disconnected during the upload of %s %s (request id %s)", request.method, request.url.path,
             request_id(request))
    return Response(status_code=499)


LOCAL_ORIGINS = r"https?://(localhost|127\.0\.0\.1|\[::1\])(:[0-9]{1,5})?"
"""What the ``localhost`` keyword of ``--allowed-origins`` allows: any port of this machine's names."""


def _middleware(config: ServerConfig, state: ServerState) -> list[Middleware]:
    """Outermost first: the path prefix (``--root-path``), access log, request id and 500s, Host allow-list, CORS,
    API key, model leases.

    CORS comes before the key check (a browser's preflight carries no Authorization); it allows only the
    configured origins (none by default), so a preflight from any other gets Starlette's 400 "Disallowed CORS
    origin" and no answer carries an allow-origin header for it."""
    stack = [Middleware(RootPathMiddleware, root_path=config.root_path),
             Middleware(AccessLogMiddleware, metrics=state.metrics), Middleware(RequestIdMiddleware),
             Middleware(TrustedHostMiddleware, allowed_hosts=config.host_patterns(), www_redirect=False)]
    origins = [o for o in config.allowed_origins if o != "localhost"]
    local = LOCAL_ORIGINS if "localhost" in config.allowed_origins else None
    stack.append(Middleware(CORSMiddleware, allow_origins=origins, allow_origin_regex=local,
                            allow_methods=["GET", "POST"], allow_headers=["*"], expose_headers=["x-request-id"]))
    stack.append(Middleware(APIKeyMiddleware, api_key=config.api_key))
    stack.append(Middleware(LeaseMiddleware))  # gives back the models a request held
    return stack


def create_app(config: ServerConfig, state: ServerState | None = None) -> Starlette:
    """Build the app; the model loads in the background once the server starts (``/health`` says when)."""
    state = state or ServerState(config)

    @contextlib.asynccontextmanager
    async def lifespan(app: Starlette) -> AsyncIterator[None]:
        state.loop = asyncio.get_running_loop()
        app.state.loader_task = asyncio.create_task(state.load())
        try:
            yield
        finally:
            state.shutdown()

    app = Starlette(
        routes=routes(),
        middleware=_middleware(config, state),
        # unexpected exceptions are answered by RequestIdMiddleware (a 500 with only the request id)
        exception_handlers={APIError: _api_error, RequestError: _request_error, HTTPException: _http_error,
                            ClientDisconnect: _client_gone},
        lifespan=lifespan,
    )
    app.state.server = state
    return app
