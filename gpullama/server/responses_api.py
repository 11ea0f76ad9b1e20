"""``POST /v1/responses``: OpenAI's Responses API (what the SDK's ``client.responses.create`` calls), over the same
chat template and engine as chat completions.

The request's `input` (a string or a list of messages) and `instructions` become chat messages; the answer is a
``response`` object whose `output` is a list of items, streamed as typed server-sent events (``response.created``,
``response.output_item.added``, ``response.output_text.delta``, ..., ``response.completed``). The model's text goes
into one assistant ``message`` item today. Function tools will add ``function_call`` items next to it: their
request fields are refused in `_refuse_unsupported` until tool calling exists, `OutputItems` is where their items
and events will be built, and `input_messages` where ``function_call``/``function_call_output`` input items will
become chat messages.
"""

from __future__ import annotations

import itertools
import time
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

import orjson
from starlette.requests import Request
from starlette.responses import Response

from gpullama.engine.admission import MAX_MESSAGES

from .common import (
    JSONResponse,
    check_model,
    off_loop_if_long,
    read_json,
    require_ready,
    server_state,
    start_generation,
)
from .errors import APIError
from .generation import Generation, Job
from .protocol import CHAT_ROLES, SamplingOptions, _options, sampling_params
from .sse import ClientDisconnected, SSEResponse, unless_disconnected

# the sampling fields a Responses request may carry: OpenAI's, and the extra ones the other endpoints take (as vLLM)
# message items' roles (tool results arrive as function_call_output items, once tool calling joins here)
INPUT_ROLES = {k: v for k, v in CHAT_ROLES.items() if k != "tool"}
SAMPLING_FIELDS = ("temperature", "top_p", "top_k", "min_p", "presence_penalty", "frequency_penalty",
                   "repetition_penalty", "seed", "stop", "stop_token_ids", "logit_bias", "ignore_eos")
TEXT_PARTS = ("input_text", "output_text", "text")


@dataclass
class ResponsesRequest:
    """A validated ``POST /v1/responses`` body."""

    model: str | None
    messages: list[dict[str, str]]
    options: SamplingOptions
    stream: bool
    instructions: str | None
    echo: dict[str, Any] = field(default_factory=dict)  # request fields the response object repeats


def _bad(param: str, message: str) -> APIError:
    return APIError(400, message, param=param)


def _kind(value: Any) -> str:
    return "null" if value is None else type(value).__name__


def _text(content: Any, where: str) -> str:
    """A message's content: a string, or a list of text parts (``input_text``, ``output_text``) joined."""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise _bad(where, f"'{where}' must be a string or a list of content parts, got {_kind(content)}")
    texts = []
    for j, part in enumerate(content):
        kind = part.get("type") if isinstance(part, dict) else _kind(part)
        if kind not in TEXT_PARTS or not isinstance(part.get("text"), str):
            raise _bad(f"{where}[{j}]", f"'{where}[{j}]' must be an input_text or output_text part with a 'text' "
                       f"string (only text is supported), got {kind!r}")
        texts.append(part["text"])
    return "\n".join(texts)


def input_messages(value: Any) -> list[dict[str, str]]:
    """Chat messages of the `input` field: a string is one user message; a list holds message items
    (``{"role", "content"}``, with or without ``"type": "message"``)."""
    if isinstance(value, str):
        return [{"role": "user", "content": value}]
    if not isinstance(value, list) or not value:
        raise _bad("input", f"'input' must be a string or a non-empty list of input items, got {_kind(value)}")
    if len(value) > MAX_MESSAGES:
        raise _bad("input", f"'input' holds {len(value)} items, more than the limit of {MAX_MESSAGES}")
    messages = []
    for i, item in enumerate(value):
        where = f"input[{i}]"
        if not isinstance(item, dict):
            raise _bad(where, f"'{where}' must be an object, got {_kind(item)}")
        kind = item.get("type", "message")
        if kind != "message":
            raise _bad(f"{where}.type", f"'{where}.type' {kind!r} is not supported: only message items (function "
                       "call items come with tool calling)")
        role = item.get("role")
        if not isinstance(role, str) or role not in INPUT_ROLES:
            shown = repr(role)[:40] if isinstance(role, str) else _kind(role)
            raise _bad(f"{where}.role", f"'{where}.role' must be one of {sorted(INPUT_ROLES)}, got {shown}")
        messages.append({"role": INPUT_ROLES[role], "content": _text(item.get("content"), f"{where}.content")})
    return messages


def _refuse_unsupported(body: dict) -> None:
    """Fields whose feature this server does not have: one clear 400 each, rather than a silent different answer."""
    if body.get("tools"):
        raise _bad("tools", "'tools' is not supported by /v1/responses yet (function tools come with tool calling)")
    if body.get("tool_choice") not in (None, "auto", "none"):
        raise _bad("tool_choice", "'tool_choice' must be 'auto' or 'none' without tools")
    if body.get("previous_response_id") is not None or body.get("conversation") is not None:
        param = "previous_response_id" if body.get("previous_response_id") is not None else "conversation"
        raise _bad(param, f"'{param}' is not supported: this server stores no responses; send the whole "
                   "conversation in 'input'")
    if body.get("background"):
        raise _bad("background", "'background' responses are not supported")
    text = body.get("text")
    fmt = text.get("format") if isinstance(text, dict) else None
    if (text is not None and not isinstance(text, dict)) or (fmt is not None and _type_of(fmt) != "text"):
        raise _bad("text.format", "only the 'text' output format is supported by /v1/responses yet")


def _type_of(value: Any) -> Any:
    return value.get("type") if isinstance(value, dict) else value


def parse_responses(body: Any) -> ResponsesRequest:
    """Validate a Responses body; raises ``APIError`` (400) naming the bad field."""
    if not isinstance(body, dict):
        raise APIError(400, f"the request body must be a JSON object, got {_kind(body)}")
    _refuse_unsupported(body)
    model = body.get("model")
    if model is not None and not isinstance(model, str):
        raise _bad("model", "'model' must be a string")
    if "input" not in body:
        raise _bad("input", "'input' is a required field")
    messages = input_messages(body["input"])
    instructions = body.get("instructions")
    if instructions is not None:
        if not isinstance(instructions, str):
            raise _bad("instructions", f"'instructions' must be a string, got {_kind(instructions)}")
        messages.insert(0, {"role": "system", "content": instructions})
    opts = _options({name: body[name] for name in SAMPLING_FIELDS if name in body})
    max_output = body.get("max_output_tokens")
    if max_output is not None and (isinstance(max_output, bool) or not isinstance(max_output, int) or max_output < 1):
        raise _bad("max_output_tokens", f"'max_output_tokens' must be an integer >= 1, got {max_output!r}")
    opts.max_tokens, opts.max_tokens_param = max_output, "max_output_tokens"
    stream = body.get("stream", False)
    if not isinstance(stream, bool):
        raise _bad("stream", f"'stream' must be a boolean, got {_kind(stream)}")
    metadata = body.get("metadata")
    if metadata is not None and not (isinstance(metadata, dict) and all(isinstance(v, str) for v in metadata.values())):
        raise _bad("metadata", "'metadata' must be an object of string values")
    echo = {
        "instructions": instructions,
        "max_output_tokens": max_output,
        "metadata": metadata or {},
        "parallel_tool_calls": body.get("parallel_tool_calls", True) is not False,
        "temperature": opts.kwargs.get("temperature", 1.0),
        "top_p": opts.kwargs.get("top_p", 1.0),
        "tool_choice": body.get("tool_choice") or "auto",
        "truncation": "disabled",
        "user": body.get("user") if isinstance(body.get("user"), str) else None,
    }
    return ResponsesRequest(model, messages, opts, stream, instructions, echo)


class OutputItems:
    """The response's output items as they grow: today one assistant message with one ``output_text`` part.

    Function-call items (``{"type": "function_call", "call_id", "name", "arguments"}`` with their
    ``response.function_call_arguments.delta`` events) join here once tool calling exists."""

    def __init__(self) -> None:
        self.message_id = f"msg_{uuid.uuid4().hex}"
        self.text = ""

    def message(self, status: str, with_content: bool = True) -> dict:
        """The message item (content empty when it is first announced)."""
        content = [self.text_part()] if with_content else []
        return {"type": "message", "id": self.message_id, "status": status, "role": "assistant", "content": content}

    def text_part(self, text: str | None = None) -> dict:
        """The ``output_text`` content part."""
        return {"type": "output_text", "text": self.text if text is None else text, "annotations": [], "logprobs": []}


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
            "previous_response_id": None, "reasoning": None, "text": {"format": {"type": "text"}}, "tools": [],
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


async def create_response(request: Request) -> Response:
    """``POST /v1/responses``."""
    arrival = time.perf_counter()
    state = server_state(request)
    require_ready(state)
    req = parse_responses(await read_json(request))
    check_model(state, req.model)
    tok = state.llm.tokenizer
    size = sum(len(m["content"]) for m in req.messages)
    try:
        text = await off_loop_if_long(size, tok.apply_chat_template, req.messages, add_generation_prompt=True)
    except Exception as exc:  # jinja2 errors (raise_exception in templates) and ValueError
        raise APIError(400, f"the chat template rejected this input: {exc}", param="input") from exc
    ids = await off_loop_if_long(size, tok.encode, text, add_special_tokens=False)
    response = ResponseObject(req, state.model_name)
    job = Job(0, ids, sampling_params(req.options), prompt_param="input", max_tokens_param="max_output_tokens",
              request_id=response.id)
    gen = await start_generation(request, state, [job], arrival)
    if gen is None:
        return Response(status_code=499)
    if req.stream:
        return SSEResponse(_events(response, gen))
    return await _whole(request, response, gen)


async def _whole(request: Request, response: ResponseObject, gen: Generation) -> Response:
    items = OutputItems()

    async def collect() -> dict:
        finish = None
        try:
            async for _, delta in gen.deltas():
                items.text += delta.text
                finish = delta.finish_reason or finish
        finally:
            await gen.close()
        status = _status(finish)
        return response.build(status, [items.message(status)], gen, finish)

    try:
        return JSONResponse(await unless_disconnected(request.receive, collect))
    except ClientDisconnected:
        return Response(status_code=499)


def _event(sequence: itertools.count, kind: str, **fields: Any) -> bytes:
    """One typed SSE event: ``event: TYPE`` and its JSON (which repeats the type and carries a sequence number)."""
    data = orjson.dumps({"type": kind, "sequence_number": next(sequence), **fields})
    return b"event: " + kind.encode() + b"\ndata: " + data + b"\n\n"


async def _events(response: ResponseObject, gen: Generation) -> AsyncIterator[bytes]:
    """The Responses event stream: created, in_progress, the message item and its text part opened, text deltas,
    everything closed in reverse, then completed (or incomplete at the token limit, or failed)."""
    seq = itertools.count()
    items = OutputItems()
    where = {"item_id": items.message_id, "output_index": 0, "content_index": 0}
    yield _event(seq, "response.created", response=response.build("in_progress", []))
    yield _event(seq, "response.in_progress", response=response.build("in_progress", []))
    yield _event(seq, "response.output_item.added", output_index=0, item=items.message("in_progress", False))
    yield _event(seq, "response.content_part.added", **where, part=items.text_part(""))
    finish = None
    try:
        async for _, delta in gen.deltas():
            if delta.text:
                items.text += delta.text
                yield _event(seq, "response.output_text.delta", **where, delta=delta.text, logprobs=[])
            finish = delta.finish_reason or finish
    except APIError as exc:
        error = {"code": "server_error", "message": exc.message}
        yield _event(seq, "response.failed",
                     response=response.build("failed", [items.message("incomplete")], gen, error=error))
        return
    finally:
        await gen.close()
    status = _status(finish)
    yield _event(seq, "response.output_text.done", **where, text=items.text, logprobs=[])
    yield _event(seq, "response.content_part.done", **where, part=items.text_part())
    yield _event(seq, "response.output_item.done", output_index=0, item=items.message(status))
    kind = "response.completed" if status == "completed" else "response.incomplete"
    yield _event(seq, kind, response=response.build(status, [items.message(status)], gen, finish))
