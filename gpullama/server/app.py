"""The Starlette application: OpenAI routes, health, metrics and OpenAI-shaped error handlers."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass

from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.middleware import Middleware
from starlette.middleware.cors import CORSMiddleware
from starlette.middleware.trustedhost import TrustedHostMiddleware
from starlette.requests import ClientDisconnect, Request
from starlette.responses import Response
from starlette.routing import Route

from .chat_output import ChatOutputShaper
from .common import JSONResponse, read_request_body, request_id, start_generation
from .common import check_model as _check_model
from .common import off_loop_if_large as _off_loop_if_large
from .common import parse_json as _parse_json
from .common import require_ready as _require_ready
from .common import server_state as _state
from .errors import APIError, error_body, internal_error
from .generation import Generation, Job
from .metrics import CONTENT_TYPE as METRICS_CONTENT_TYPE
from .middleware import AccessLogMiddleware, APIKeyMiddleware, RequestIdMiddleware
from .protocol import ChatRequest, CompletionRequest, parse_chat, parse_completion, sampling_params
from .responses import ChunkBuilder, chat_completion, new_id, now, text_completion
from .responses_api import create_response
from .sse import DONE, ClientDisconnected, SSEResponse, event, unless_disconnected
from .state import ServerConfig, ServerState
from .structured_request import ChatPlan, chat_format, plan_chat, render_planned_chat, response_format_spec
from .tokenization import detokenize, tokenize, version

log = logging.getLogger("gpullama.server")


def _prepare_chat(state: ServerState, raw: bytes) -> tuple[ChatRequest, ChatPlan, str, list[int]]:
    """Parse and validate a chat body (with its response_format, tools, tool_choice and template kwargs), render
    the chat template and tokenize (a worker thread may run it)."""
    body = _parse_json(raw)
    req = parse_chat(body)
    _check_model(state, req.model)
    tok = state.llm.tokenizer
    plan = plan_chat(body, req.messages, chat_format(tok))
    text, ids = render_planned_chat(tok, plan, req.options.kwargs, "messages", "these messages")
    return req, plan, text, ids


def _prepare_completion(state: ServerState, raw: bytes) -> tuple[CompletionRequest, list[list[int]]]:
    """Parse and validate a completions body and tokenize its prompts (a worker thread may run it)."""
    body = _parse_json(raw)
    req = parse_completion(body)
    _check_model(state, req.model)
    spec = response_format_spec(body)
    if spec is not None:
        req.options.kwargs["structured_output"] = spec
    tok = state.llm.tokenizer
    return req, [tok.encode(p, add_special_tokens=True) if isinstance(p, str) else list(p) for p in req.prompts]


async def chat_completions(request: Request) -> Response:
    """``POST /v1/chat/completions``."""
    arrival = time.perf_counter()
    state = _state(request)
    _require_ready(state)
    raw = await read_request_body(request)
    req, plan, text, ids = await _off_loop_if_large(len(raw), _prepare_chat, state, raw)
    jobs = [Job(i, ids, sampling_params(req.options, seed_offset=i), prompt_param="messages",
                max_tokens_param=req.options.max_tokens_param) for i in range(req.n)]
    shaper = ChatOutputShaper(plan, text)
    answer = Answer(chat=True, id=new_id("chatcmpl"), jobs=jobs, prompt_texts=[""], echo=False,
                    include_usage=req.include_usage, arrival=arrival, shaper=shaper if shaper.active else None)
    return await _serve(request, state, answer, req.stream)


async def completions(request: Request) -> Response:
    """``POST /v1/completions``."""
    arrival = time.perf_counter()
    state = _state(request)
    _require_ready(state)
    raw = await read_request_body(request)
    req, prompt_ids = await _off_loop_if_large(len(raw), _prepare_completion, state, raw)
    jobs: list[Job] = []
    texts: list[str | None] = []
    for p, (prompt, ids) in enumerate(zip(req.prompts, prompt_ids)):
        if isinstance(prompt, str):
            texts.append(prompt)
        else:
            texts.append(None if req.echo else "")  # echoed text is decoded once the engine accepted the ids
        for i in range(req.n):
            jobs.append(Job(p * req.n + i, ids, sampling_params(req.options, seed_offset=i), prompt_index=p,
                            max_tokens_param=req.options.max_tokens_param))
    answer = Answer(chat=False, id=new_id("cmpl"), jobs=jobs, prompt_texts=texts, echo=req.echo,
                    include_usage=req.include_usage, arrival=arrival)
    return await _serve(request, state, answer, req.stream)


@dataclass
class Answer:
    """What one API request answers with: its kind and id, the engine jobs of its choices, the prompt texts to echo."""

    chat: bool
    id: str
    jobs: list[Job]
    prompt_texts: list[str | None]  # per prompt (None: token ids, decoded once accepted)
    echo: bool
    include_usage: bool
    arrival: float
    shaper: ChatOutputShaper | None = None  # chat: reasoning and tool calls read out of the text


async def _serve(request: Request, state: ServerState, answer: Answer, stream: bool) -> Response:
    """Submit the answer's jobs (the engine's admission check turns a bad one into a 400), then answer with one
    JSON object or an SSE stream."""
    for job in answer.jobs:
        job.request_id = f"{answer.id}-{job.index}"
    gen = await start_generation(request, state, answer.jobs, answer.arrival)
    if gen is None:
        return Response(status_code=499)
    for job in answer.jobs:
        if answer.prompt_texts[job.prompt_index] is None:
            answer.prompt_texts[job.prompt_index] = state.llm.tokenizer.decode(job.prompt_ids)
    if stream:
        return _stream_response(answer, gen, state.model_name)
    return await _full_response(request, answer, gen, state.model_name)


async def _full_response(request: Request, answer: Answer, gen: Generation, model: str) -> Response:
    """Collect every choice and answer with one ``chat.completion`` or ``text_completion`` object."""
    jobs = answer.jobs

    async def collect() -> dict:
        texts = {job.index: answer.prompt_texts[job.prompt_index] if answer.echo else "" for job in jobs}
        logprobs = {job.index: ([] if job.params.logprobs is not None else None) for job in jobs}
        finish: dict[int, str | None] = {}
        try:
            async for index, delta in gen.deltas():
                texts[index] += delta.text
                if delta.logprobs and logprobs[index] is not None:
                    logprobs[index].extend(delta.logprobs)
                if delta.finish_reason is not None:
                    finish[index] = delta.finish_reason
        finally:
            await gen.close()
        choices = [{"index": job.index, "text": texts[job.index], "logprobs": logprobs[job.index],
                    "finish_reason": finish.get(job.index), "offset": 0} for job in jobs]
        if answer.shaper is not None:
            for c in choices:
                c["message"] = answer.shaper.message(c["index"], c["text"])
                c["finish_reason"] = answer.shaper.finish_reason(c["index"], c["finish_reason"])
        build = chat_completion if answer.chat else text_completion
        return build(answer.id, now(), model, choices, gen.usage())

    try:
        return JSONResponse(await unless_disconnected(request.receive, collect))
    except ClientDisconnected:
        log.info("client disconnected before %s finished; generation aborted", answer.id)
        return Response(status_code=499)


def _stream_response(answer: Answer, gen: Generation, model: str) -> SSEResponse:
    """Stream every choice's deltas as SSE chunks, then the usage chunk when asked, then ``[DONE]``."""
    chunks = ChunkBuilder(answer.chat, answer.id, now(), model, answer.include_usage)

    async def events() -> AsyncIterator[bytes]:
        # every stream ends with [DONE]: after the finish reasons (and usage), or after one error event
        offsets = {job.index: 0 for job in answer.jobs}
        try:
            for job in answer.jobs:
                text = answer.prompt_texts[job.prompt_index]
                if answer.chat:
                    yield event(chunks.role(job.index))
                elif answer.echo and text:
                    yield event(chunks.content(job.index, text, None))
            shaper = answer.shaper
            async for index, delta in gen.deltas():
                if shaper is not None:  # reasoning, content and tool-call pieces
                    fields = shaper.delta(index, delta.text) if delta.text else None
                    if fields or delta.logprobs:
                        yield event(chunks.fields(index, fields or {}, delta.logprobs))
                    if delta.finish_reason is not None:
                        rest = shaper.finish(index)
                        if rest:
                            yield event(chunks.fields(index, rest, None))
                        yield event(chunks.finish(index, shaper.finish_reason(index, delta.finish_reason)))
                    continue
                if delta.text or delta.logprobs:
                    yield event(chunks.content(index, delta.text, delta.logprobs, offsets[index]))
                    offsets[index] += len(delta.text)
                if delta.finish_reason is not None:
                    yield event(chunks.finish(index, delta.finish_reason))
            if answer.include_usage:
                yield event(chunks.usage(gen.usage()))
        except APIError as exc:
            yield event(exc.body())
        except Exception as exc:  # noqa: BLE001 - a bug of ours: the client gets an error event, the log the detail
            log.error("streaming %s failed (request id %s)", answer.id, gen.http_request_id, exc_info=exc)
            yield event(internal_error(gen.http_request_id).body())
        finally:
            await gen.close()
        yield DONE

    return SSEResponse(events())


async def list_models(request: Request) -> Response:
    """``GET /v1/models``: the one served model in OpenAI's list shape."""
    state = _state(request)
    _require_ready(state)
    return JSONResponse({"object": "list", "data": [_model_card(state)]})


async def get_model(request: Request) -> Response:
    """``GET /v1/models/{model}``: the served model's card, 404 for any other name."""
    state = _state(request)
    _require_ready(state)
    _check_model(state, request.path_params["model"])
    return JSONResponse(_model_card(state))


def _model_card(state: ServerState) -> dict:
    return {"id": state.model_name, "object": "model", "created": state.created, "owned_by": "gpullama",
            "max_model_len": state.llm.max_model_len}


async def health(request: Request) -> Response:
    """``GET /health``: 200 ``{"status": "ok"}`` when ready, 503 while loading or when the engine is gone."""
    state = _state(request)
    if state.status in ("loading", "stopping"):
        return JSONResponse({"status": state.status}, status_code=503)
    if state.status != "ready" or state.engine is None:
        return JSONResponse({"status": "error", "message": f"{state.status}: {state.error}"}, status_code=503)
    if not getattr(state.engine, "is_alive", True):
        return JSONResponse({"status": "error", "message": "the generation engine has stopped"}, status_code=503)
    return JSONResponse({"status": "ok"})


async def metrics(request: Request) -> Response:
    """``GET /metrics``: Prometheus text exposition."""
    state = _state(request)
    return Response(state.metrics.render(state.engine), media_type=METRICS_CONTENT_TYPE)


async def _api_error(request: Request, exc: Exception) -> Response:
    assert isinstance(exc, APIError)
    return JSONResponse(exc.body(), status_code=exc.status, headers=exc.headers)


async def _http_error(request: Request, exc: Exception) -> Response:
    assert isinstance(exc, HTTPException)
    if exc.status_code == 404:
        message, code = f"no route for {request.method} {request.url.path}", "not_found"
    elif exc.status_code == 405:
        message, code = f"method {request.method} is not allowed on {request.url.path}", "method_not_allowed"
    else:
        message, code = str(exc.detail), None
    return JSONResponse(error_body(exc.status_code, message, code=code), status_code=exc.status_code,
                        headers=exc.headers)


async def _client_gone(request: Request, exc: Exception) -> Response:
    """The client hung up while sending its body: one quiet line, status 499 (nginx's "client closed request")."""
    log.info("client disconnected during the upload of %s %s (request id %s)", request.method, request.url.path,
             request_id(request))
    return Response(status_code=499)


def _middleware(config: ServerConfig, state: ServerState) -> list[Middleware]:
    """Outermost first: access log, request id and 500s, Host allow-list, CORS (when configured), API key."""
    stack = [Middleware(AccessLogMiddleware, metrics=state.metrics), Middleware(RequestIdMiddleware),
             Middleware(TrustedHostMiddleware, allowed_hosts=config.host_patterns(), www_redirect=False)]
    if config.allowed_origins:  # before the key check: a browser's preflight carries no Authorization
        stack.append(Middleware(CORSMiddleware, allow_origins=config.allowed_origins, allow_methods=["GET", "POST"],
                                allow_headers=["*"], expose_headers=["x-request-id"]))
    stack.append(Middleware(APIKeyMiddleware, api_key=config.api_key))
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
        routes=[
            Route("/v1/chat/completions", chat_completions, methods=["POST"]),
            Route("/v1/completions", completions, methods=["POST"]),
            Route("/v1/responses", create_response, methods=["POST"]),
            Route("/v1/models", list_models, methods=["GET"]),
            Route("/v1/models/{model:path}", get_model, methods=["GET"]),
            Route("/health", health, methods=["GET"]),
            Route("/metrics", metrics, methods=["GET"]),
            Route("/tokenize", tokenize, methods=["POST"]),
            Route("/detokenize", detokenize, methods=["POST"]),
            Route("/version", version, methods=["GET"]),
        ],
        middleware=_middleware(config, state),
        # unexpected exceptions are answered by RequestIdMiddleware (a 500 with only the request id)
        exception_handlers={APIError: _api_error, HTTPException: _http_error, ClientDisconnect: _client_gone},
        lifespan=lifespan,
    )
    app.state.server = state
    return app
