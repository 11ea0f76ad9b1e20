"""The Starlette application: OpenAI routes, health, metrics and OpenAI-shaped error handlers."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

import orjson
from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.middleware import Middleware
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

from .chat_output import ChatOutputShaper
from .errors import APIError, error_body
from .generation import Generation, Job
from .metrics import CONTENT_TYPE as METRICS_CONTENT_TYPE
from .middleware import AccessLogMiddleware, APIKeyMiddleware
from .protocol import ChatRequest, CompletionRequest, parse_chat, parse_completion, sampling_params
from .responses import ChunkBuilder, chat_completion, new_id, now, text_completion
from .sse import DONE, ClientDisconnected, SSEResponse, event, unless_disconnected
from .state import ServerConfig, ServerState
from .structured_request import chat_format, plan_chat, response_format_spec

log = logging.getLogger("gpullama.server")
_THREAD_TOKENIZE_CHARS = 8192  # longer inputs are tokenized off the event loop


class JSONResponse(Response):
    """A JSON response serialised with orjson."""

    media_type = "application/json"

    def render(self, content: Any) -> bytes:
        return orjson.dumps(content)


def _state(request: Request) -> ServerState:
    return request.app.state.server


async def _read_json(request: Request, limit: int) -> Any:
    """The request body parsed as JSON; 413 past ``limit`` bytes, 400 when malformed."""
    declared = request.headers.get("content-length")
    if declared is not None and declared.isdigit() and int(declared) > limit:
        raise APIError(413, f"request body is {declared} bytes, over the limit of {limit} bytes",
                       code="request_too_large")
    chunks, size = [], 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > limit:
            raise APIError(413, f"request body is over the limit of {limit} bytes", code="request_too_large")
        chunks.append(chunk)
    raw = b"".join(chunks)
    if not raw.strip():
        raise APIError(400, "the request body is empty: send a JSON object", code="invalid_json")
    try:
        return orjson.loads(raw)
    except orjson.JSONDecodeError as exc:
        raise APIError(400, f"malformed JSON in the request body: {exc}", code="invalid_json") from exc


def _require_ready(state: ServerState) -> None:
    if state.status == "loading":
        raise APIError(503, "the model is still loading; retry when GET /health answers 200", code="model_loading")
    if state.status != "ready" or state.engine is None:
        raise APIError(503, f"the model is not available ({state.status}: {state.error})", code="model_unavailable")
    if not getattr(state.engine, "is_alive", True):
        raise APIError(503, "the generation engine has stopped; restart the server", code="engine_dead")


def _check_model(state: ServerState, model: str | None) -> None:
    if model is not None and model != state.model_name:
        raise APIError(404, f"The model `{model}` does not exist; this server serves `{state.model_name}`.",
                       param="model", code="model_not_found")


async def _off_loop_if_long(size: int, fn, *args, **kwargs):
    if size > _THREAD_TOKENIZE_CHARS:
        return await asyncio.to_thread(fn, *args, **kwargs)
    return fn(*args, **kwargs)


async def chat_completions(request: Request) -> Response:
    """``POST /v1/chat/completions``."""
    arrival = time.perf_counter()
    state = _state(request)
    _require_ready(state)
    body = await _read_json(request, state.config.max_body_bytes)
    req: ChatRequest = parse_chat(body)
    _check_model(state, req.model)
    tok = state.llm.tokenizer
    plan = plan_chat(body, req.messages, chat_format(tok))  # response_format, tools, tool_choice, template kwargs
    if plan.spec is not None:
        req.options.kwargs["structured_output"] = plan.spec
    size = sum(len(m["content"]) for m in req.messages)
    try:
        text = await _off_loop_if_long(size, tok.apply_chat_template, plan.messages, add_generation_prompt=True,
                                       tools=plan.tools, **plan.template_kwargs)
    except Exception as exc:  # jinja2 errors (raise_exception in templates) and ValueError
        raise APIError(400, f"the chat template rejected these messages: {exc}", param="messages") from exc
    ids = await _off_loop_if_long(size, tok.encode, text, add_special_tokens=False)
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
    body = await _read_json(request, state.config.max_body_bytes)
    req: CompletionRequest = parse_completion(body)
    _check_model(state, req.model)
    spec = response_format_spec(body)
    if spec is not None:
        req.options.kwargs["structured_output"] = spec
    tok = state.llm.tokenizer
    jobs: list[Job] = []
    texts: list[str | None] = []
    for p, prompt in enumerate(req.prompts):
        if isinstance(prompt, str):
            ids = await _off_loop_if_long(len(prompt), tok.encode, prompt, add_special_tokens=True)
            texts.append(prompt)
        else:
            ids = list(prompt)
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
    gen = Generation(state.engine, answer.jobs, state.metrics, answer.arrival)
    try:
        await unless_disconnected(request.receive, gen.start)
    except ClientDisconnected:
        return Response(status_code=499)
    state.metrics.prompt_tokens.inc(gen.num_prompt_tokens)
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
    if state.status == "loading":
        return JSONResponse({"status": "loading"}, status_code=503)
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


async def _server_error(request: Request, exc: Exception) -> Response:
    log.exception("unhandled error on %s %s", request.method, request.url.path, exc_info=exc)
    return JSONResponse(error_body(500, f"internal server error: {type(exc).__name__}: {exc}", code="internal_error"),
                        status_code=500)


def create_app(config: ServerConfig, state: ServerState | None = None) -> Starlette:
    """Build the app; the model loads in the background once the server starts (``/health`` says when)."""
    state = state or ServerState(config)

    @contextlib.asynccontextmanager
    async def lifespan(app: Starlette) -> AsyncIterator[None]:
        app.state.loader_task = asyncio.create_task(state.load())
        try:
            yield
        finally:
            state.shutdown()

    app = Starlette(
        routes=[
            Route("/v1/chat/completions", chat_completions, methods=["POST"]),
            Route("/v1/completions", completions, methods=["POST"]),
            Route("/v1/models", list_models, methods=["GET"]),
            Route("/v1/models/{model:path}", get_model, methods=["GET"]),
            Route("/health", health, methods=["GET"]),
            Route("/metrics", metrics, methods=["GET"]),
        ],
        middleware=[Middleware(AccessLogMiddleware, metrics=state.metrics),
                    Middleware(APIKeyMiddleware, api_key=config.api_key)],
        exception_handlers={APIError: _api_error, HTTPException: _http_error, Exception: _server_error},
        lifespan=lifespan,
    )
    app.state.server = state
    return app
