"""``POST /api/chat`` and ``POST /api/generate``: Ollama's chat and completion, over the common chat plan, answered
as one JSON object or as newline-delimited JSON (Ollama streams by default).

A streamed answer is one line per piece of text (``message.content`` or ``response``; ``thinking`` for reasoning),
then the tool calls, each whole once it is complete (Ollama sends calls whole, arguments as an object), then a
last line with ``done: true``, ``done_reason`` (``stop`` or ``length``) and the counts and durations (in
nanoseconds). The whole answer is the same fields joined."""

from __future__ import annotations

import json
import logging
import time
import uuid
from collections.abc import AsyncIterator
from typing import Any

from starlette.requests import Request
from starlette.responses import Response

from gpullama.chat.model_format import chat_format

from ..http.body import JSONResponse, off_loop_if_large, parse_json
from ..http.errors import OLLAMA, APIError, FieldNames, internal_error
from ..http.fields import bad, bool_field, object_body, str_field
from ..http.streaming import NDJSON_MEDIA_TYPE, ClientDisconnected, StreamResponse, ndjson_line, unless_disconnected
from ..pipeline.chat_output import ChatOutputShaper
from ..pipeline.chat_plan import ChatPlan, image_input, plan_chat, render_planned_chat, response_format_spec
from ..pipeline.generation import Generation, Job, start_generation
from ..pipeline.infill import fim_prompt_ids
from ..pipeline.intake import prepare_size, read_model_body
from ..pipeline.sampling import SamplingOptions, sampling_params
from ..registry import answer_name, find_model, use_model
from ..state import ServerState
from .request import (
    GENERATE_NAMES,
    NAMES,
    chat_messages,
    check_model_name,
    now_iso,
    options,
    response_format,
    think,
    with_images,
)

log = logging.getLogger("gpullama.server")


class OllamaAnswer:
    """Turns an answer's text into Ollama's fields piece by piece: text (``content`` for chat, ``response`` for
    generate), ``thinking``, and the tool calls, each released whole once complete."""

    def __init__(self, shaper: ChatOutputShaper | None, text_key: str) -> None:
        self.shaper = shaper
        self.text_key = text_key
        self.text: list[str] = []
        self.thinking: list[str] = []
        self.calls: list[dict[str, Any]] = []  # {"name", "arguments" (text so far)}
        self.released = 0  # calls already sent

    def feed(self, text: str) -> list[dict[str, Any]]:
        """The fields each piece of `text` settles (a list of partial messages)."""
        if not text:
            return []
        return self._add(self.shaper.delta(0, text) if self.shaper is not None else {"content": text}, False)

    def end(self) -> list[dict[str, Any]]:
        """What the shaper held back, and the calls not yet released."""
        return self._add(self.shaper.finish(0) if self.shaper is not None else None, True)

    def whole(self) -> dict[str, Any]:
        """Every field joined."""
        out: dict[str, Any] = {self.text_key: "".join(self.text)}
        if self.thinking:
            out["thinking"] = "".join(self.thinking)
        if self.calls:
            out["tool_calls"] = [_call(c) for c in self.calls]
        return out

    def _add(self, fields: dict[str, Any] | None, final: bool) -> list[dict[str, Any]]:
        out: list[dict[str, Any]] = []
        fields = fields or {}
        if fields.get("reasoning"):
            self.thinking.append(fields["reasoning"])
            out.append({self.text_key: "", "thinking": fields["reasoning"]})
        if fields.get("content"):
            self.text.append(fields["content"])
            out.append({self.text_key: fields["content"]})
        for piece in fields.get("tool_calls", ()):
            if piece["index"] >= len(self.calls):
                self.calls.append({"name": piece["function"]["name"], "arguments": ""})
            self.calls[piece["index"]]["arguments"] += piece["function"].get("arguments", "")
        done = len(self.calls) if final else len(self.calls) - 1  # the last call may still grow
        if done > self.released:
            out.append({self.text_key: "", "tool_calls": [_call(c) for c in self.calls[self.released:done]]})
            self.released = done
        return out


def _call(call: dict[str, Any]) -> dict[str, Any]:
    try:
        arguments = json.loads(call["arguments"] or "{}")
    except ValueError:  # a call cut by num_predict
        arguments = {}
    return {"function": {"name": call["name"], "arguments": arguments if isinstance(arguments, dict) else {}}}


def _stats(gen: Generation, arrival: float, finish: str | None) -> dict[str, Any]:
    """The last object's fields: done, done_reason, counts and nanosecond durations."""
    end = time.perf_counter()
    first = gen.first_token_at or end
    return {"done": True, "done_reason": "length" if finish == "length" else "stop",
            "total_duration": int((end - arrival) * 1e9), "load_duration": 0,
            "prompt_eval_count": gen.num_prompt_tokens, "prompt_eval_duration": int((first - arrival) * 1e9),
            "eval_count": gen.num_generated_tokens, "eval_duration": int(((gen.last_token_at or first) - first) * 1e9)}


async def _answer(request: Request, state: ServerState, ids: list[int], opts: SamplingOptions, plan: ChatPlan | None,
                  prompt: str, chat: bool, stream: bool, names: FieldNames, arrival: float) -> Response:
    """Run the request and answer whole or as NDJSON."""
    job = Job(0, ids, sampling_params(opts), request_id=f"ollama-{uuid.uuid4().hex}")
    gen = await start_generation(request, state, [job], arrival)
    if gen is None:
        return Response(status_code=499)
    shaper = ChatOutputShaper(plan, prompt) if plan is not None else None
    answer = OllamaAnswer(shaper if shaper is not None and shaper.active else None, "content" if chat else "response")
    model = answer_name(request, state)
    output_ids: list[int] = []

    def line(fields: dict[str, Any], done: bool = False) -> dict[str, Any]:
        head = {"model": model, "created_at": now_iso()}
        if chat:
            return {**head, "message": {"role": "assistant", **fields}, "done": done}
        return {**head, **fields, "done": done}

    if stream:
        async def lines() -> AsyncIterator[bytes]:
            finish = None
            try:
                async for _, delta in gen.deltas():
                    output_ids.extend(delta.token_ids)
                    for fields in answer.feed(delta.text):
                        yield ndjson_line(line(fields))
                    finish = delta.finish_reason or finish
                for fields in answer.end():
                    yield ndjson_line(line(fields))
                last = {**line({"content": ""} if chat else {"response": ""}), **_stats(gen, arrival, finish)}
                if not chat:
                    last["context"] = ids + output_ids
                yield ndjson_line(last)
            except APIError as exc:
                yield ndjson_line(OLLAMA.body(names.apply(exc)))
            except Exception:  # noqa: BLE001 - a bug of ours: the client gets an error line, the log the detail
                log.exception("streaming %s failed (request id %s)", job.request_id, gen.http_request_id)
                yield ndjson_line(OLLAMA.body(internal_error(gen.http_request_id)))
            finally:
                await gen.close()

        return StreamResponse(lines(), media_type=NDJSON_MEDIA_TYPE)

    async def collect() -> dict:
        finish = None
        try:
            async for _, delta in gen.deltas():
                output_ids.extend(delta.token_ids)
                answer.feed(delta.text)
                finish = delta.finish_reason or finish
        finally:
            await gen.close()
        answer.end()
        out = {**line(answer.whole()), **_stats(gen, arrival, finish)}
        if not chat:
            out["context"] = ids + output_ids
        return out

    try:
        return JSONResponse(await unless_disconnected(request.receive, collect))
    except ClientDisconnected:
        return Response(status_code=499)


def _prepare_chat(request: Request, state: ServerState, raw: bytes):
    body = object_body(parse_json(raw))
    check_model_name(state, body.get("model"))
    messages = chat_messages(body.get("messages"))
    opts = options(body, state.llm.max_model_len, state.config.defaults)
    stream = bool_field(body, "stream", default=True)
    chat_fields = {"tools": body.get("tools") or None, "response_format": response_format(body),
                   "chat_template_kwargs": think(body)}
    request.state.field_names = NAMES
    tok = state.llm.tokenizer
    plan = plan_chat(chat_fields, messages, chat_format(tok), state.config.chat)
    text, ids = render_planned_chat(tok, plan, opts.kwargs, **image_input(state))
    return opts, plan, text, ids, stream


async def chat(request: Request) -> Response:
    """``POST /api/chat``; no messages only loads the model (``keep_alive: 0``: unloads it), as Ollama answers."""
    arrival, raw, name, keep_alive = await read_model_body(request)
    if not _has(raw, "messages"):
        return await _load_or_unload(request, name, keep_alive, chat=True)
    state = await use_model(request, name, keep_alive)
    opts, plan, text, ids, stream = await off_loop_if_large(prepare_size(state, raw), _prepare_chat, request, state,
                                                            raw)
    return await _answer(request, state, ids, opts, plan, text, True, stream, NAMES, arrival)


def _has(raw: bytes, *names: str) -> bool:
    """Whether a body (when it is a JSON object) gives one of `names` as something other than empty."""
    try:
        body = parse_json(raw)
    except APIError:
        return True  # the endpoint's parse says what is wrong
    return not isinstance(body, dict) or any(body.get(name) not in (None, "", []) for name in names)


async def _load_or_unload(request: Request, name: Any, keep_alive: float | None, chat: bool) -> Response:
    """Ollama's idiom for an empty request: load the model and answer ``done_reason: "load"``; with
    ``keep_alive: 0``, unload it (without loading it first) and answer ``"unload"``."""
    if keep_alive == 0:
        entry = find_model(request, name)
        check_model_name(entry, name)
        entry.request_unload()
        if entry.active == 0:
            await entry.released()
        reason, model = "unload", entry.model_name
    else:
        entry = await use_model(request, name, keep_alive)
        check_model_name(entry, name)
        reason, model = "load", entry.model_name
    head = {"model": model, "created_at": now_iso()}
    fields = {"message": {"role": "assistant", "content": ""}} if chat else {"response": ""}
    return JSONResponse({**head, **fields, "done": True, "done_reason": reason})


def _prepare_generate(request: Request, state: ServerState, raw: bytes):
    body = object_body(parse_json(raw))
    check_model_name(state, body.get("model"))
    prompt = str_field(body, "prompt") or ""
    for name in ("context", "template"):
        if body.get(name):
            raise bad(name, f"'{name}' is not supported" + (
                ": send the conversation to /api/chat" if name == "context" else ""))
    system = str_field(body, "system")
    raw_mode = bool_field(body, "raw")
    opts = options(body, state.llm.max_model_len, state.config.defaults)
    stream = bool_field(body, "stream", default=True)
    request.state.field_names = GENERATE_NAMES
    tok = state.llm.tokenizer
    suffix = str_field(body, "suffix")
    if body.get("images") and (suffix or raw_mode):
        raise bad("images", "'images' need the chat template: not with 'raw' or 'suffix'")
    if suffix:  # fill in the middle: the prompt is the code before (llama.cpp's /infill layout)
        opts.kwargs["stop_token_ids"] = [*opts.kwargs.get("stop_token_ids", []), *tok.fim.stop_ids]
        return opts, None, prompt, fim_prompt_ids(tok, state.llm.max_model_len, prompt, suffix), stream, False
    if raw_mode:  # the prompt as written, as a completion
        spec = response_format_spec({"response_format": response_format(body)})
        if spec is not None:
            opts.kwargs["structured_output"] = spec
        return opts, None, prompt, tok.encode(prompt, add_special_tokens=True), stream, prompt == ""
    content = with_images(prompt, body.get("images"), "images")
    messages = ([{"role": "system", "content": system}] if system else []) + [{"role": "user", "content": content}]
    fields = {"response_format": response_format(body), "chat_template_kwargs": think(body)}
    plan = plan_chat(fields, messages, chat_format(tok), state.config.chat)
    text, ids = render_planned_chat(tok, plan, opts.kwargs, **image_input(state))
    return opts, plan, text, ids, stream, prompt == ""


async def generate(request: Request) -> Response:
    """``POST /api/generate``; an empty prompt only loads the model (done at once, as Ollama answers it; with
    ``keep_alive: 0`` it unloads it)."""
    arrival, raw, name, keep_alive = await read_model_body(request)
    if keep_alive == 0 and not _has(raw, "prompt", "system", "suffix"):
        return await _load_or_unload(request, name, keep_alive, chat=False)
    state = await use_model(request, name, keep_alive)
    opts, plan, text, ids, stream, empty = await off_loop_if_large(prepare_size(state, raw), _prepare_generate,
                                                                   request, state, raw)
    if empty:
        return JSONResponse({"model": state.model_name, "created_at": now_iso(), "response": "", "done": True,
                             "done_reason": "load"})
    return await _answer(request, state, ids, opts, plan, text, False, stream, GENERATE_NAMES, arrival)
