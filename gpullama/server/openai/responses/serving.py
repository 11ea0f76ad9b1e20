"""``POST /v1/responses``: OpenAI's Responses API (what the SDK's ``client.responses.create`` calls), over the same
chat template, tool and structured-output planning, output parsing and engine as chat completions.

The request (`request.py`) becomes chat messages and chat's tool and format fields, which `chat_plan.plan_chat`
turns into the prompt and the grammar; the answer is a ``response`` object whose `output` is a list of items
(`items.py`: reasoning, the assistant message, function calls), streamed as
typed server-sent events (``response.created``, ``response.output_item.added``, ``response.output_text.delta``,
``response.function_call_arguments.delta``, ..., ``response.completed``).
"""

from __future__ import annotations

import itertools
import time
import uuid
from collections.abc import AsyncIterator
from typing import Any

from starlette.requests import Request
from starlette.responses import Response

from gpullama.chat.model_format import chat_format

from ...http.body import JSONResponse, off_loop_if_long
from ...http.errors import APIError
from ...http.streaming import ClientDisconnected, StreamResponse, typed_event, unless_disconnected
from ...pipeline.chat_output import ChatOutputShaper
from ...pipeline.chat_plan import DEFAULTS, ChatPlan, image_input, plan_chat, render_planned_chat
from ...pipeline.generation import Generation, Job, prompt_progress, start_generation
from ...pipeline.intake import read_json_for_model
from ...pipeline.sampling import sampling_params
from ...registry import answer_name
from ...state import ChatDefaults, check_model
from .items import Event, OutputItems
from .request import NAMES, ResponsesRequest, parse_responses


class ResponseObject:
    """Builds the ``response`` object of one request at each stage of its life."""

    def __init__(self, request: ResponsesRequest, model: str) -> None:
        self.id = f"resp_{uuid.uuid4().hex}"
        self.created_at = int(time.time())
        self.request = request
        self.model = model

    def build(self, status: str, output: list[dict], gen: Generation | None = None, finish: str | None = None,
              error: dict | None = None) -> dict:
        """The object with `status` (``in_progress``, ``completed``, ``incomplete``, ``failed``) and `output`."""
        return {
            "id": self.id, "object": "response", "created_at": self.created_at, "status": status,
            "completed_at": int(time.time()) if status == "completed" else None,
            "error": error, "model": self.model, "output": output,
            "incomplete_details": {"reason": "max_output_tokens"} if finish == "length" else None,
            **self.request.echo,
            "previous_response_id": None, "reasoning": None,
            "usage": _usage(gen) if gen is not None and status != "in_progress" else None,
        }


def _usage(gen: Generation) -> dict:
    prompt, output = gen.num_prompt_tokens, gen.num_generated_tokens
    return {"input_tokens": prompt,
            "input_tokens_details": {"cached_tokens": gen.num_cached_tokens, "cache_write_tokens": 0},
            "output_tokens": output, "output_tokens_details": {"reasoning_tokens": 0},
            "total_tokens": prompt + output}


def _status(finish: str | None) -> str:
    return "incomplete" if finish == "length" else "completed"


def prepare(tokenizer: Any, req: ResponsesRequest, defaults: ChatDefaults = DEFAULTS,
            images: dict | None = None) -> tuple[ChatPlan, str, list[int]]:
    """Plan the request's tools and format as chat's (errors in chat's names), render the chat template and
    tokenize (a worker thread may run it); `images`: `image_input` of the server."""
    plan = plan_chat(req.chat_fields, req.messages, chat_format(tokenizer), defaults)
    text, ids = render_planned_chat(tokenizer, plan, req.options.kwargs, **(images or {}))
    return plan, text, ids


def _input_size(req: ResponsesRequest) -> int:
    """Characters of the conversation, to decide whether rendering it leaves the event loop."""
    size = 0
    for m in req.messages:
        size += len(m["content"]) + sum(len(c["function"]["arguments"]) for c in m.get("tool_calls", ()))
    return size


async def create_response(request: Request) -> Response:
    """``POST /v1/responses``."""
    arrival = time.perf_counter()
    request.state.field_names = NAMES
    state, body = await read_json_for_model(request)
    req = parse_responses(body, state.config.defaults)
    check_model(state, req.model)
    images = image_input(state)
    size = _input_size(req) if images["vision"] is None else 1 << 62  # images are encoded off the event loop
    plan, prompt, ids = await off_loop_if_long(size, prepare, state.llm.tokenizer, req, state.config.chat, images)
    response = ResponseObject(req, answer_name(request, state))
    job = Job(0, ids, sampling_params(req.options), request_id=response.id)
    gen = await start_generation(request, state, [job], arrival)
    if gen is None:
        return Response(status_code=499)
    shaper = ChatOutputShaper(plan, prompt)
    items = OutputItems(shaper if shaper.active else None)
    if req.stream:
        return StreamResponse(_events(response, gen, items))
    return await _whole(request, response, gen, items)


async def _whole(request: Request, response: ResponseObject, gen: Generation, items: OutputItems) -> Response:
    """The whole response: the same item steps as the stream, without the events."""

    async def collect() -> dict:
        finish = None
        try:
            async for _, delta in gen.deltas():
                items.feed(delta.text)
                finish = delta.finish_reason or finish
        finally:
            await gen.close()
        status = _status(finish)
        items.end(status)
        return response.build(status, items.output(), gen, finish)

    try:
        return JSONResponse(await unless_disconnected(request.receive, collect))
    except ClientDisconnected:
        return Response(status_code=499)


def _event(sequence: itertools.count, kind: str, **fields: Any) -> bytes:
    """One typed SSE event: ``event: TYPE`` and its JSON (which repeats the type and carries a sequence number)."""
    return typed_event(kind, {"type": kind, "sequence_number": next(sequence), **fields})


async def _events(response: ResponseObject, gen: Generation, items: OutputItems) -> AsyncIterator[bytes]:
    """The Responses event stream: created, in_progress, then each output item opened, grown by its deltas and
    closed in turn, then completed (or incomplete at the token limit, or failed)."""
    seq = itertools.count()

    def send(events: list[Event]) -> list[bytes]:
        return [_event(seq, kind, **fields) for kind, fields in events]

    yield _event(seq, "response.created", response=response.build("in_progress", []))
    yield _event(seq, "response.in_progress", response=response.build("in_progress", []))
    finish = None
    started: float | None = None  # when the first prompt-progress event went out
    try:
        async for _, delta in gen.deltas():
            if delta.num_computed_prompt_tokens is not None:  # return_progress: llama.cpp's in_progress events
                now = time.perf_counter()
                started = started or now
                progress = prompt_progress(delta, gen.num_prompt_tokens, started, now)
                yield _event(seq, "response.in_progress", response=response.build("in_progress", []),
                             prompt_progress=progress)
                continue
            for chunk in send(items.feed(delta.text)):
                yield chunk
            finish = delta.finish_reason or finish
    except APIError as exc:
        error = {"code": "server_error", "message": NAMES.apply(exc).message}
        yield _event(seq, "response.failed", response=response.build("failed", items.fail(), gen, error=error))
        return
    finally:
        await gen.close()
    status = _status(finish)
    for chunk in send(items.end(status)):
        yield chunk
    kind = "response.completed" if status == "completed" else "response.incomplete"
    yield _event(seq, kind, response=response.build(status, items.output(), gen, finish))
